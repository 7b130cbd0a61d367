"""Loader batches onto the device as the network's input, one batch ahead on CUDA.

`to_model_input(batch, device, painter)` moves a batch (compact, `data.transfer`, or already
float32) to `device` and expands it there: float32 input, target (drawn there by `painter`, the
dataset's `data.device_targets.TargetPainter`) and mask. The person slots that no sample of the
batch uses are cut on the host before the copy. It is idempotent, so a batch that `DeviceFeed`
already delivered passes through unchanged.

`DeviceFeed(batches, device, painter)` iterates loader batches as `to_model_input` gives them. On CUDA the
copy (from pinned memory, non-blocking) and the expansion of batch n + 1 are queued on a side
stream before batch n is handed over, so they overlap batch n's compute. An event recorded on the
side stream right after batch n's work marks its end, and the compute stream waits on that event
when it takes batch n: on batch n's copy alone, never on batch n + 1's, queued since. The side
stream is one per device for the whole run (the caching allocator keeps its free blocks per
stream, so a new stream each epoch would strand the last one's). Anywhere else it is a plain loop:
no stream call is ever made off CUDA. `training_feed(data, device)` is the loop's `batches` of a
run's training loader, through a `DeviceFeed`.
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator

import torch

from data.transfer import expand, is_compact, trim_people


def to_model_input(batch, device: torch.device, painter, non_blocking: bool = True):
    """(input, target, mask) of `batch` on `device`, float32, whatever form the batch has."""
    return _moved_and_expanded(_trimmed(batch), device, painter, non_blocking)


def _moved_and_expanded(batch, device: torch.device, painter, non_blocking: bool):
    """`to_model_input` of a batch whose unused person slots are already cut."""
    moved = tuple(t.to(device, non_blocking=non_blocking) for t in batch)
    return expand(*moved, painter) if is_compact(moved) else moved


def _trimmed(batch):
    """A compact batch without its unused person slots (`data.transfer.trim_people`); others as they are."""
    if not is_compact(batch):
        return batch
    image, people, masks = batch
    return image, trim_people(people).contiguous(), masks


def one_ahead(items: Iterable, start: Callable, finish: Callable) -> Iterator:
    """finish(start(item)) for each item, in order, where item n + 1 is started before item n is
    finished and handed over (nothing is started beyond the item after the one handed over)."""
    source = iter(items)
    try:
        pending = start(next(source))
    except StopIteration:
        return
    for item in source:
        following = start(item)
        yield finish(pending)
        pending = following
    yield finish(pending)


class DeviceFeed:
    """Iterable of the model inputs of `batches` on `device` (see the module docstring)."""

    def __init__(self, batches: Iterable, device: torch.device, painter):
        self.batches = batches
        self.device = torch.device(device)
        self.painter = painter

    def __iter__(self) -> Iterator:
        if self.device.type != "cuda":
            return (to_model_input(batch, self.device, self.painter) for batch in self.batches)
        stream = side_stream(self.device)
        return one_ahead(self.batches,
                         lambda batch: _start_copy(batch, self.device, self.painter, stream),
                         lambda started: _take(*started, self.device))


_SIDE_STREAMS: dict = {}


def side_stream(device: torch.device):
    """The side stream of `device` that every feed of this process queues its copies on."""
    device = torch.device(device)
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


def _start_copy(batch, device: torch.device, painter, stream):
    """Queue batch's copy and expansion (the target drawing included) on `stream`, then an event
    that marks their end (CUDA only); returns (the tensors, the event)."""
    pinned = [t if t.is_pinned() else t.pin_memory() for t in _trimmed(batch)]
    with torch.cuda.stream(stream):
        moved = _moved_and_expanded(pinned, device, painter, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(stream)
    return moved, ready


def _take(moved, ready, device: torch.device):
    """Make the compute stream wait for this batch's work (its event), and tell the allocator
    that stream uses the tensors."""
    current = torch.cuda.current_stream(device)
    current.wait_event(ready)
    for tensor in moved:
        tensor.record_stream(current)
    return moved


def training_feed(data, device) -> Callable[[int, int], Iterator]:
    """`batches(epoch, start)`: the model inputs of `epoch` from its batch `start` on (of `data`,
    an `engine.build.Data`), the targets drawn on the device."""
    painter = data.train_set.painter_for(device)

    def batches(epoch: int, start: int) -> Iterator:
        data.train_set.set_epoch(epoch)
        data.sampler.set_epoch(epoch, start)
        return iter(DeviceFeed(data.loader, device, painter))
    return batches
