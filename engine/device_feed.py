"""Loader batches onto the device as the network's input, one batch ahead on CUDA.

`to_model_input` moves a batch (compact, `data.transfer`, or already float32) to the device and
expands it there (targets drawn by the dataset's `TargetPainter`); it is idempotent. `DeviceFeed`
iterates loader batches so; on CUDA it queues batch n + 1's copy and expansion on one side stream
per device before handing over batch n, and the compute stream waits on batch n's event only. Off
CUDA no stream call is ever made.
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
    """finish(start(item)) for each item in order, item n + 1 started before item n is finished."""
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
    """Queue batch's copy and expansion on `stream`, then an event; returns (the tensors, event)."""
    pinned = [t if t.is_pinned() else t.pin_memory() for t in _trimmed(batch)]
    with torch.cuda.stream(stream):
        moved = _moved_and_expanded(pinned, device, painter, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(stream)
    return moved, ready


def _take(moved, ready, device: torch.device):
    """Make the compute stream wait for this batch's event, and record it on the tensors."""
    current = torch.cuda.current_stream(device)
    current.wait_event(ready)
    for tensor in moved:
        tensor.record_stream(current)
    return moved


def training_feed(data, device) -> Callable[[int, int], Iterator]:
    """`batches(epoch, start)` of `data`'s training loader, through a `DeviceFeed`."""
    painter = data.train_set.painter_for(device)

    def batches(epoch: int, start: int) -> Iterator:
        data.train_set.set_epoch(epoch)
        data.sampler.set_epoch(epoch, start)
        return iter(DeviceFeed(data.loader, device, painter))
    return batches
