"""One optimiser step over one or more batches, in one call (cf. mmengine's OptimWrapper):

    outcome = optim_step.update(batches, loss_of, stop_requested)

`OptimStep` owns accumulation (DDP's `no_sync` but on the last batch), the skip vote, the float32
gradient norm, clipping and skipped steps (BatchNorm buffers restored); the precision backend only
does what it is told. One host sync per step: a bad loss (not finite, or above
`optim.skip_loss_above`) poisons its backward with NaN instead of being read, every rank runs every
backward, and one small tensor of flags, all-reduced, makes every rank decide alike. A step
poisoned by its loss leaves the loss scale as it was.
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable

import torch
from torch import nn

from config.schema import OptimConfig
from runtime import distributed as dist
from engine.optim import clip_grads, grad_norm, rounding_note
from engine.trainer import StepResult


class OptimStep:
    def __init__(self, precision, optimizer, params: list, model: nn.Module, cfg: OptimConfig,
                 net: nn.Module | None = None, static_graph: bool = False,
                 rounding_lr: float | None = None):
        """`rounding_lr`: the LR at which the first step measures half weights' rounding (`note`)."""
        self.precision, self.optimizer, self.params, self.cfg = precision, optimizer, params, cfg
        self.net, self.static_graph, self.rounding_lr = net, static_graph, rounding_lr
        self.buffers = list(model.buffers())    # restored when a step is skipped (BN statistics)
        self.buffers_before_step = [b.clone() for b in self.buffers]
        self.skipped_total, self.bad_streak = 0, 0
        self.backoff_skips = 0    # this process's skips that were a dynamic loss scale's overflows

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def update(self, batches: list, loss_of: Callable[..., torch.Tensor],
               stop_requested: Callable[[], bool] = lambda: False) -> StepResult:
        """One step over `batches`: each batch's forward (`loss_of(*batch)`) and backward, then
        unscale, norm, the one read, clipping, step or skip (BatchNorm statistics put back); the
        result's loss is the mean of the batches' (a skipped step's too), its `note` O3's first
        update (`engine.optim.rounding_note`)."""
        if self.buffers:                 # one multi-tensor copy, not a kernel per buffer
            torch._foreach_copy_(self.buffers_before_step, self.buffers)
        loss_sum = bad = None
        for i, batch in enumerate(batches):
            with self._sync_unless(last=i == len(batches) - 1):
                loss = loss_of(*batch)
                value = loss.detach().float()
                bad_now = torch.logical_not(torch.isfinite(value)) | (value > self.cfg.skip_loss_above)
                loss_sum = value if loss_sum is None else loss_sum + value
                bad = bad_now if bad is None else bad | bad_now
                poison = torch.where(bad_now, torch.full_like(value, math.nan), torch.ones_like(value))
                self.precision.backward(loss * poison.to(loss.dtype) / len(batches))
        self.precision.unscale_(self.optimizer)
        norm = grad_norm(self.params).to(loss_sum.device)   # float32 whatever the grads' dtype
        loss_sum, bad_loss, not_finite, stop = self._read_step(norm, loss_sum, bad, stop_requested())
        skipped, note = bad_loss or not_finite, ""
        if not skipped and self.cfg.clip_grad_norm:   # no clipping pass when clipping is off
            clip_grads(self.params, self.cfg.clip_grad_norm, norm)
        if not skipped and self.rounding_lr is not None:
            note, self.rounding_lr = rounding_note(self.params, self.rounding_lr, self.cfg), None
        self.precision.step(self.optimizer, not skipped, bad_loss=bad_loss)
        self.precision.zero_grad(self.optimizer)
        if skipped and self.buffers:   # a skipped step leaves no trace, not even in BN statistics
            with torch.no_grad():
                torch._foreach_copy_(self.buffers, self.buffers_before_step)
        self.skipped_total += skipped
        self.backoff_skips += skipped and not bad_loss and self.precision.dynamic
        self.bad_streak = self.bad_streak + 1 if skipped else 0
        return StepResult(loss_sum / len(batches), self.lr, skipped, stop, note=note)

    def _sync_unless(self, last: bool):
        """DDP's `no_sync` but on the step's last batch (not with static_graph, which fails under it)."""
        no_sync = getattr(self.net, "no_sync", None)
        if no_sync is None or last or self.static_graph:
            return contextlib.nullcontext()
        return no_sync()

    @staticmethod
    def _read_step(norm: torch.Tensor, loss_sum: torch.Tensor, bad: torch.Tensor,
                   stop: bool) -> tuple[float, bool, bool, bool]:
        """The step's one host read: (loss sum, bad loss, non-finite norm, stop), flags over ranks."""
        bad = bad.float().to(norm.device)
        # the stop flag joins as a fill of a device tensor: no host-to-device copy that would sync
        flags = torch.stack([bad, torch.logical_not(torch.isfinite(norm)).float().reshape(()),
                             torch.full_like(bad, float(stop))])
        flags = dist.all_reduce_max(flags)
        loss_sum, bad, not_finite, stop = torch.cat(
            [loss_sum.reshape(1).to(norm.device), flags.to(norm.device)]).tolist()
        return loss_sum, bad > 0, not_finite > 0, stop > 0
