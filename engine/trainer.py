"""The training loop and nothing else: `Trainer(parts, hooks)` runs epochs of optimiser steps over
the batches its parts give, with hooks around every step and epoch.

It knows no configuration, no run directory and no launch mode: a test builds one from a model
with its loss, an `OptimStep` and a list of model inputs. engine/run_trainer.py assembles the
`Trainer` that train.py, train_parallel.py and train_distributed.py run (`build_trainer`); the LR,
logging, validation, checkpoints, early stopping and any user feature are hooks (engine/hooks.py,
engine/epoch_end.py, engine/checkpoint_hooks.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import torch
from torch import nn

from runtime import distributed as dist
from engine.hooks import Hook, Interrupted, Throughput

__all__ = ["Trainer", "TrainParts", "StepResult", "Interrupted", "Hook"]


@dataclass
class TrainParts:
    """What the loop runs. `net(images, target, mask)` -> (per-sample loss [B], dict of per-sample
    loss parts): the model and its loss as one module. `batches(epoch, start)` -> an iterator of
    model inputs (images, target, mask) from batch `start` of `epoch` on."""
    net: nn.Module
    optim_step: object                 # engine.optim_step.OptimStep, or one with its `update`
    batches: Callable[[int, int], Iterator]
    batches_per_epoch: int             # a whole number of steps of `accumulate` batches
    epochs: int = 1
    accumulate: int = 1                # batches per optimiser step
    samples_per_step: int = 1          # for the samples-per-second figure

    @staticmethod
    def feed(inputs: Iterable) -> Callable[[int, int], Iterator]:
        """`batches` of a fixed list of model inputs, the same every epoch."""
        inputs = list(inputs)
        return lambda epoch, start: iter(inputs[start:])


@dataclass
class StepResult:
    """One optimiser step, as `run_step` returns it and hooks' `after_step` receive it."""
    loss: float                 # the mean of the step's batches' losses
    lr: float
    skipped: bool               # no update: a bad loss on some rank, or non-finite gradients
    stop: bool                  # some rank was asked to stop (signal) during the step
    parts: dict = field(default_factory=dict)    # the loss's parts, mean over the batches (tensors)
    epoch: int = 0
    first: int = 0              # the step's first batch in its epoch
    samples_per_s: float = 0.0
    last_of_epoch: bool = False
    note: str = ""              # a line for the run's console (OptimStep's: O3's first update)


class Trainer:
    def __init__(self, parts: TrainParts, hooks: Iterable[Hook] = ()):
        self.parts, self.net, self.optim_step = parts, parts.net, parts.optim_step
        self.hooks = sorted(hooks, key=lambda hook: hook.priority)
        self.epoch, self.start_batch, self.step = 0, 0, 0     # where the run is
        self.stop_signal = None           # set (by the pre-emption hook) to stop after the step
        self.finish_requested = False     # set by a hook (early stopping): no further epoch
        self.steps_this_epoch = 0

    # -- one step -------------------------------------------------------------------------------
    def run_step(self, inputs: list) -> StepResult:
        """One optimisation step over the model inputs `inputs` (more than one: gradient
        accumulation), each (images, target, mask) on the device."""
        parts = {}

        def loss_of(images, target, mask):
            per_sample, losses = self.net(images, target, mask)
            for k, v in losses.items():
                parts[k] = parts.get(k, 0) + v.detach().mean() / len(inputs)
            return per_sample.mean()
        out = self.optim_step.update(inputs, loss_of, lambda: self.stop_signal is not None)
        return StepResult(out.loss, self.optim_step.lr, out.skipped, out.stop, parts, note=out.note)

    # -- epochs ---------------------------------------------------------------------------------
    def train_one_epoch(self, epoch: int) -> float | None:
        """The epoch's steps, hooks around each; the mean loss of its counted steps over all ranks."""
        self.net.train()
        start, self.start_batch, accumulate = self.start_batch, 0, self.parts.accumulate
        self.steps_this_epoch = max(0, self.parts.batches_per_epoch - start) // accumulate
        self._call("before_epoch", epoch)
        loss_sum, count = torch.zeros((), dtype=torch.float64), 0
        rate = Throughput(self.parts.samples_per_step)
        batches = self.parts.batches(epoch, start)
        for n in range(self.steps_this_epoch):
            first = start + n * accumulate
            self._call("before_step", epoch, first)
            out = self.run_step([next(batches) for _ in range(accumulate)])
            self.step += 1
            if not out.skipped:
                loss_sum += out.loss
                count += 1
            out.epoch, out.first, out.samples_per_s = epoch, first, rate.step()
            out.last_of_epoch = n == self.steps_this_epoch - 1
            self._call("after_step", out)
        # mean over ranks too (every rank has the same count: skips are decided together)
        totals = dist.all_reduce_sum(torch.stack([loss_sum, torch.tensor(count, dtype=torch.float64)]))
        return None if totals[1] == 0 else (totals[0] / totals[1]).item()

    @property
    def batches_per_epoch(self) -> int:
        return self.parts.batches_per_epoch

    def _call(self, event: str, *args) -> None:
        for hook in self.hooks:
            getattr(hook, event)(self, *args)

    # -- the run --------------------------------------------------------------------------------
    def fit(self) -> dict:
        """The epochs from `self.epoch` on; {"epoch": epochs done, "step": steps done, and what
        each hook's `outcome()` reports}."""
        try:
            self._call("before_train")
            epochs_done = self.epoch
            for epoch in range(self.epoch, self.parts.epochs):
                if self.finish_requested:
                    break
                train_loss = self.train_one_epoch(epoch)
                epochs_done = epoch + 1
                self._call("after_epoch", epoch, train_loss)
            self._call("after_train")
            result = {"epoch": epochs_done, "step": self.step}
            for hook in self.hooks:
                result.update(hook.outcome())
            return result
        except Exception as exc:
            failure = self.failure(exc)
            if failure is None:
                raise
            raise failure from None
        finally:
            self._call("on_stop")

    def failure(self, exc: Exception) -> Exception | None:
        """The error to raise instead of `exc` (e.g. a user's message for running out of
        memory), or None to raise `exc` itself."""
        return None
