"""A training run composed around the loop: `build_trainer(cfg, launch, ...)`, which every launch
mode calls (the `Launch` says how the network is wrapped), returns the `Trainer` with its hooks."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from common.errors import UserError, error_line
from config.schema import Config, TrainConfig
from models.imhn import count_parameters
from runtime import distributed as dist
from runtime.checkpoint import remove_stale_temps
from engine import hooks as engine_hooks
from engine.build import RunComponents, TrainerBuilder
from engine.loaders import PersistentWorkersLoader, training_feed
from engine.logger import RunConsole, RunLogger
from engine.precision import check_backend
from engine.checkpoints import CheckpointReader, Checkpoints, resume_state
from engine.run_dir import clear_run_dir, plan_run, release_run_dir, save_resolved_config
from engine.trainer import Hook, Trainer, LoopInputs

__all__ = ["Launch", "Run", "build_run", "build_trainer", "build_loop"]


@dataclass
class Launch:
    """How a launch mode runs the engine (`TrainerBuilder.build_parallel` wraps the network for it)."""
    ctx: dist.DistContext
    mode: str = "single"                 # single | dataparallel | ddp
    device_ids: list[int] | None = None  # DataParallel's GPUs (none or one: no wrapper)


class Run(NamedTuple):
    """A run ready to `trainer.fit()`: the loop with its hooks, and the components it was built from."""
    trainer: Trainer
    components: RunComponents


def build_trainer(*args, **kwargs) -> Trainer:
    return build_run(*args, **kwargs).trainer


def build_run(cfg: Config, launch: Launch, evaluator: Callable | None = None,
              hooks: list[Hook] = (), builder: TrainerBuilder | None = None,
              reader: CheckpointReader | None = None, draw: Callable | None = None) -> Run:
    """The run of `cfg`, ready to `fit()`, its folder written; `evaluator`, `draw`: AP, pictures."""
    reader = reader or CheckpointReader()
    plan = plan_run(cfg, reader)
    cfg = plan.config
    say = RunConsole(launch.ctx.is_main)
    say(f"run directory: {plan.run_dir}")
    for note in plan.notes:
        say(note)
    try:
        check_backend(cfg)           # as the command line does, for a config built in Python
        builder = builder or TrainerBuilder()
        built = builder.build(cfg, launch, plan, say)
        validator = builder.build_validator(cfg, launch.ctx, built, evaluator, draw, plan.run_dir)
        return Run(_run_trainer(cfg, launch, plan.run_dir, built, validator, hooks, say), built)
    except BaseException:               # a run that did not start leaves no directory behind
        if launch.ctx.is_main:
            release_run_dir(plan.run_dir, remove_if_empty=plan.created)
        raise
    finally:
        reader.forget()


def build_loop(cfg: Config, launch: Launch, builder: TrainerBuilder | None = None
               ) -> tuple[Trainer, RunComponents]:
    """The loop over `cfg`'s components with no run, checkpoint or hook around it; and those."""
    built = (builder or TrainerBuilder()).build(cfg, launch)
    return Trainer(loop_inputs(cfg.train, built, launch.ctx.device)), built


def loop_inputs(train: TrainConfig, built: RunComponents, device) -> LoopInputs:
    """What the loop runs of `built`: `train.max_steps_per_epoch` steps at most per epoch."""
    # loader batches per epoch, a whole number of steps of `accumulate` batches each
    steps = built.data.sampler.batches_per_epoch // train.accumulate
    steps = min(steps, train.max_steps_per_epoch or steps)
    return LoopInputs(built.net, built.optim_step, training_feed(built.data, device),
                      steps * train.accumulate, train.epochs, train.accumulate,
                      train.batch_size * train.accumulate, built.model)


class RunEnd(Hook):
    """The run's end (its folder in the result): logger closed, `done.` said; workers and run lock let go."""
    priority = 100

    def __init__(self, run_dir: Path, logger: RunLogger, say: RunConsole, loaders: Callable, main: bool):
        self.run_dir, self.logger, self.say, self.loaders, self.main = run_dir, logger, say, loaders, main

    def after_train(self, trainer):
        self.logger.close()
        dist.barrier()   # ranks leave together: none tears down its process group while one still works
        run_dir = self.run_dir
        self.say(f"done. checkpoints: {run_dir / 'last.pth'}"
                 + (f", {run_dir / 'best.pth'}" if (run_dir / 'best.pth').exists() else "")
                 + f"; metrics: {run_dir / 'metrics.jsonl'}; curves: {run_dir / 'curves.png'}"
                 + (f"; pictures: {run_dir / 'val_pictures'}/" if (run_dir / "val_pictures").is_dir()
                    else ""))

    def on_stop(self, trainer):
        for loader in self.loaders():   # before the group is left
            if isinstance(loader, PersistentWorkersLoader):
                loader.close()
        if self.main:
            release_run_dir(self.run_dir)

    def outcome(self) -> dict:
        return {"run_dir": str(self.run_dir)}


def _run_trainer(cfg: Config, launch: Launch, run_dir: Path, built: RunComponents, validator, hooks,
                 say) -> Trainer:
    """The loop over `built` with the engine's hooks, the run's end and `hooks`; its state restored
    from what the run starts from; then the run directory written and the run described."""
    ctx, data, start = launch.ctx, built.data, built.start
    logger = RunLogger(run_dir, ctx.is_main, cfg.train.tensorboard)
    fixed = Checkpoints.run_fields(cfg, data.skeleton, launch.mode, ctx.world_size, start.fresh)
    checkpoints = Checkpoints(run_dir, built.model, built.optimizer, built.precision, fixed, ctx.is_main, say)
    metric = engine_hooks.best_metric(cfg.train, data.skeleton)
    defaults = engine_hooks.default_hooks(cfg, checkpoints, logger, say, ctx, validator, metric, built.frozen)
    end = RunEnd(run_dir, logger, say, lambda: (data.loader, getattr(validator, "loader", None)), ctx.is_main)
    failure = partial(_failure, cfg=cfg, ctx=ctx, run_dir=run_dir, net=built.net, say=say)
    trainer = Trainer(loop_inputs(cfg.train, built, ctx.device), defaults + [end] + list(hooks), failure)
    state = start.state
    if start.reference is not None:
        state = resume_state(start.reference, str(start.path), built.model, built.optimizer, cfg.optim,
                             cfg.model.depth)
    if state is not None:
        checkpoints.restore(trainer, state, start.path, say)
    if ctx.is_main:     # the run directory is written only once everything above has worked
        clear_run_dir(cfg.train, run_dir)
        save_resolved_config(cfg, run_dir)
        remove_stale_temps(run_dir)   # of saves killed mid-write: checkpoint-sized each
        say.open(run_dir, ctx.device, ctx.world_size)
    logger.open(resumed_step=trainer.step if state is not None else None)
    _describe(cfg, launch, built, validator, say)
    return trainer


def _describe(cfg: Config, launch: Launch, built: RunComponents, validator, say) -> None:
    """The run's lines: its launch, data and parameters."""
    ctx, data, frozen, model = launch.ctx, built.data, built.frozen, built.model
    batch, accumulate = cfg.train.batch_size, cfg.train.accumulate
    say(f"mode {launch.mode}, {ctx.world_size} process(es) on {ctx.device}; "
        f"batch {batch // ctx.world_size} per process, {batch} in total"
        + (f", {accumulate} batches per step ({batch * accumulate} samples)"
           if accumulate > 1 else "") + f"; {built.precision.describe()}")
    say(f"data: {len(data.train_set)} training samples from {data.train_h5}"
        + (f", {len(data.val_set)} validation samples from {data.val_h5}" if data.val_set
           else "; no --val-h5, so no validation loss, no AP and no best.pth")
        + f"; {data.skeleton.describe()}")
    if validator is not None and cfg.train.ap_every and validator.evaluator is None:
        say("no evaluator given to the Trainer: no AP passes (train.py hands it one)")
    say(f"parameters: {count_parameters(model, True):,} trainable of {count_parameters(model):,}"
        + (f" ({frozen['frozen']:,} frozen by {' '.join(cfg.train.freeze)})" if frozen else ""))


def _failure(exc: Exception, cfg: Config, ctx, run_dir: Path, net, say: RunConsole) -> Exception | None:
    """What a failure means (another rank's end, a worker's death, or memory, and what to lower);
    the line the command ends with, in train.log too."""
    failure, line = None, (str(exc).splitlines() or [""])[0]
    if isinstance(exc, UserError):
        pass
    elif ctx.distributed and (other := dist.error_of_another_rank()) is not None:
        failure = other
    elif isinstance(exc, RuntimeError) and line.startswith("DataLoader worker (pid"):
        failure = UserError(f"{line.strip()} (a loader process of this rank: out of memory? try "
                            "fewer --workers or a smaller --batch-size)")
    elif isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or (
            isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)):
        kept, reason = run_dir / "last.pth", (str(exc).splitlines() or [type(exc).__name__])[0][:120]
        failure = UserError(f"out of memory on {ctx.device} ({reason}) with batch "
                            f"{cfg.train.batch_size // ctx.world_size} per process at input "
                            f"{cfg.data.input_size}: lower --batch-size (add --accumulate K to keep the "
                            "total batch) or --input-size"
                            + (", or add --cuda-graphs False (the captured graphs hold their own memory)"
                               if getattr(net, "graphed", None) is not None else "")
                            + (f"; the last good checkpoint {kept} is intact" if kept.exists() else ""))
    shown = failure if failure is not None else exc
    if isinstance(shown, UserError):
        say.record(error_line(shown))
    return failure
