"""A training run, composed around the loop: `build_trainer(cfg, launch, ...)` plans the run, builds
its parts and returns a `RunTrainer`: the `Trainer` with the engine's hooks and the caller's, and
the run around it. Every launch mode calls it; the `Launch` says how the network is wrapped.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from common.errors import UserError
from config.loader import to_dict
from config.schema import Config, TrainConfig
from runtime import distributed as dist
from runtime.checkpoint import remove_stale_temps
from engine import hooks as engine_hooks
from engine.build import Parts, TrainerBuilder
from engine.loaders import PersistentWorkersLoader, training_feed
from engine.freeze import trainable_parameters
from engine.logger import RunConsole, RunLogger
from engine.precision import check_backend
from engine.train_state import CheckpointReader, Checkpoints, resume_state
from engine.run_dir import clear_run_dir, plan_run, release_run_dir, save_resolved_config
from engine.trainer import Hook, Trainer, TrainParts

__all__ = ["Launch", "RunTrainer", "build_trainer", "build_loop"]


@dataclass
class Launch:
    """How a launch mode runs the engine."""
    ctx: dist.DistContext
    wrap: Callable[[nn.Module], nn.Module] = lambda module: module
    mode: str = "single"                 # single | dataparallel | ddp
    wrapped_eval: bool = False           # validate through the wrapper (DataParallel) or not (DDP)


def build_trainer(cfg: Config, launch: Launch, evaluator: Callable | None = None,
                  hooks: list[Hook] = (), builder: TrainerBuilder | None = None,
                  reader: CheckpointReader | None = None, draw: Callable | None = None) -> "RunTrainer":
    """The run of `cfg`, ready to `fit()`; `evaluator` and `draw`: the AP and validation pictures."""
    reader = reader or CheckpointReader()
    plan = plan_run(cfg, reader)
    cfg = plan.config
    say = RunConsole(launch.ctx.is_main)
    say(f"run directory: {plan.run_dir}")
    try:
        check_backend(cfg)           # as the command line does, for a config built in Python
        parts = (builder or TrainerBuilder()).build(cfg, launch, plan, say)
        return RunTrainer(cfg, launch, plan.run_dir, parts, hooks, evaluator, draw, say)
    except BaseException:               # a run that did not start leaves no directory behind
        if launch.ctx.is_main:
            release_run_dir(plan.run_dir, remove_if_empty=plan.created)
        raise
    finally:
        reader.forget()


def build_loop(cfg: Config, launch: Launch, builder: TrainerBuilder | None = None
               ) -> tuple[Trainer, Parts]:
    """The loop over `cfg`'s parts with no run, checkpoint or hook around it; and the parts."""
    parts = (builder or TrainerBuilder()).build(cfg, launch)
    return Trainer(loop_parts(cfg.train, parts, launch.ctx.device)), parts


def loop_parts(train: TrainConfig, parts: Parts, device) -> TrainParts:
    """What the loop runs of `parts`: `train.max_steps_per_epoch` steps at most per epoch."""
    # loader batches per epoch, a whole number of steps of `accumulate` batches each
    steps = parts.data.sampler.batches_per_epoch // train.accumulate
    if train.max_steps_per_epoch:
        steps = min(steps, train.max_steps_per_epoch)
    return TrainParts(parts.net, parts.optim_step, training_feed(parts.data, device),
                      steps * train.accumulate, train.epochs, train.accumulate,
                      train.batch_size * train.accumulate, parts.model)


class RunEnd(Hook):
    """The logger closed, the `done.` line; whatever happened, workers and run lock let go."""
    priority = 100

    def __init__(self, run: "RunTrainer"):
        self.run = run

    def after_train(self, trainer):
        self.run.logger.close()
        dist.barrier()   # ranks leave together: none tears down its process group while one still works
        run_dir = self.run.run_dir
        self.run.say(f"done. checkpoints: {run_dir / 'last.pth'}"
                     + (f", {run_dir / 'best.pth'}" if (run_dir / 'best.pth').exists() else "")
                     + f"; metrics: {run_dir / 'metrics.jsonl'}; curves: {run_dir / 'curves.png'}"
                     + (f"; pictures: {run_dir / 'val_pictures'}/" if (run_dir / "val_pictures").is_dir()
                        else ""))

    def on_stop(self, trainer):
        for loader in (self.run.data.loader, self.run.data.val_loader):   # before the group is left
            if isinstance(loader, PersistentWorkersLoader):
                loader.close()
        if self.run.ctx.is_main:
            release_run_dir(self.run.run_dir)


class RunTrainer:
    """A run around the loop `trainer`: its config, launch, directory, parts and writers."""

    def __init__(self, cfg: Config, launch: Launch, run_dir: Path, parts: Parts, hooks: list[Hook] = (),
                 evaluator: Callable | None = None, draw: Callable | None = None,
                 console: RunConsole | None = None):
        self.cfg, self.launch, self.ctx, self.run_dir = cfg, launch, launch.ctx, run_dir
        self.data, self.model, self.precision = parts.data, parts.model, parts.precision
        self.optimizer, self.optim_step, self.net, self.eval_net = (parts.optimizer, parts.optim_step,
                                                                    parts.net, parts.eval_net)
        self.skeleton, self.train_set = parts.data.skeleton, parts.data.train_set
        self.evaluator, self.draw = evaluator, draw
        self.say = console or RunConsole(self.ctx.is_main)
        self.logger = RunLogger(run_dir, self.ctx.is_main, cfg.train.tensorboard)
        # the tensors --allow-partial left fresh: a resume keeps them trainable under --freeze
        fixed = {"config": to_dict(cfg), "skeleton": self.skeleton.to_spec(), "mode": launch.mode,
                 "world_size": self.ctx.world_size, "fresh_tensors": list(parts.start.fresh)}
        self.checkpoints = Checkpoints(run_dir, self.model, self.optimizer, self.precision, fixed,
                                       self.ctx.is_main, self.say)
        validate = partial(engine_hooks.validate, self) if self.data.val_set is not None else None
        metric = engine_hooks.best_metric(cfg.train, self.skeleton)
        defaults = engine_hooks.default_hooks(cfg, self.checkpoints, self.logger, self.say, self.ctx,
                                              validate, metric)
        self.trainer = Trainer(loop_parts(cfg.train, parts, self.ctx.device),
                               defaults + [RunEnd(self)] + list(hooks), self.failure)
        self._start(parts)

    def _start(self, parts: Parts) -> None:
        """A resumed run's state, then the run directory written and the run described."""
        cfg, ctx, data, frozen = self.cfg, self.ctx, self.data, parts.frozen
        state, reference, path = parts.start.state, parts.start.reference, parts.start.path
        if reference is not None:
            state = resume_state(reference, str(path), self.model, self.optimizer, cfg.optim, cfg.model.depth)
        if state is not None:
            self.checkpoints.restore(self.trainer, state, path, self.say)
        if ctx.is_main:     # the run directory is written only once everything above has worked
            clear_run_dir(cfg.train, self.run_dir)
            save_resolved_config(cfg, self.run_dir)
            remove_stale_temps(self.run_dir)   # of saves killed mid-write: checkpoint-sized each
            self.say.open(self.run_dir, ctx.device, ctx.world_size)
        self.logger.open(resumed_step=self.trainer.step if state is not None else None)
        batch, accumulate = cfg.train.batch_size, cfg.train.accumulate
        n_train = sum(p.numel() for p in trainable_parameters(self.model))
        self.say(f"mode {self.launch.mode}, {self.ctx.world_size} process(es) on {self.ctx.device}; "
                 f"batch {batch // self.ctx.world_size} per process, {batch} in total"
                 + (f", {accumulate} batches per step ({batch * accumulate} samples)"
                    if accumulate > 1 else "") + f"; {self.precision.describe()}")
        self.say(f"data: {len(data.train_set)} training samples from {data.train_h5}"
                 + (f", {len(data.val_set)} validation samples from {data.val_h5}" if data.val_set
                    else "; no --val-h5, so no validation loss, no AP and no best.pth")
                 + f"; {self.skeleton.describe()}")
        if data.val_set is not None and cfg.train.ap_every and self.evaluator is None:
            self.say("no evaluator given to the Trainer: no AP passes (train.py hands it one)")
        self.say(f"parameters: {n_train:,} trainable of {sum(p.numel() for p in self.model.parameters()):,}"
                 + (f" ({frozen['frozen']:,} frozen by {' '.join(cfg.train.freeze)})" if frozen else ""))

    def fit(self) -> dict:
        try:
            return {"run_dir": str(self.run_dir), **self.trainer.fit()}
        except UserError as exc:       # the line the command ends with, in train.log too
            self.say.record(f"{'' if getattr(exc, 'plain_message', False) else 'error: '}{exc}")
            raise

    def failure(self, exc: Exception) -> Exception | None:
        """What a failure means: another rank's end, a worker's death, or memory (and what to lower)."""
        if isinstance(exc, UserError):
            return None
        other = dist.error_of_another_rank() if self.ctx.distributed else None
        if other is not None:
            return other
        line = (str(exc).splitlines() or [""])[0]
        if isinstance(exc, RuntimeError) and line.startswith("DataLoader worker (pid"):
            return UserError(f"{line.strip()} (a loader process of this rank: out of memory? try "
                             "fewer --workers or a smaller --batch-size)")
        if not isinstance(exc, (torch.OutOfMemoryError, MemoryError)) and not (
                isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)):
            return None
        size, batch = self.cfg.data.input_size, self.cfg.train.batch_size // self.ctx.world_size
        kept = self.run_dir / "last.pth"
        reason = (str(exc).splitlines() or [type(exc).__name__])[0][:120]
        return UserError(f"out of memory on {self.ctx.device} ({reason})"
                         f" with batch {batch} per process at input {size}: lower --batch-size (add "
                         f"--accumulate K to keep the total batch) or --input-size"
                         + (", or add --cuda-graphs False (the captured graphs hold their own memory)"
                            if getattr(self.net, "graphed", None) is not None else "")
                         + (f"; the last good checkpoint {kept} is intact" if kept.exists() else ""))
