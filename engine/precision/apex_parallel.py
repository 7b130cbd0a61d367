"""The apex backend's SyncBN and DDP: `apex.parallel.convert_syncbn_model` and
`apex.parallel.DistributedDataParallel`, with the arguments and mends the engine needs.

SyncBN. With Apex's CUDA extensions, `apex.parallel.SyncBatchNorm` is the optimized one: it is
built with `channel_last` set as the run's memory format (channels_last models otherwise get an
NCHW copy in every BN layer). The Python-only build gives Apex's fallback SyncBatchNorm, which
refuses `channel_last` and is mended in two ways (`_MendedFallbackSyncBN`): it returns its output
in its input's dtype (under O2 it stays float32, as BatchNorm does, and returned float32 into the
next float16 convolution), and its running statistics keep their tensors (it assigned new ones
every training forward, so whatever held the old ones, e.g. the snapshot of BN statistics a
skipped step restores, or an EMA's buffer copies, worked on dead tensors).

DDP. Apex's DDP all-reduces the sum of the ranks' gradients, then divides by the world size
(`gradient_predivide_factor` 1): float16 scaled gradients would overflow N times sooner than under
torch's DDP, which divides first. It is given `gradient_predivide_factor = world size`, so each
rank divides before the sum and nothing is divided after (the same mean).
"""
from __future__ import annotations

import contextlib
import importlib

import torch
from torch import nn

from config.schema import DistConfig


def _apex_parallel():
    return importlib.import_module("apex.parallel")


def is_optimized_sync_bn(cls) -> bool:
    """Whether `cls` is Apex's optimized (CUDA extension) SyncBatchNorm."""
    return cls.__module__.endswith("optimized_sync_batchnorm")


def convert_sync_bn(model: nn.Module, channels_last: bool) -> nn.Module:
    """`--sync-bn` under the apex backend (see the module's doc). Each SyncBatchNorm keeps the very
    parameters and mode of the batch norm it replaces (Apex's conversion gives it new parameters,
    which would unfreeze a frozen one and leave the optimiser's references behind)."""
    parallel = _apex_parallel()
    before = {name: m for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
    if is_optimized_sync_bn(parallel.SyncBatchNorm):
        model = parallel.convert_syncbn_model(model, channel_last=channels_last)
    else:
        model = parallel.convert_syncbn_model(model)
    mended = _mended_class(parallel.SyncBatchNorm)
    for name, module in model.named_modules():
        if name in before and module is not before[name]:
            old = before[name]
            if old.affine:
                module.weight, module.bias = old.weight, old.bias
            module.train(old.training)
            for key, value in vars(old).items():     # marks set on it, e.g. engine.freeze's
                if key.startswith("_frozen"):
                    setattr(module, key, value)
        if type(module) is parallel.SyncBatchNorm and not is_optimized_sync_bn(type(module)):
            module.__class__ = mended
    return model


_MENDED: dict[type, type] = {}


def _mended_class(fallback: type) -> type:
    if fallback not in _MENDED:
        class _MendedFallbackSyncBN(fallback):
            """Apex's Python SyncBatchNorm, output in the input's dtype, running statistics kept in
            their own tensors."""

            def forward(self, input):
                kept = (self.running_mean, self.running_var)
                out = super().forward(input)
                with torch.no_grad():
                    for name, tensor in zip(("running_mean", "running_var"), kept):
                        now = getattr(self, name)
                        if tensor is not None and now is not tensor:
                            tensor.copy_(now)
                            setattr(self, name, tensor)
                return out if out.dtype == input.dtype else out.to(input.dtype)

        _MendedFallbackSyncBN.__name__ = _MendedFallbackSyncBN.__qualname__ = "MendedFallbackSyncBatchNorm"
        _MENDED[fallback] = _MendedFallbackSyncBN
    return _MENDED[fallback]


def ddp_arguments(dist_cfg: DistConfig, world_size: int) -> dict:
    """The keyword arguments of `apex.parallel.DistributedDataParallel` (see the module's doc)."""
    return {"delay_allreduce": dist_cfg.delay_allreduce,
            "gradient_predivide_factor": float(world_size), "gradient_average": True}


def wrap_ddp(model: nn.Module, dist_cfg: DistConfig, world_size: int) -> nn.Module:
    """`apex.parallel.DistributedDataParallel`, with the `no_sync()` the engine uses for gradient
    accumulation (Apex's disable_allreduce: no all-reduce in the forward and backward passes under
    it; the last batch's backward all-reduces the sum)."""
    base = _apex_parallel().DistributedDataParallel

    class ApexDDP(base):
        @contextlib.contextmanager
        def no_sync(self):
            self.disable_allreduce()
            try:
                yield
            finally:
                self.enable_allreduce()

    return ApexDDP(model, **ddp_arguments(dist_cfg, world_size))
