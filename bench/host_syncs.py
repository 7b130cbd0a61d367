"""Counting host syncs: the host's waits for the device.

(1) Reads of a tensor's value on the host (`item`, `tolist`, `bool()`, `float()`, `int()`,
`numpy()`), counted on any device by wrapping those methods of `torch.Tensor` while the context is
open (copies to the host are not counted); (2) on CUDA, torch's own synchronising operations, each a
warning of its sync debug mode "warn" outside a read of (1), as `cuda_sync` (torch's SyncBatchNorm
makes one per layer and forward; the engine's CrossProcessBatchNorm reads one `item()` instead).
Tensors that live on the host in a GPU run too (the optimiser's step counters:
`optimizer_step_counters`) are passed as `host_tensors`; given a GPU `device`, no read of a tensor in
host memory counts.

    with count_host_syncs() as syncs:
        trainer.run_step(inputs)
    print(syncs.count, syncs.by_kind)
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field

import torch

READS = ("item", "tolist", "__bool__", "__float__", "__int__", "numpy")
SYNC_WARNING = "called a synchronizing CUDA operation"     # torch's text in sync debug mode "warn"


@dataclass
class HostSyncs:
    by_kind: dict = field(default_factory=dict)

    @property
    def count(self) -> int:
        return sum(self.by_kind.values())


def optimizer_step_counters(optimizer) -> list:
    """The optimiser's per-parameter step counters that live on the CPU (see the module's docstring)."""
    states = getattr(optimizer, "state", {}).values()
    return [s["step"] for s in states if torch.is_tensor(s.get("step")) and s["step"].device.type == "cpu"]


@contextlib.contextmanager
def count_host_syncs(host_tensors=(), device=None):
    """Count the host's waits for the device inside the block: reads of tensor values, and on
    CUDA torch's own synchronizing operations (see the module's docstring)."""
    syncs = HostSyncs()
    ignored = {id(t) for t in host_tensors}
    on_gpu = device is not None and torch.device(device).type != "cpu"
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    inside = [0]     # a read made by another read (float() through item()) is not counted again

    def counting(name, read):
        def wrapper(self, *args, **kwargs):
            if not inside[0] and id(self) not in ignored and not (on_gpu and self.device.type == "cpu"):
                syncs.by_kind[name] = syncs.by_kind.get(name, 0) + 1
            inside[0] += 1
            try:
                return read(self, *args, **kwargs)
            finally:
                inside[0] -= 1
        return wrapper

    for name, read in originals.items():
        setattr(torch.Tensor, name, counting(name, read))
    try:
        cuda = on_gpu and torch.device(device).type == "cuda" and torch.cuda.is_available()
        with _cuda_syncs(syncs, inside) if cuda else contextlib.nullcontext():
            yield syncs
    finally:
        for name, read in originals.items():
            setattr(torch.Tensor, name, read)


@contextlib.contextmanager
def _cuda_syncs(syncs: HostSyncs, inside: list):
    """Kind (2) of the module's docstring: torch's sync debug mode "warn" for the block, each of
    its warnings outside a read counted as `cuda_sync` (and not shown)."""
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.filterwarnings("always", message=SYNC_WARNING)
        show = warnings.showwarning

        def counted(message, *args, **kwargs):
            if SYNC_WARNING not in str(message):
                return show(message, *args, **kwargs)
            if not inside[0]:
                syncs.by_kind["cuda_sync"] = syncs.by_kind.get("cuda_sync", 0) + 1

        warnings.showwarning = counted
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)
