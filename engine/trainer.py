"""The training loop and nothing else: `Trainer(inputs, hooks)` runs epochs of optimiser steps, hooks
(by `priority`, reading the loop through `LoopState`) around each step and epoch; it knows no config."""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Protocol

import torch
from torch import nn

from common.errors import UserError
from runtime import distributed as dist

__all__ = ["Trainer", "LoopInputs", "StepResult", "Interrupted", "Hook", "LoopState", "OptimiserStep"]


class OptimiserStep(Protocol):
    """What the loop and its hooks need of the optimiser step (engine.optim.OptimStep)."""
    skipped_total: int               # steps skipped for a bad loss or gradients, all told
    bad_streak: int                  # skipped steps in a row
    overflow_streak: int             # the last skips in a row whose gradients overflowed (finite loss)

    def update(self, batches: list, loss_of: Callable[..., torch.Tensor],
               stop_requested: Callable[[], bool] = ...) -> "StepResult":
        """One step over `batches` (`loss_of(*batch)` each), or a skip."""

    def set_lr(self, lr: float) -> None: ...


class LoopState(Protocol):
    """What a hook may read of the loop; it may set `stop_signal` and `finish_requested`."""
    model: nn.Module                 # the network whose weights train (unwrapped)
    net: nn.Module                   # what trains: the network and its loss, wrapped
    optim_step: OptimiserStep
    hooks: list
    epoch: int                       # the epoch a run starts or resumes at
    step: int                        # optimiser steps done
    epochs: int
    accumulate: int
    batches_per_epoch: int
    steps_this_epoch: int
    resumed: Any                     # the engine.checkpoints.TrainState resumed, or None
    stop_signal: int | None
    finish_requested: bool


class Hook:
    checkpoint_key: str | tuple | None = None   # keep state_dict() in checkpoints under this key
    priority: int = 50                          # lower runs first

    def before_train(self, trainer: LoopState) -> None: ...
    def before_epoch(self, trainer: LoopState, epoch: int) -> None: ...
    def before_step(self, trainer: LoopState, epoch: int, first: int) -> None: ...
    def after_step(self, trainer: LoopState, out: "StepResult") -> None: ...
    def after_validation(self, trainer: LoopState, epoch: int, results: dict) -> None: ...
    def after_epoch(self, trainer: LoopState, epoch: int, train_loss: float | None) -> None: ...
    def after_train(self, trainer: LoopState) -> None: ...
    def on_stop(self, trainer: LoopState) -> None:
        """Always, when the run ends: finished, stopped or failed."""

    def before_save(self, trainer: LoopState, name: str, state: dict) -> None:
        """On the main process, the checkpoint `name` about to be written: a hook may change it."""

    def evaluating(self, trainer: LoopState):
        """A context around validation, AP and saving best.pth (e.g. other weights swapped in)."""
        return contextlib.nullcontext()

    def state_dict(self):
        """What a checkpoint keeps of this hook (a tuple `checkpoint_key`: a dict of those keys)."""
        return {}

    def load_state_dict(self, state) -> None:
        """Continue from `state`; a CheckpointError saying what does not fit."""

    def state_missing(self, trainer: LoopState, path) -> None:
        """The checkpoint resumed (`path`) holds none of this hook's entries: it goes on fresh."""

    def outcome(self) -> dict:
        """What this hook adds to the result of `Trainer.fit()`."""
        return {}


class Interrupted(UserError):
    """SIGTERM / SIGUSR1: the run saved a checkpoint and stopped; resume continues it."""
    plain_message = True


@dataclass
class LoopInputs:
    """What the loop runs: `net(images, target, mask)` -> (per-sample loss [B], loss parts), and
    `batches(epoch, start)` -> model inputs from batch `start` of `epoch` on."""
    net: nn.Module
    optim_step: OptimiserStep
    batches: Callable[[int, int], Iterator]
    batches_per_epoch: int             # a whole number of steps of `accumulate` batches
    epochs: int = 1
    accumulate: int = 1                # batches per optimiser step
    samples_per_step: int = 1          # for the samples-per-second figure
    model: nn.Module | None = None     # the network inside `net` (None: `net` itself)

    @staticmethod
    def feed(inputs: Iterable) -> Callable[[int, int], Iterator]:
        """`batches` of a fixed list of model inputs, the same every epoch."""
        inputs = list(inputs)
        return lambda epoch, start: iter(inputs[start:])


@dataclass
class StepResult:
    """One optimiser step, as `OptimStep.update` and `run_step` return it to hooks' `after_step`."""
    loss: float                 # the mean of the step's batches' losses
    lr: float
    skipped: bool               # no update: a bad loss on some rank, or non-finite gradients
    stop: bool                  # some rank was asked to stop (signal) during the step
    loss_parts: dict = field(default_factory=dict)    # the loss's parts, mean over the batches (tensors)
    epoch: int = 0
    first: int = 0              # the step's first batch in its epoch
    samples_per_s: float = 0.0
    last_of_epoch: bool = False
    note: str = ""              # a line for the run's console (OptimStep's: O3's first update)


class Trainer:
    """`failure(exc)`: the error to raise instead of `exc`, or None."""

    def __init__(self, inputs: LoopInputs, hooks: Iterable[Hook] = (),
                 failure: Callable[[Exception], Exception | None] = lambda exc: None):
        self.inputs, self.net, self.optim_step = inputs, inputs.net, inputs.optim_step
        self.model = inputs.model if inputs.model is not None else inputs.net
        self.epochs, self.accumulate = inputs.epochs, inputs.accumulate
        self.batches_per_epoch, self.failure = inputs.batches_per_epoch, failure
        self.hooks = sorted(hooks, key=lambda hook: hook.priority)
        self.epoch, self.start_batch, self.step = 0, 0, 0     # where the run is
        self.resumed, self.steps_this_epoch = None, 0
        self.stop_signal = None           # set (by the pre-emption hook) to stop after the step
        self.finish_requested = False     # set by a hook (early stopping): no further epoch

    def run_step(self, inputs: list) -> StepResult:
        """One optimisation step over `inputs` (several: accumulation), each on the device."""
        loss_parts = {}

        def loss_of(images, target, mask):
            per_sample, losses = self.net(images, target, mask)
            for k, v in losses.items():
                loss_parts[k] = loss_parts.get(k, 0) + v.detach().mean() / len(inputs)
            return per_sample.mean()
        out = self.optim_step.update(inputs, loss_of, lambda: self.stop_signal is not None)
        out.loss_parts = loss_parts
        return out

    def train_one_epoch(self, epoch: int) -> float | None:
        """The epoch's steps, hooks around each; the mean loss of its counted steps over all ranks."""
        self.net.train()
        start, self.start_batch, accumulate = self.start_batch, 0, self.accumulate
        self.steps_this_epoch = max(0, self.batches_per_epoch - start) // accumulate
        self._call("before_epoch", epoch)
        loss_sum, count = torch.zeros((), dtype=torch.float64), 0
        tick = time.perf_counter()          # samples per second since the epoch's first step
        batches = self.inputs.batches(epoch, start)
        for n in range(self.steps_this_epoch):
            first = start + n * accumulate
            self._call("before_step", epoch, first)
            out = self.run_step([next(batches) for _ in range(accumulate)])
            self.step += 1
            if not out.skipped:
                loss_sum += out.loss
                count += 1
            out.epoch, out.first = epoch, first
            out.samples_per_s = self.inputs.samples_per_step * (n + 1) / (time.perf_counter() - tick)
            out.last_of_epoch = n == self.steps_this_epoch - 1
            self._call("after_step", out)
        # mean over ranks too (every rank has the same count: skips are decided together)
        totals = dist.all_reduce_sum(torch.stack([loss_sum, torch.tensor(count, dtype=torch.float64)]))
        return None if totals[1] == 0 else (totals[0] / totals[1]).item()

    def _call(self, event: str, *args) -> None:
        for hook in self.hooks:
            getattr(hook, event)(self, *args)

    def fit(self) -> dict:
        """The epochs from `self.epoch` on; {"epoch", "step", and each hook's `outcome()`}."""
        try:
            self._call("before_train")
            epochs_done = self.epoch
            for epoch in range(self.epoch, self.epochs):
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
            if (failure := self.failure(exc)) is None:
                raise
            raise failure from None
        finally:
            self._call("on_stop")
