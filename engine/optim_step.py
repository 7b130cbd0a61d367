"""One optimiser step over one or more batches, in one call (cf. mmengine's OptimWrapper):

    outcome = optim_step.update(batches, loss_of, stop_requested)

`loss_of(*batch)` runs a batch's forward and returns its loss. `OptimStep` owns gradient
accumulation (DDP's `no_sync` around every batch but the last), loss scaling through the
precision backend, the skip vote, unscaling, the float32 gradient norm, clipping, master weights,
the step, `zero_grad` and the bookkeeping of skipped steps (BatchNorm buffers restored, so a
skipped step leaves no trace). The precision backend (`engine.precision.PrecisionBackend`) only
does what it is told: backward through its scaler, unscale, step or skip (and the scale), free
the gradients; every decision that needs all ranks to agree is taken here, in one place.

One host sync per step: the losses stay on the device. A bad loss (not finite, or above
`optim.skip_loss_above`) is not read before its backward: it poisons the step instead, its backward
being that of `loss * nan`, so every gradient is NaN, and DDP's all-reduce carries the NaN to every
rank. Every rank runs every backward (SyncBN's backward is a collective even under `no_sync`), so
none waits alone. The step then reads one small tensor, [loss sum, bad loss, non-finite norm,
stop], whose flags are first all-reduced (max) in one small collective: every rank takes the same
decision. `stop_requested()` is asked once, for that read. A step poisoned by its loss leaves the
loss scale as it was (it says nothing about the gradients' range); gradients that overflow by
themselves lower it.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from config.schema import OptimConfig
from runtime import distributed as dist
from engine.optim import clip_grads, grad_norm, rounding_note, set_lr


@dataclass
class StepOutcome:
    loss: float          # the mean of the batches' losses (a skipped step's too)
    skipped: bool        # no update: a bad loss on some rank, or non-finite gradients
    stop: bool           # some rank was asked to stop (signal) during the step
    note: str = ""       # a line for the run's console: O3's first update (`engine.optim.rounding_note`)


class OptimStep:
    def __init__(self, precision, optimizer, params: list, model: nn.Module, cfg: OptimConfig,
                 net: nn.Module | None = None, static_graph: bool = False,
                 rounding_lr: float | None = None):
        """`rounding_lr`: the LR at which the first step that updates measures how many updates of
        half weights round away (its `note`)."""
        self.precision, self.optimizer, self.params, self.cfg = precision, optimizer, params, cfg
        self.net, self.static_graph, self.rounding_lr = net, static_graph, rounding_lr
        self.buffers = list(model.buffers())    # restored when a step is skipped (BN statistics)
        self.buffers_before_step = [b.clone() for b in self.buffers]
        self.skipped_total, self.bad_streak = 0, 0
        self.backoff_skips = 0    # this process's skips that were a dynamic loss scale's overflows

    def set_lr(self, lr: float) -> None:
        set_lr(self.optimizer, lr)

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def update(self, batches: list, loss_of: Callable[..., torch.Tensor],
               stop_requested: Callable[[], bool] = lambda: False) -> StepOutcome:
        """One step over `batches`: every batch's forward (`loss_of(*batch)`) and backward, on
        every rank, then one precision update (unscale, norm, the step's one read, clipping, step
        or skip, zero the gradients); on a skip the BatchNorm statistics are put back."""
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
        return StepOutcome(loss_sum / len(batches), skipped, stop, note)

    def _sync_unless(self, last: bool):
        """Around a batch's forward and backward: DDP all-reduces gradients in the backward of a
        step's last batch only. With dist.static_graph it all-reduces every batch (the same mean):
        DDP's static graph mode fails an internal assert under no_sync."""
        no_sync = getattr(self.net, "no_sync", None)
        if no_sync is None or last or self.static_graph:
            return contextlib.nullcontext()
        return no_sync()

    @staticmethod
    def _read_step(norm: torch.Tensor, loss_sum: torch.Tensor, bad: torch.Tensor,
                   stop: bool) -> tuple[float, bool, bool, bool]:
        """The step's one host read: (loss sum, bad loss on some rank, non-finite norm on some
        rank, stop asked on some rank); the flags all-reduced (max) in one small collective."""
        bad = bad.float().to(norm.device)
        # the stop flag joins as a fill of a device tensor: no host-to-device copy that would sync
        flags = torch.stack([bad, torch.logical_not(torch.isfinite(norm)).float().reshape(()),
                             torch.full_like(bad, float(stop))])
        flags = dist.all_reduce_max(flags)
        loss_sum, bad, not_finite, stop = torch.cat(
            [loss_sum.reshape(1).to(norm.device), flags.to(norm.device)]).tolist()
        return loss_sum, bad > 0, not_finite > 0, stop > 0
