"""One optimiser step over one or more batches (cf. mmengine's OptimWrapper): `OptimStep` owns
gradient accumulation (DDP's `no_sync`), loss scaling through the precision backend, the skip vote,
unscaling, the float32 gradient norm, clipping, master weights, the step, `zero_grad` and the
bookkeeping of skipped steps (BatchNorm buffers restored, so a skipped step leaves no trace).

The engine drives it per step:

    optim_step.begin(len(batches))
    for i, batch in enumerate(batches):
        with optim_step.accumulating(last=i == len(batches) - 1):
            loss = forward(batch)
            optim_step.backward(loss, stop_requested)
    outcome = optim_step.finish()

The precision backend (`engine.precision.PrecisionBackend`) does the scaling, unscaling and
stepping, in one `update(optimizer, decide)` per step; this object decides when, and `decide` is
its part of that update (norm, skip vote, clipping). Every decision that needs all ranks to agree (the
skip vote) is taken here, in one place.

One host sync per step: the losses stay on the device. A bad loss (not finite, or above
`optim.skip_loss_above`) is not read before its backward: it poisons the step instead, its backward
being that of `loss * nan`, so every gradient is NaN, and DDP's all-reduce carries the NaN to every
rank. Every rank runs every backward (SyncBN's backward is a collective even under `no_sync`), so
none waits alone. `finish` then reads one small tensor, [norm, loss sum, bad loss, non-finite norm,
stop], whose flags are first all-reduced (max) in one small collective: every rank takes the same
decision. A step poisoned by its loss leaves the loss scale as it was (it says nothing about the
gradients' range); gradients that overflow by themselves lower it.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch import nn

from config.schema import OptimConfig
from runtime import distributed as dist
from engine.optim import clip_grads, grad_norm, set_lr
from engine.precision import StepDecision


@dataclass
class StepOutcome:
    loss: float          # the mean of the batches' losses (a skipped step's too)
    skipped: bool        # no update: a bad loss on some rank, or non-finite gradients
    stop: bool           # some rank was asked to stop (signal) during the step


class OptimStep:
    def __init__(self, precision, optimizer, params: list, model: nn.Module, cfg: OptimConfig,
                 net: nn.Module | None = None, static_graph: bool = False):
        self.precision, self.optimizer, self.params, self.cfg = precision, optimizer, params, cfg
        self.net, self.static_graph = net, static_graph
        self.buffers = list(model.buffers())    # restored when a step is skipped (BN statistics)
        self.buffers_before_step = [b.clone() for b in self.buffers]
        self.skipped_total, self.bad_streak = 0, 0
        self._count, self._stop, self._loss_sum, self._bad, self._batches = 1, False, None, None, 0
        # called once, with `params`, at the first step that updates (gradients unscaled, clipped)
        self.first_update_check = None

    def set_lr(self, lr: float) -> None:
        set_lr(self.optimizer, lr)

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def begin(self, count: int) -> None:
        """A step over `count` batches starts."""
        self._count, self._stop, self._loss_sum, self._bad, self._batches = count, False, None, None, 0
        if self.buffers:                 # one multi-tensor copy, not a kernel per buffer
            torch._foreach_copy_(self.buffers_before_step, self.buffers)

    def accumulating(self, last: bool):
        """Around a batch's forward and backward: DDP all-reduces gradients in the backward of a
        step's last batch only. With dist.static_graph it all-reduces every batch (the same mean):
        DDP's static graph mode fails an internal assert under no_sync."""
        no_sync = getattr(self.net, "no_sync", None)
        if no_sync is None or last or self.static_graph:
            return contextlib.nullcontext()
        return no_sync()

    def backward(self, loss: torch.Tensor, stop_requested: bool = False) -> None:
        """Backward of the batch's share of the step's loss through the loss scaler, without reading
        the loss on the host: a bad loss makes every gradient NaN (the step is then skipped by all
        ranks). Every batch of the step runs its backward, on every rank."""
        self._stop = self._stop or bool(stop_requested)
        value = loss.detach().float()
        bad = torch.logical_not(torch.isfinite(value)) | (value > self.cfg.skip_loss_above)
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
        self._bad = bad if self._bad is None else self._bad | bad
        self._batches += 1
        poison = torch.where(bad, torch.full_like(value, math.nan), torch.ones_like(value))
        self.precision.backward(loss * poison.to(loss.dtype) / self._count)

    def _read_step(self, norm: torch.Tensor) -> tuple[float, float, bool, bool, bool]:
        """The step's one host read: (norm, loss sum, bad loss on some rank, non-finite norm on some
        rank, stop asked on some rank); the flags all-reduced (max) in one small collective."""
        norm = norm.detach().float().reshape(())
        bad = self._bad.float().to(norm.device)
        # the stop flag joins as a fill of a device tensor: no host-to-device copy that would sync
        flags = torch.stack([bad, torch.logical_not(torch.isfinite(norm)).float(),
                             torch.full_like(bad, float(self._stop))])
        flags = dist.all_reduce_max(flags)
        norm_value, loss_sum, bad, not_finite, stop = torch.cat(
            [norm.reshape(1), self._loss_sum.reshape(1).to(norm.device), flags.to(norm.device)]).tolist()
        return norm_value, loss_sum, bad > 0, not_finite > 0, stop > 0

    def finish(self) -> StepOutcome:
        """One precision update (unscale, `_decide`, step or skip, zero the gradients); skips
        counted and, on a skip, the BatchNorm statistics put back."""
        decision = self.precision.update(self.optimizer, self._decide)
        skipped = not decision.grads_finite
        if skipped and self.buffers:   # a skipped step leaves no trace, not even in BN statistics
            with torch.no_grad():
                torch._foreach_copy_(self.buffers, self.buffers_before_step)
        self.skipped_total += skipped
        self.bad_streak = self.bad_streak + 1 if skipped else 0
        return StepOutcome(self._loss_sum_read / self._batches, skipped, self._stop)

    def _decide(self) -> StepDecision:
        """On unscaled gradients: the float32 norm, the step's one read, clipping; step or skip."""
        norm = grad_norm(self.params).to(self._loss_sum.device)   # float32 whatever the grads' dtype
        _, self._loss_sum_read, bad_loss, not_finite, self._stop = self._read_step(norm)
        grads_finite = not (bad_loss or not_finite)
        if grads_finite and self.cfg.clip_grad_norm:   # no clipping pass when clipping is off
            clip_grads(self.params, self.cfg.clip_grad_norm, norm)
        if grads_finite and self.first_update_check is not None:
            check, self.first_update_check = self.first_update_check, None
            check(self.params)
        return StepDecision(grads_finite, bad_loss)
