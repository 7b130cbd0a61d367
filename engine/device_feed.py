"""Loader batches onto the device as the network's input, one batch ahead on CUDA.

`to_model_input(batch, device)` moves a batch (compact, `data.transfer`, or already float32) to
`device` and expands it there: float32 input, target and mask. It is idempotent, so a batch that
`DeviceFeed` already delivered passes through unchanged.

`DeviceFeed(batches, device)` iterates loader batches as `to_model_input` gives them. On CUDA the
copy (from pinned memory, non-blocking) and the expansion of batch n + 1 are queued on a side
stream before batch n is handed over, so they overlap batch n's compute; the compute stream waits
for the side stream only when it takes the batch. Anywhere else it is a plain loop: no stream
call is ever made off CUDA.
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator

import torch

from data.transfer import expand, is_compact


def to_model_input(batch, device: torch.device, non_blocking: bool = True):
    """(input, target, mask) of `batch` on `device`, float32, whatever form the batch has."""
    moved = tuple(t.to(device, non_blocking=non_blocking) for t in batch)
    return expand(*moved) if is_compact(moved) else moved


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

    def __init__(self, batches: Iterable, device: torch.device):
        self.batches = batches
        self.device = torch.device(device)

    def __iter__(self) -> Iterator:
        if self.device.type != "cuda":
            return (to_model_input(batch, self.device) for batch in self.batches)
        stream = torch.cuda.Stream(self.device)
        return one_ahead(self.batches, lambda batch: _start_copy(batch, self.device, stream),
                         lambda moved: _take(moved, self.device, stream))


def _start_copy(batch, device: torch.device, stream):
    """Queue batch's copy and expansion on `stream` (CUDA only)."""
    pinned = [t if t.is_pinned() else t.pin_memory() for t in batch]
    with torch.cuda.stream(stream):
        return to_model_input(pinned, device, non_blocking=True)


def _take(moved, device: torch.device, stream):
    """Make the compute stream wait for `stream`, and tell the allocator it uses the tensors."""
    current = torch.cuda.current_stream(device)
    current.wait_stream(stream)
    for tensor in moved:
        tensor.record_stream(current)
    return moved
