"""Batch norm whose statistics span every process (`--sync-bn`).

On CUDA this is PyTorch's `nn.SyncBatchNorm`. PyTorch's refuses CPU tensors, so on CPU process
groups (gloo) `CrossProcessBatchNorm` does the same job: in training it all-reduces per-channel
count, sum and sum of squares (float64), normalises with the global mean and biased variance,
updates the running statistics with the unbiased global variance as BatchNorm does, and its
backward all-reduces the two per-channel gradient sums. Input gradients are then those of the
SUM of the ranks' losses over the joint batch, and weight/bias gradients are each rank's own,
which DDP averages: with a per-rank mean loss, the step equals one process on the whole batch
(the same convention as `nn.SyncBatchNorm`). In eval mode, or without a process group of more
than one process, it is plain batch norm. State-dict keys are those of `nn.BatchNorm2d`, so
checkpoints load either way.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from runtime import distributed as group


def _channel_view(t: torch.Tensor, ndim: int) -> torch.Tensor:
    return t.view(1, -1, *([1] * (ndim - 2)))


def _reduce_dims(x: torch.Tensor) -> list[int]:
    return [0] + list(range(2, x.dim()))


class _CrossProcessBatchNormFn(torch.autograd.Function):
    """Normalisation with statistics and gradient sums all-reduced over a process group."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, factor, eps, group):
        dims = _reduce_dims(x)
        xf = x.float()
        local = torch.cat([
            torch.tensor([x.numel() / x.shape[1]], dtype=torch.float64, device=x.device),
            xf.sum(dims, dtype=torch.float64),
            (xf * xf).sum(dims, dtype=torch.float64),
        ])
        dist.all_reduce(local, group=group)
        channels = x.shape[1]
        total = local[0].item()
        if total <= 1:
            raise ValueError("Expected more than 1 value per channel when training, "
                             f"got input size {list(x.shape)} on this rank")
        mean = local[1:1 + channels] / total
        var = (local[1 + channels:] / total - mean * mean).clamp_min(0)
        if running_mean is not None:
            running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype), alpha=factor)
            unbiased = var * (total / (total - 1))
            running_var.mul_(1 - factor).add_(unbiased.to(running_var.dtype), alpha=factor)
        mean32 = mean.float()
        invstd = torch.rsqrt(var + eps).float()
        y = (xf - _channel_view(mean32, x.dim())) * _channel_view(invstd, x.dim())
        if weight is not None:
            y = y * _channel_view(weight.float(), x.dim())
        if bias is not None:
            y = y + _channel_view(bias.float(), x.dim())
        ctx.save_for_backward(x, weight, mean32, invstd)
        ctx.total = total
        ctx.group = group
        ctx.has_bias = bias is not None
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, mean, invstd = ctx.saved_tensors
        dims = _reduce_dims(x)
        dy = grad_out.float()
        xhat = (x.float() - _channel_view(mean, x.dim())) * _channel_view(invstd, x.dim())
        sum_dy = dy.sum(dims)
        sum_dy_xhat = (dy * xhat).sum(dims)
        grad_x = grad_w = grad_b = None
        if weight is not None and ctx.needs_input_grad[1]:
            grad_w = sum_dy_xhat.to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = sum_dy.to(weight.dtype if weight is not None else dy.dtype)
        if ctx.needs_input_grad[0]:
            both = torch.cat([sum_dy, sum_dy_xhat]).double()
            dist.all_reduce(both, group=ctx.group)
            channels = x.shape[1]
            mean_dy = (both[:channels] / ctx.total).float()
            mean_dy_xhat = (both[channels:] / ctx.total).float()
            scale = invstd if weight is None else invstd * weight.float()
            grad_x = (dy - _channel_view(mean_dy, x.dim()) - xhat * _channel_view(mean_dy_xhat, x.dim()))
            grad_x = (grad_x * _channel_view(scale, x.dim())).to(x.dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None


class CrossProcessBatchNorm(_BatchNorm):
    """Batch norm over the joint batch of all processes of `process_group` (default: all),
    for inputs of any rank >= 2 (N, C, ...). Works on CPU/gloo where nn.SyncBatchNorm refuses."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True,
                 process_group=None, device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype)
        self.process_group = process_group
        self.original_class = nn.BatchNorm2d   # what revert_sync_bn turns it back into

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (N, C, ...), got {input.dim()}D input")

    def _group_size(self) -> int:
        if self.process_group is None:     # the default group: raises once it is lost or aborted
            return group.get_world_size()
        return dist.get_world_size(self.process_group)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        normalise_with_batch = self.training or self.running_mean is None
        if not normalise_with_batch or self._group_size() == 1:
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
            factor, self.eps, self.process_group)


def _replace_batchnorms(module: nn.Module, convert) -> nn.Module:
    """Rebuild `module` with `convert(m)` applied to every module (convert returns m if unchanged)."""
    result = convert(module)
    for name, child in module.named_children():
        result.add_module(name, _replace_batchnorms(child, convert))
    return result


def _move_state(src: _BatchNorm, dst: _BatchNorm) -> _BatchNorm:
    """Give `dst` the very parameters and buffers of `src` (optimizers keep their references)."""
    if src.affine:
        dst.weight, dst.bias = src.weight, src.bias
    dst.running_mean, dst.running_var = src.running_mean, src.running_var
    dst.num_batches_tracked = src.num_batches_tracked
    dst.train(src.training)
    return dst


def _to_cross_process(module: nn.Module) -> nn.Module:
    if not isinstance(module, _BatchNorm) or isinstance(module, (nn.SyncBatchNorm, CrossProcessBatchNorm)):
        return module
    bn = CrossProcessBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                               module.track_running_stats, device="meta")
    bn.original_class = type(module)
    return _move_state(module, bn)


def _to_plain(module: nn.Module) -> nn.Module:
    if not isinstance(module, (nn.SyncBatchNorm, CrossProcessBatchNorm)):
        return module
    cls = getattr(module, "original_class", nn.BatchNorm2d)
    bn = cls(module.num_features, module.eps, module.momentum, module.affine,
             module.track_running_stats, device="meta")
    return _move_state(module, bn)


def convert_sync_bn(model: nn.Module, ctx) -> nn.Module:
    """Batch norms of `model` made cross-process for `ctx` (an runtime.distributed.DistContext):
    nn.SyncBatchNorm on CUDA, CrossProcessBatchNorm on CPU; unchanged when not distributed."""
    if not ctx.distributed:
        return model
    if ctx.device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return _replace_batchnorms(model, _to_cross_process)


def revert_sync_bn(model: nn.Module) -> nn.Module:
    """Cross-process batch norms back to plain ones (BatchNorm2d unless the original is known)."""
    return _replace_batchnorms(model, _to_plain)
