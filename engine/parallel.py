"""SyncBN (`--sync-bn`) and DDP for either backend; on CPU groups (gloo), where `nn.SyncBatchNorm`
refuses, `CrossProcessBatchNorm` computes the same statistics and gradients."""
from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from config.schema import AmpConfig, DistConfig
from runtime import distributed as group


def convert_sync_bn(model: nn.Module, ctx, amp: AmpConfig) -> nn.Module:
    """`--sync-bn`: `model`'s batch norms made cross-process; unchanged when not distributed."""
    if not ctx.distributed:
        return model
    if amp.backend == "apex":
        return apex_sync_bn(model)
    if ctx.device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return _to_cross_process(model)


def wrap_ddp(model: nn.Module, ctx, amp: AmpConfig, dist_cfg: DistConfig) -> nn.Module:
    """The backend's DDP (torch's `delay_allreduce`: one bucket, as Apex's); the model if not distributed."""
    if not ctx.distributed:
        return model
    if amp.backend == "apex":
        return apex_ddp(model, dist_cfg, ctx.world_size)
    if dist_cfg.delay_allreduce:
        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        bucket_mb = math.ceil(grad_bytes / 2**20) + 1
    else:
        bucket_mb = dist_cfg.bucket_cap_mb
    on_cuda = ctx.device.type == "cuda"
    ddp = nn.parallel.DistributedDataParallel
    # newer PyTorch renamed broadcast_buffers (buffers are synced at start either way)
    buffers_kw = ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(ddp).parameters
                  else "broadcast_buffers")
    return ddp(model, device_ids=[ctx.device.index] if on_cuda else None,
               output_device=ctx.device.index if on_cuda else None, bucket_cap_mb=bucket_mb,
               find_unused_parameters=dist_cfg.find_unused_parameters,
               static_graph=dist_cfg.static_graph, **{buffers_kw: dist_cfg.broadcast_buffers})


# -- native SyncBN on CPU: CrossProcessBatchNorm ----------------------------------------------------
class _CrossProcessBatchNormFn(torch.autograd.Function):
    """Normalisation with statistics and gradient sums all-reduced over the process group."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, factor, eps):
        dims = [0, *range(2, x.dim())]
        channel = (1, -1, *[1] * (x.dim() - 2))      # a [C] tensor viewed so that it broadcasts over x
        xf = x.float()
        local = torch.cat([torch.tensor([x.numel() / x.shape[1]], dtype=torch.float64, device=x.device),
                           xf.sum(dims, dtype=torch.float64), (xf * xf).sum(dims, dtype=torch.float64)])
        dist.all_reduce(local)
        channels, total = x.shape[1], local[0].item()
        if total <= 1:
            raise ValueError("Expected more than 1 value per channel when training, "
                             f"got input size {list(x.shape)} on this rank")
        mean = local[1:1 + channels] / total
        var = (local[1 + channels:] / total - mean * mean).clamp_min(0)
        if running_mean is not None:
            running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype), alpha=factor)
            unbiased = var * (total / (total - 1))
            running_var.mul_(1 - factor).add_(unbiased.to(running_var.dtype), alpha=factor)
        mean32, invstd = mean.float(), torch.rsqrt(var + eps).float()
        y = (xf - mean32.view(channel)) * invstd.view(channel)
        if weight is not None:
            y = y * weight.float().view(channel)
        if bias is not None:
            y = y + bias.float().view(channel)
        ctx.save_for_backward(x, weight, mean32, invstd)
        ctx.total, ctx.has_bias = total, bias is not None
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, mean, invstd = ctx.saved_tensors
        dims = [0, *range(2, x.dim())]
        channel = (1, -1, *[1] * (x.dim() - 2))
        dy = grad_out.float()
        xhat = (x.float() - mean.view(channel)) * invstd.view(channel)
        sum_dy = dy.sum(dims)
        sum_dy_xhat = (dy * xhat).sum(dims)
        grad_x = grad_w = grad_b = None
        if weight is not None and ctx.needs_input_grad[1]:
            grad_w = sum_dy_xhat.to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = sum_dy.to(weight.dtype if weight is not None else dy.dtype)
        if ctx.needs_input_grad[0]:
            both = torch.cat([sum_dy, sum_dy_xhat]).double()
            dist.all_reduce(both)
            mean_dy, mean_dy_xhat = (both / ctx.total).float().split(x.shape[1])
            scale = invstd if weight is None else invstd * weight.float()
            grad_x = (dy - mean_dy.view(channel) - xhat * mean_dy_xhat.view(channel))
            grad_x = (grad_x * scale.view(channel)).to(x.dtype)
        return grad_x, grad_w, grad_b, None, None, None, None


class CrossProcessBatchNorm(_BatchNorm):
    """Batch norm over the joint batch of all processes; plain in eval mode."""

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (N, C, ...), got {input.dim()}D input")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        normalise_with_batch = self.training or self.running_mean is None
        # the group's size raises once the group is lost or aborted
        if not normalise_with_batch or group.get_world_size() == 1:
            return super().forward(input)
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        update = self.training and self.track_running_stats
        if update and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        return _CrossProcessBatchNormFn.apply(
            input, self.weight, self.bias,
            self.running_mean if update else None, self.running_var if update else None,
            factor, self.eps)


def _move_state(src: _BatchNorm, dst: _BatchNorm) -> _BatchNorm:
    """Give `dst` the very parameters and buffers of `src` (optimizers keep their references)."""
    if src.affine:
        dst.weight, dst.bias = src.weight, src.bias
    dst.running_mean, dst.running_var = src.running_mean, src.running_var
    dst.num_batches_tracked = src.num_batches_tracked
    dst.train(src.training)
    return dst


def _to_cross_process(module: nn.Module) -> nn.Module:
    """`module` rebuilt with each batch norm in it a CrossProcessBatchNorm holding its tensors."""
    result = module
    if isinstance(module, _BatchNorm) and not isinstance(module, (nn.SyncBatchNorm, CrossProcessBatchNorm)):
        result = _move_state(module, CrossProcessBatchNorm(module.num_features, module.eps, module.momentum,
                                                           module.affine, module.track_running_stats,
                                                           device="meta"))
    for name, child in module.named_children():
        result.add_module(name, _to_cross_process(child))
    return result


# -- apex: apex.parallel's SyncBatchNorm and DistributedDataParallel, mended -----------------------
def apex_sync_bn(model: nn.Module) -> nn.Module:
    """`apex.parallel.convert_syncbn_model`, mended, each keeping the replaced batch norm's tensors, mode."""
    parallel = importlib.import_module("apex.parallel")
    before = {name: m for name, m in model.named_modules() if isinstance(m, _BatchNorm)}
    model = parallel.convert_syncbn_model(model)       # channel_last off: see _mended_class
    mended = _mended_class(parallel.SyncBatchNorm)
    for name, module in model.named_modules():
        if name in before and module is not before[name]:
            _move_state(before[name], module)
        if type(module) is parallel.SyncBatchNorm:
            module.__class__ = mended
    return model


@functools.cache
def _mended_class(apex_class: type) -> type:
    """Apex's SyncBatchNorm class (optimized or fallback), mended."""
    if apex_class.__module__.endswith("optimized_sync_batchnorm"):    # the CUDA extension's
        class Mended(apex_class):
            """Apex's optimized SyncBatchNorm given a channels_last training batch as its
            [N, H, W, C] view (what its `channel_last` flag means), the output permuted back."""

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
            kept in their own tensors (it assigns new ones)."""

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
    return Mended


def _memory_order_only(kernel):
    """`amp_C.multi_tensor_scale` given only pairs whose memory order is their logical order; the
    rest (channels_last gradients, which it permutes) copied stride-aware."""
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


def apex_ddp(model: nn.Module, dist_cfg: DistConfig, world_size: int) -> nn.Module:
    """Apex's DDP dividing by the world size before the sum (as torch's does; overflows later),
    with a `no_sync()` for gradient accumulation and channels_last gradients copied back right."""
    base = importlib.import_module("apex.parallel").DistributedDataParallel

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

    return ApexDDP(model, delay_allreduce=dist_cfg.delay_allreduce,
                   gradient_predivide_factor=float(world_size), gradient_average=True)
