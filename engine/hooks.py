"""Hooks: what runs around the training loop, so that adding a feature never means editing it.

A hook overrides any of the methods of `Hook`. They run in this order: `after_build`,
`before_train`, then per epoch `before_epoch`, per step `before_step` and `after_step` (which
receives the step's `engine.trainer.StepResult`), then `after_validation` and `after_epoch`;
`after_train` when the epochs are done; `on_stop` last, whatever happened. A `Trainer` runs its
hooks by `priority`, lower first, then in the order given: in a run that `build_trainer`
assembles, a user's hook (50) runs after the LR, divergence and logging hooks and before the
pre-emption save (80) and the end of the epoch (90 and up), so that what it keeps is saved.

What a hook may read: the trainer's parts (`model`, `optim_step`, `optimizer`, `data`, `ctx`,
`run_dir`, `logger`, `cfg` in a run `build_trainer` assembles) and its position (`epoch`,
`step`). A hook keeps its own state: with a `checkpoint_key`, `state_dict()` is saved under that
key in every checkpoint and given back through `load_state_dict()` on resume (`state_missing()`
when the checkpoint has none); `outcome()` adds to what `fit()` returns; `evaluating()` wraps
validation, AP and the saving of best.pth (e.g. to swap other weights in).

The engine's own hooks here: the LR schedule, frozen BatchNorm, the progress bar, the training
log, the divergence stop and the pre-emption stop. Validation is engine/epoch_end.py; the
checkpoints and early stopping are engine/checkpoint_hooks.py.
"""
from __future__ import annotations

import contextlib
import signal
import time

import torch
from tqdm import tqdm

from common.errors import TrainingDiverged, UserError
from runtime import distributed as dist
from engine.freeze import set_frozen_bn_eval
from engine.optim import lr_at
from engine.run_setup import STOP_SIGNALS, memory_gb


class Hook:
    checkpoint_key: str | None = None     # set to keep state_dict() in checkpoints
    priority: int = 50                    # lower runs first

    def after_build(self, trainer) -> None:
        """The parts exist, before a resume restores the hooks' states (e.g. to copy weights)."""

    def before_train(self, trainer) -> None: ...
    def before_epoch(self, trainer, epoch: int) -> None: ...
    def before_step(self, trainer, epoch: int, first: int) -> None: ...
    def after_step(self, trainer, out) -> None: ...
    def after_validation(self, trainer, epoch: int, results: dict) -> None: ...
    def after_epoch(self, trainer, epoch: int, train_loss: float | None) -> None: ...
    def after_train(self, trainer) -> None: ...
    def on_stop(self, trainer) -> None:
        """Always, when the run ends: finished, stopped or failed."""

    def before_save(self, trainer, name: str, state: dict) -> None:
        """On the main process, the checkpoint `name` about to be written: a hook may change or add
        entries (its own `state_dict()` is already there under `checkpoint_key`)."""

    def evaluating(self, trainer):
        """A context around validation, AP and saving best.pth."""
        return contextlib.nullcontext()

    def state_dict(self):
        """What a checkpoint keeps of this hook (any value `torch.save` stores)."""
        return {}

    def load_state_dict(self, state) -> None:
        """Continue from `state`, this hook's entry of the checkpoint resumed; a CheckpointError
        saying what does not fit (the engine adds the file's name)."""

    def state_missing(self, trainer, path) -> None:
        """The checkpoint resumed (`path`) holds no entry under `checkpoint_key` (its run had no
        such hook): this hook goes on from its fresh state."""

    def outcome(self) -> dict:
        """What this hook adds to the result of `Trainer.fit()`."""
        return {}


class Interrupted(UserError):
    """SIGTERM / SIGUSR1: the run saved a checkpoint and stopped; resume continues it."""

    plain_message = True


class LRSchedule(Hook):
    """The LR of each step from `lr_at`: by where the run is, at the run's total batch."""
    priority = 10

    def before_step(self, trainer, epoch, first):
        cfg = trainer.cfg
        last_batch = first + cfg.train.accumulate - 1
        trainer.optim_step.set_lr(lr_at(cfg.optim, epoch, last_batch, trainer.batches_per_epoch,
                                        trainer.ctx.world_size,
                                        cfg.train.batch_size * cfg.train.accumulate))


class FrozenBatchNorm(Hook):
    """The BatchNorm layers that `--freeze` froze keep their statistics: eval mode every epoch."""
    priority = 0

    def before_epoch(self, trainer, epoch):
        set_frozen_bn_eval(trainer.model)


class ProgressBar(Hook):
    priority = 30

    def before_epoch(self, trainer, epoch):
        self.bar = tqdm(total=trainer.steps_this_epoch, desc=f"epoch {epoch + 1}/{trainer.cfg.train.epochs}",
                        disable=not trainer.ctx.is_main, dynamic_ncols=True, leave=False)

    def after_step(self, trainer, out):
        self.bar.set_postfix(loss=f"{out.loss:.4g}", lr=f"{out.lr:.3g}",
                             img_s=f"{out.samples_per_s:.1f}", mem=f"{memory_gb(trainer.ctx.device):.2f}G")
        self.bar.update()

    def after_epoch(self, trainer, epoch, train_loss):
        self.on_stop(trainer)

    def on_stop(self, trainer):
        if getattr(self, "bar", None) is not None:
            self.bar.close()
            self.bar = None


class TrainLog(Hook):
    """Every `log_every` steps and at an epoch's last: the loss and its parts, mean over ranks
    (and every step's loss, for curves.png); a step's note on the console."""
    priority = 40

    def after_step(self, trainer, out):
        if out.note:
            trainer.say(out.note)
        trainer.logger.log_step(trainer.step, out.loss)
        if trainer.step % trainer.cfg.train.log_every and not out.last_of_epoch:
            return
        names = list(out.parts)
        means = dist.all_reduce_mean(torch.stack(
            [out.parts[k].float().cpu() for k in names] + [torch.tensor(out.loss)])).tolist()
        trainer.logger.log("train", trainer.step, epoch=out.epoch, loss=means[-1], lr=out.lr,
                           samples_per_s=out.samples_per_s,
                           skipped_steps=trainer.optim_step.skipped_total,
                           memory_gb=memory_gb(trainer.ctx.device), **dict(zip(names, means)))


DIVERGENCE_ADVICE = "lower optim.lr, enable --clip-grad, or use O0"


class DivergenceStop(Hook):
    priority = 20

    def after_step(self, trainer, out):
        streak = trainer.optim_step.bad_streak
        if streak >= trainer.cfg.optim.max_bad_steps:
            raise TrainingDiverged(
                f"{streak} consecutive steps had a non-finite or abnormal loss or "
                f"gradients (last loss {out.loss:.4g}); stopped. {trainer.good_checkpoint()}: "
                f"{DIVERGENCE_ADVICE}")


class Preemption(Hook):
    """SIGTERM / SIGUSR1 ask for a stop after the step under way: it is saved, then the run ends
    with `Interrupted`, which says how to resume."""
    priority = 80

    def before_train(self, trainer):
        def request_stop(signum, frame):
            trainer.stop_signal = signum
        self.previous, self.handler = {}, request_stop
        for sig in STOP_SIGNALS:
            try:
                self.previous[sig] = signal.signal(sig, request_stop)
            except ValueError:     # not the main thread (e.g. under a test runner thread)
                pass

    def after_step(self, trainer, out):
        if out.stop:
            batch = out.first + trainer.cfg.train.accumulate
            trainer.save("last.pth", out.epoch, batch)
            raise trainer.stopped(f"at epoch {out.epoch + 1}, batch {batch}")

    def on_stop(self, trainer):
        # the handlers hold this trainer (model, process group): let both go after the run; a
        # handler set since (a rank that ends with an error holds the stop signals) stays
        for sig, handler in getattr(self, "previous", {}).items():
            if signal.getsignal(sig) is self.handler:
                signal.signal(sig, handler)
        self.previous, self.handler = {}, None


class Throughput:
    """Samples per second since the epoch's first step (a helper of the loop, not a hook)."""

    def __init__(self, samples_per_step: int):
        self.samples_per_step, self.tick, self.steps = samples_per_step, time.perf_counter(), 0

    def step(self) -> float:
        self.steps += 1
        return self.samples_per_step * self.steps / (time.perf_counter() - self.tick)
