"""The engine's own hooks, each given its settings when it is made, and `default_hooks`, those of a
run. The base `Hook` and what a hook may read (`LoopState`) are in engine/trainer.py.

In a run, a user's hook (priority 50) runs after the LR (10), divergence (20), progress bar (30)
and logging (40) hooks and before the pre-emption save (80) and the end of the epoch (90:
engine/epoch_end.py), so that what it keeps is saved.
"""
from __future__ import annotations

import contextlib
import signal

import torch
from tqdm import tqdm

from common.errors import TrainingDiverged
from config.schema import Config, OptimConfig
from runtime import distributed as dist
from runtime.distributed import DistContext
from engine.ema import WeightsEMA
from engine.epoch_end import EpochEnd
from engine.freeze import set_frozen_bn_eval
from engine.loaders import STOP_SIGNALS
from engine.optim import lr_at
from engine.train_state import DIVERGENCE_ADVICE, Checkpoints
from engine.trainer import Hook


def memory_gb(device: torch.device) -> float:
    """Peak memory of this process: CUDA allocations on GPU, resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 30
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


class LRSchedule(Hook):
    """The LR of each step from `lr_at`: by where the run is, at the run's total batch."""
    priority = 10

    def __init__(self, optim: OptimConfig, total_batch: int, world_size: int = 1):
        self.optim, self.total_batch, self.world_size = optim, total_batch, world_size

    def before_step(self, trainer, epoch, first):
        trainer.optim_step.set_lr(lr_at(self.optim, epoch, first + trainer.accumulate - 1,
                                        trainer.batches_per_epoch, self.world_size, self.total_batch))


class FrozenBatchNorm(Hook):
    """The BatchNorm layers that `--freeze` froze keep their statistics: eval mode every epoch."""
    priority = 0

    def before_epoch(self, trainer, epoch):
        set_frozen_bn_eval(trainer.model)


class ProgressBar(Hook):
    priority = 30

    def __init__(self, shown: bool = True, device=torch.device("cpu")):
        self.shown, self.device, self.bar = shown, device, None

    def before_epoch(self, trainer, epoch):
        self.bar = tqdm(total=trainer.steps_this_epoch, desc=f"epoch {epoch + 1}/{trainer.epochs}",
                        disable=not self.shown, dynamic_ncols=True, leave=False)

    def after_step(self, trainer, out):
        self.bar.set_postfix(loss=f"{out.loss:.4g}", lr=f"{out.lr:.3g}",
                             img_s=f"{out.samples_per_s:.1f}", mem=f"{memory_gb(self.device):.2f}G")
        self.bar.update()

    def after_epoch(self, trainer, epoch, train_loss):
        self.on_stop(trainer)

    def on_stop(self, trainer):
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class TrainLog(Hook):
    """Every `log_every` steps and at an epoch's last: the loss and its parts, mean over ranks."""
    priority = 40

    def __init__(self, logger, log_every: int, device=torch.device("cpu"), say=print):
        self.logger, self.log_every, self.device, self.say = logger, log_every, device, say

    def after_step(self, trainer, out):
        if out.note:
            self.say(out.note)
        self.logger.log_step(trainer.step, out.loss)
        if trainer.step % self.log_every and not out.last_of_epoch:
            return
        names = list(out.parts)
        means = dist.all_reduce_mean(torch.stack(
            [out.parts[k].float().cpu() for k in names] + [torch.tensor(out.loss)])).tolist()
        self.logger.log("train", trainer.step, epoch=out.epoch, loss=means[-1], lr=out.lr,
                        samples_per_s=out.samples_per_s, skipped_steps=trainer.optim_step.skipped_total,
                        memory_gb=memory_gb(self.device), **dict(zip(names, means)))


class DivergenceStop(Hook):
    """`TrainingDiverged` after `max_bad_steps` skipped steps in a row."""
    priority = 20

    def __init__(self, max_bad_steps: int, checkpoints: Checkpoints):
        self.max_bad_steps, self.checkpoints = max_bad_steps, checkpoints

    def after_step(self, trainer, out):
        streak = trainer.optim_step.bad_streak
        if streak >= self.max_bad_steps:
            raise TrainingDiverged(
                f"{streak} consecutive steps had a non-finite or abnormal loss or gradients (last loss "
                f"{out.loss:.4g}); stopped. {self.checkpoints.good_checkpoint(trainer)}: {DIVERGENCE_ADVICE}")


class Preemption(Hook):
    """SIGTERM / SIGUSR1: save last.pth after the step under way, then end with `Interrupted`."""
    priority = 80

    def __init__(self, checkpoints: Checkpoints):
        self.checkpoints, self.previous, self.handler = checkpoints, {}, None

    def before_train(self, trainer):
        def request_stop(signum, frame):
            trainer.stop_signal = signum
        self.previous, self.handler = {}, request_stop
        for sig in STOP_SIGNALS:
            with contextlib.suppress(ValueError):  # not the main thread (e.g. under a test runner thread)
                self.previous[sig] = signal.signal(sig, request_stop)

    def after_step(self, trainer, out):
        if out.stop:
            batch = out.first + trainer.accumulate
            self.checkpoints.save(trainer, "last.pth", out.epoch, batch)
            raise self.checkpoints.interrupted(trainer, f"at epoch {out.epoch + 1}, batch {batch}")

    def on_stop(self, trainer):
        # let go of the trainer; a handler set since stays
        for sig, handler in self.previous.items():
            if signal.getsignal(sig) is self.handler:
                signal.signal(sig, handler)
        self.previous, self.handler = {}, None


def default_hooks(cfg: Config, checkpoints: Checkpoints, logger, say=print, ctx: DistContext = DistContext(),
                  validate=None, metric: str = "loss") -> list[Hook]:
    """The engine's hooks for a run of `cfg`; `validate` and `metric`: see `EpochEnd`."""
    train = cfg.train
    hooks = [FrozenBatchNorm(), LRSchedule(cfg.optim, train.batch_size * train.accumulate, ctx.world_size),
             DivergenceStop(cfg.optim.max_bad_steps, checkpoints), ProgressBar(ctx.is_main, ctx.device),
             TrainLog(logger, train.log_every, ctx.device, say), Preemption(checkpoints),
             EpochEnd(train, checkpoints, logger, say, validate, metric)]
    if train.ema:
        ema = WeightsEMA(train.ema, train.ema_tau, say).attach(checkpoints.model, checkpoints.precision)
        say(ema.describe())
        hooks.append(ema)
    return hooks
