"""One optimiser step over one or more batches (cf. mmengine's OptimWrapper): `OptimStep` owns
gradient accumulation (DDP's `no_sync`), loss scaling through the precision backend, the skip vote,
unscaling, the float32 gradient norm, clipping, master weights, the step, `zero_grad` and the
bookkeeping of skipped steps (BatchNorm buffers restored, so a skipped step leaves no trace).

The engine drives it per step:

    optim_step.begin(len(batches))
    for i, batch in enumerate(batches):
        with optim_step.accumulating(last=i == len(batches) - 1):
            loss = forward(batch)
            if not optim_step.backward(loss, stop_requested):
                break
    outcome = optim_step.finish()

The precision backend (`engine.amp.Precision`, or another with the same methods) does the scaling,
unscaling and stepping; this object decides when. Every decision that needs all ranks to agree (the
skip vote) is taken here, in one place.
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


@dataclass
class StepOutcome:
    loss: float          # the mean of the batches' losses (those computed before a skip)
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
        self._losses, self._count, self._abnormal, self._stop = [], 1, False, False

    def set_lr(self, lr: float) -> None:
        set_lr(self.optimizer, lr)

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def begin(self, count: int) -> None:
        """A step over `count` batches starts."""
        self._losses, self._count, self._abnormal, self._stop = [], count, False, False
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

    def backward(self, loss: torch.Tensor, stop_requested: bool = False) -> bool:
        """Vote on the batch's loss (and a stop) with every rank, then backward through the loss
        scaler; False when the step is to be skipped (no more batches should run)."""
        self._losses.append(loss.item())
        bad = not math.isfinite(self._losses[-1]) or self._losses[-1] > self.cfg.skip_loss_above
        # voted before every backward: SyncBN's backward is a collective even under no_sync
        abnormal, stop_now = dist.any_ranks([bad, stop_requested])
        self._stop = self._stop or stop_now
        if abnormal:
            self._abnormal = True
            return False
        self.precision.backward(loss / self._count)
        return True

    def finish(self) -> StepOutcome:
        """Unscale, norm (float32), clip, step (or skip), zero the gradients, count skips."""
        grads_finite = False
        if not self._abnormal:
            self.precision.unscale_(self.optimizer)
            norm = grad_norm(self.params)                 # float32 whatever the gradients' dtype
            grads_finite = bool(torch.isfinite(norm))
            if grads_finite and self.cfg.clip_grad_norm:   # no clipping pass when clipping is off
                clip_grads(self.params, self.cfg.clip_grad_norm, norm)
            self.precision.step(self.optimizer, grads_finite)
        self.precision.zero_grad(self.optimizer)
        skipped = not grads_finite
        if skipped and self.buffers:   # a skipped step leaves no trace, not even in BN statistics
            with torch.no_grad():
                torch._foreach_copy_(self.buffers, self.buffers_before_step)
        self.skipped_total += skipped
        self.bad_streak = self.bad_streak + 1 if skipped else 0
        return StepOutcome(sum(self._losses) / len(self._losses), skipped, self._stop)
