"""The apex backend's SyncBN and DDP: `apex.parallel.convert_syncbn_model` and
`apex.parallel.DistributedDataParallel`, with the arguments and mends the engine needs.

SyncBN. With Apex's CUDA extensions, `apex.parallel.SyncBatchNorm` is the optimized one. Its
`channel_last` flag means "the channel is the last LOGICAL dim" (an [N, H, W, C] input), not
torch's memory format: given a channels_last [N, C, H, W] tensor it normalises the wrong dim (or
fails on a size mismatch, and in eval on its own `count_all`). So it is built with the flag off
and mended (`NHWCViewSyncBatchNorm`): a training forward (batch statistics) on a channels_last input
hands the kernels `x.permute(0, 2, 3, 1)`, the free contiguous [N, H, W, C] view of that memory,
with the flag on for that call, and permutes the output back (channels_last again, no copy either
way); any other input goes through with the flag off, and eval uses F.batch_norm, which takes
either format. The Python-only build gives Apex's fallback SyncBatchNorm, which refuses
`channel_last` and is mended in two ways (`MendedFallbackSyncBatchNorm`): it returns its output in its
input's dtype (under O2 it stays float32, as BatchNorm does, and returned float32 into the next
float16 convolution), and its running statistics keep their tensors (it assigned new ones every
training forward, so whatever held the old ones, e.g. the snapshot of BN statistics a skipped
step restores, or an EMA's buffer copies, worked on dead tensors).

DDP. Apex's DDP all-reduces the sum of the ranks' gradients, then divides by the world size
(`gradient_predivide_factor` 1): float16 scaled gradients would overflow N times sooner than under
torch's DDP, which divides first. It is given `gradient_predivide_factor = world size`, so each
rank divides before the sum and nothing is divided after (the same mean). With `amp_C` it copies
the all-reduced flat buffer (each gradient in its logical order, as `contiguous()` lays it out)
back with `multi_tensor_scale`, which walks every tensor as data_ptr + numel in MEMORY order: a
channels_last gradient of a convolution with a kernel over 1x1 came back permuted. `wrap_ddp`
hands that kernel only the gradients whose memory order is their logical order; the others (the
channels_last ones) get one stride-aware `_foreach_copy_`, as Apex's Python-only build copies all
of them. The model stays channels_last (its convolutions run as on the native backend) and no
gradient is copied twice.
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


def convert_sync_bn(model: nn.Module) -> nn.Module:
    """`--sync-bn` under the apex backend (see the module's doc), for either memory format. Each
    SyncBatchNorm keeps the very parameters and mode of the batch norm it replaces (Apex's
    conversion gives it new parameters, which would unfreeze a frozen one and leave the
    optimiser's references behind)."""
    parallel = _apex_parallel()
    before = {name: m for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
    model = parallel.convert_syncbn_model(model)       # channel_last off: see _mended_class
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
        if type(module) is parallel.SyncBatchNorm:
            module.__class__ = mended
    return model


_MENDED: dict[type, type] = {}


def _mended_class(apex_class: type) -> type:
    """Apex's SyncBatchNorm class (optimized or fallback) with the mends of the module's doc."""
    if apex_class not in _MENDED:
        if is_optimized_sync_bn(apex_class):
            class Mended(apex_class):
                """Apex's optimized SyncBatchNorm, given channels_last batches as their [N, H, W, C]
                view."""

                def forward(self, input):
                    batch_stats = self.training or not self.track_running_stats
                    self.channel_last = (batch_stats and input.dim() == 4 and not input.is_contiguous()
                                         and input.is_contiguous(memory_format=torch.channels_last))
                    if not self.channel_last:
                        return super().forward(input)
                    return super().forward(input.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
            name = "NHWCViewSyncBatchNorm"
        else:
            class Mended(apex_class):
                """Apex's Python SyncBatchNorm, output in the input's dtype, running statistics
                kept in their own tensors."""

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
            name = "MendedFallbackSyncBatchNorm"
        Mended.__name__ = Mended.__qualname__ = name
        _MENDED[apex_class] = Mended
    return _MENDED[apex_class]


def ddp_arguments(dist_cfg: DistConfig, world_size: int) -> dict:
    """The keyword arguments of `apex.parallel.DistributedDataParallel` (see the module's doc)."""
    return {"delay_allreduce": dist_cfg.delay_allreduce,
            "gradient_predivide_factor": float(world_size), "gradient_average": True}


def _memory_order_only(kernel):
    """`amp_C.multi_tensor_scale` (dst = src * scale, each tensor walked in memory order) given
    only the pairs whose memory order is their logical order; the rest (channels_last gradients
    of Apex DDP's logical-order buffer) copied stride-aware in one `_foreach_copy_` (see the
    module's doc)."""
    def scale(chunk_size, noop_flag, tensor_lists, factor):
        pairs = list(zip(*tensor_lists))
        walked = [pair for pair in pairs if pair[0].is_contiguous() and pair[1].is_contiguous()]
        strided = [pair for pair in pairs if not (pair[0].is_contiguous() and pair[1].is_contiguous())]
        if walked:
            kernel(chunk_size, noop_flag, [list(side) for side in zip(*walked)], factor)
        if strided:
            sources, targets = ([pair[i] for pair in strided] for i in (0, 1))
            torch._foreach_copy_(targets, sources)
            if factor != 1.0:
                torch._foreach_mul_(targets, factor)
    return scale


def wrap_ddp(model: nn.Module, dist_cfg: DistConfig, world_size: int) -> nn.Module:
    """`apex.parallel.DistributedDataParallel`, with the `no_sync()` the engine uses for gradient
    accumulation (Apex's disable_allreduce: no all-reduce in the forward and backward passes under
    it; the last batch's backward all-reduces the sum), and its copy-back right for channels_last
    gradients (see the module's doc)."""
    base = _apex_parallel().DistributedDataParallel

    class ApexDDP(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if hasattr(self, "multi_tensor_scale"):        # Apex with amp_C
                self.multi_tensor_scale = _memory_order_only(self.multi_tensor_scale)

        @contextlib.contextmanager
        def no_sync(self):
            self.disable_allreduce()
            try:
                yield
            finally:
                self.enable_allreduce()

    return ApexDDP(model, **ddp_arguments(dist_cfg, world_size))
