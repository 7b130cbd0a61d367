"""The assembly of a training run: `build_trainer(cfg, launch, ...)` plans the run (its directory,
what it resumes), builds its parts (`engine.build.TrainerBuilder`, whose methods a subclass
overrides), restores a resumed run's state, writes the run directory and returns a `RunTrainer`:
the loop of engine/trainer.py with the run's configuration, directory, logger and checkpoints, and
the engine's own hooks (`default_hooks`) beside the caller's.

train.py, train_parallel.py and train_distributed.py all call it; a launch mode only decides how
`ModelWithLoss` is wrapped (nothing, DataParallel, DDP) and what `DistContext` it runs in.
"""
from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

from common.errors import TrainingDiverged, UserError
from config.schema import Config, TrainConfig
from runtime import distributed as dist
from runtime.checkpoint import non_finite, remove_stale_temps, save_checkpoint, unwrap_model
from engine.precision.loss_scale import grad_scaler_fields, scaler_problem
from engine.build import Data, Parts, TrainerBuilder
from engine.checkpoint_hooks import BestCheckpoint, EarlyStop, LastCheckpoint, PeriodicCheckpoint
from engine.device_feed import DeviceFeed
from engine.ema import WeightsEMA
from engine.epoch_end import Validation
from engine.freeze import trainable_parameters
from engine.hooks import (DIVERGENCE_ADVICE, DivergenceStop, FrozenBatchNorm, Hook, Interrupted, LRSchedule,
                          Preemption, ProgressBar, TrainLog)
from engine.logger import RunConsole, RunLogger
from engine.precision import check_backend
from engine.reference_resume import resume_state
from engine.resume import CheckpointReader, plan_run
from engine.run_setup import clear_run_dir, close_loaders, release_run_dir, save_resolved_config
from engine.train_state import TrainState, checkpoint_of, hook_states, restore
from engine.trainer import Trainer, TrainParts

__all__ = ["Launch", "RunTrainer", "build_trainer", "build_loop", "default_hooks", "Interrupted", "Hook"]


@dataclass
class Launch:
    """How a launch mode runs the engine."""
    ctx: dist.DistContext
    wrap: Callable[[nn.Module], nn.Module] = lambda module: module
    mode: str = "single"                 # single | dataparallel | ddp
    wrapped_eval: bool = False           # validate through the wrapper (DataParallel) or not (DDP)


def default_hooks(train: TrainConfig, evaluator: Callable | None = None) -> list[Hook]:
    """The engine's own hooks for a run of `train`'s settings (`--ema`, `--early-stop` ...);
    `evaluator` measures AP (see `engine.epoch_end.Validation`)."""
    best = BestCheckpoint(None if train.ap_every else "loss")      # None: the skeleton's metric
    hooks = [LastCheckpoint(), FrozenBatchNorm(), LRSchedule(), DivergenceStop(), ProgressBar(),
             TrainLog(), Preemption(), Validation(evaluator, best), best,
             PeriodicCheckpoint(train.save_every), EarlyStop(best, train.early_stop_patience),
             RunEnd()]
    if train.ema:
        hooks.append(WeightsEMA(train.ema, train.ema_tau))
    return hooks


class RunEnd(Hook):
    """When the epochs are done: the logger closed, the ranks together, the `done.` line; whatever
    happened, the loaders' workers shut down and the run directory's lock given up."""
    priority = 100

    def after_train(self, trainer):
        trainer.logger.close()
        dist.barrier()   # ranks leave together: none tears down its process group while one still works
        run_dir = trainer.run_dir
        trainer.say(f"done. checkpoints: {run_dir / 'last.pth'}"
                    + (f", {run_dir / 'best.pth'}" if (run_dir / 'best.pth').exists() else "")
                    + f"; metrics: {run_dir / 'metrics.jsonl'}; curves: {run_dir / 'curves.png'}"
                    + (f"; pictures: {run_dir / 'val_pictures'}/" if (run_dir / "val_pictures").is_dir()
                       else ""))

    def on_stop(self, trainer):
        close_loaders(trainer.data.loader, trainer.data.val_loader)   # before the group is left
        if trainer.ctx.is_main:
            release_run_dir(trainer.run_dir)


def build_trainer(cfg: Config, launch: Launch, evaluator: Callable | None = None,
                  hooks: list[Hook] = (), builder: TrainerBuilder | None = None,
                  reader: CheckpointReader | None = None) -> "RunTrainer":
    """The run of `cfg` (a resumed run: its own saved config), ready to `fit()`. `reader`: the one
    `engine.cli.config_from_args` read the saved config with (the checkpoints are read once); what
    it holds is given back once the run has started."""
    reader = reader or CheckpointReader()
    plan = plan_run(cfg, reader)
    cfg = plan.config
    say = RunConsole(launch.ctx.is_main)
    say(f"run directory: {plan.run_dir}")
    try:
        check_backend(cfg)           # as the command line does, for a config built in Python
        parts = (builder or TrainerBuilder()).build(cfg, launch, plan, say)
        trainer = RunTrainer(cfg, launch, plan.run_dir, parts,
                             default_hooks(cfg.train, evaluator) + list(hooks), say)
        trainer.start(parts)
        return trainer
    except BaseException:               # a run that did not start leaves no directory behind
        if launch.ctx.is_main:
            release_run_dir(plan.run_dir, remove_if_empty=plan.created)
        raise
    finally:
        reader.forget()


def build_loop(cfg: Config, launch: Launch, builder: TrainerBuilder | None = None
               ) -> tuple[Trainer, Parts]:
    """The loop over `cfg`'s parts with no run around it: no run directory, no checkpoint, no
    hook (benchmarks time its `run_step`); and the parts."""
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
                      train.batch_size * train.accumulate)


def training_feed(data: Data, device) -> Callable[[int, int], Iterator]:
    """`batches(epoch, start)`: the model inputs of `epoch` from its batch `start` on, through
    the device feed (engine.device_feed), the targets drawn on the device."""
    painter = data.train_set.painter_for(device)

    def batches(epoch: int, start: int) -> Iterator:
        data.train_set.set_epoch(epoch)
        data.sampler.set_epoch(epoch, start)
        return iter(DeviceFeed(data.loader, device, painter))
    return batches


class RunTrainer(Trainer):
    """The loop with a run around it: `cfg`, `launch`, `ctx`, `run_dir`, `data`, `model`,
    `precision`, `optimizer`, `eval_net`, `skeleton`, `logger`; `save()` writes a checkpoint."""

    def __init__(self, cfg: Config, launch: Launch, run_dir: Path, parts: Parts, hooks: list[Hook],
                 console: RunConsole | None = None):
        self.cfg, self.launch, self.ctx, self.run_dir = cfg, launch, launch.ctx, run_dir
        self.data, self.model, self.precision = parts.data, parts.model, parts.precision
        self.optimizer, self.eval_net = parts.optimizer, parts.eval_net
        self.skeleton, self.train_set = parts.data.skeleton, parts.data.train_set
        self.say = console or RunConsole(self.ctx.is_main)
        self.logger, self.resumed, self.resumed_from = None, None, None
        super().__init__(loop_parts(cfg.train, parts, self.ctx.device), hooks)
        self.started_at = (0, 0)          # (step, skipped steps) when this process's run began
        self.said_backoff = False         # the line on a run whose every step was a scale back-off

    def start(self, parts: Parts) -> None:
        """The hooks' `after_build`, a resumed run's state, then the run directory written."""
        cfg, ctx = self.cfg, self.ctx
        self._call("after_build")
        state, reference, path, _ = parts.start
        if reference is not None:
            names = [name for name, p in self.model.named_parameters() if p.requires_grad]
            state = resume_state(reference, str(path), self.model, self.optimizer, names, cfg.optim,
                                 cfg.model.depth)
        if state is not None:
            self.resumed = restore(self, state, path)
            self.epoch, self.start_batch = self.resumed.epoch, self.resumed.iteration
            # a run started elsewhere (step None): the steps of the epochs it finished
            steps = self.batches_per_epoch // cfg.train.accumulate
            self.step = self.resumed.step if self.resumed.step is not None else self.epoch * steps
            self.resumed_from = path
        self.started_at = (self.step, self.optim_step.skipped_total)
        if ctx.is_main:     # the run directory is written only once everything above has worked
            clear_run_dir(cfg.train, self.run_dir)
            save_resolved_config(cfg, self.run_dir)
            remove_stale_temps(self.run_dir)   # of saves killed mid-write: checkpoint-sized each
            self.say.open(self.run_dir, ctx.device, ctx.world_size)
        self.logger = RunLogger(self.run_dir, ctx.is_main, cfg.train.tensorboard,
                                resumed_step=self.step if state is not None else None)
        self._describe(parts.frozen)

    def _describe(self, frozen: dict | None) -> None:
        cfg, data = self.cfg, self.data
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
        validation = next((h for h in self.hooks if isinstance(h, Validation)), None)
        if data.val_set is not None and cfg.train.ap_every and getattr(validation, "evaluator", None) is None:
            self.say("no evaluator given to the Trainer: no AP passes (train.py hands it one)")
        self.say(f"parameters: {n_train:,} trainable of {sum(p.numel() for p in self.model.parameters()):,}"
                 + (f" ({frozen['frozen']:,} frozen by {' '.join(cfg.train.freeze)})" if frozen else ""))

    def stopped(self, where: str) -> Interrupted:
        """The error that ends a run stopped by a signal, once last.pth holds what it resumes from."""
        name = signal.Signals(self.stop_signal).name if self.stop_signal else "a signal on another rank"
        return Interrupted(f"stopped by {name} {where}; saved {self.run_dir / 'last.pth'}. Resume with "
                           f"the same command and --resume auto --run-name {self.run_dir.name}")

    def save(self, name: str, epoch: int, iteration: int, validation_pending: bool = False) -> None:
        """Write RUN/name on the main process (all ranks call: ZeRO consolidates the optimiser).
        A state that is no good to resume is never written (`refuse_unusable_state`)."""
        self.refuse_unusable_state(name)
        if self.cfg.dist.zero and self.ctx.distributed:
            self.optimizer.consolidate_state_dict(to=0)
        hooks = hook_states(self)
        if self.ctx.is_main:
            position = TrainState(epoch, iteration, self.step, self.optim_step.skipped_total,
                                  validation_pending)
            state = checkpoint_of(self, position, hooks)
            for hook in self.hooks:
                hook.before_save(self, name, state)
            dist.check_group()          # a rank whose group is lost trains alone: it saves nothing
            save_checkpoint(self.run_dir / name, state)
        dist.barrier()

    def refuse_unusable_state(self, name: str) -> None:
        """`TrainingDiverged` on every rank (each holds the same state) instead of writing RUN/name
        when every step of this run was skipped (nothing trained) for another reason than a dynamic
        loss scale's back-off (a line says so then, and the file is written), when the weights hold a NaN or
        an infinite value, or when the loss scaler's state could not be resumed: the file keeps what
        it held."""
        path = self.run_dir / name
        kept = (f"{path} still holds the weights it held" if path.exists() else f"{path} was not written")
        ran, skipped = self.step - self.started_at[0], self.optim_step.skipped_total - self.started_at[1]
        if ran and skipped == ran and self.optim_step.backoff_skips == ran:
            if not self.said_backoff:
                scale = grad_scaler_fields(self.precision.state_dict()).get("scale")
                self.say(f"all {ran} steps of this run overflowed the dynamic loss scale, which backed off to "
                         f"{scale:g}: no weight changed yet; {name} keeps the lowered scale, so a resume "
                         "trains from there")
                self.said_backoff = True
        elif ran and skipped == ran:
            raise TrainingDiverged(f"all {ran} steps of this run were skipped (a non-finite or abnormal loss "
                                   f"or gradients at each): nothing trained and {kept}. "
                                   f"{self.good_checkpoint()}: {DIVERGENCE_ADVICE}")
        bad = non_finite(self.precision.weight_sources(unwrap_model(self.model)))
        if bad:
            raise TrainingDiverged(f"after step {self.step} the weights hold NaN or infinite values ({len(bad)} "
                                   f"tensors, the first {bad[0]}); {kept}: {DIVERGENCE_ADVICE}")
        problem = scaler_problem(self.precision.state_dict())
        if problem:
            raise TrainingDiverged(f"after step {self.step} the loss scaler's state is unusable ({problem}); "
                                   f"{kept}: {DIVERGENCE_ADVICE}")

    def good_checkpoint(self) -> str:
        """Which checkpoint a run that stops diverged names to go back to: last.pth, unless this run
        resumed a checkpoint and no step has succeeded since (that file is then no good start)."""
        ran, skipped = self.step - self.started_at[0], self.optim_step.skipped_total - self.started_at[1]
        if self.resumed_from is not None and ran == skipped:
            return (f"Every step since the resume from {self.resumed_from} was skipped, so it is no good "
                    "start: go back to an earlier checkpoint of the run, or start from its weights with "
                    "--weights")
        last = self.run_dir / "last.pth"
        return f"The last good checkpoint is {last}" if last.exists() else "No checkpoint was written before"

    def fit(self) -> dict:
        try:
            return {"run_dir": str(self.run_dir), **super().fit()}
        except UserError as exc:       # the line the command ends with, in train.log too
            self.say.record(f"{'' if getattr(exc, 'plain_message', False) else 'error: '}{exc}")
            raise

    def failure(self, exc: Exception) -> Exception | None:
        """What a failure means: under DDP, another rank's error or death when that is the cause
        (found while the stop signals are still the trainer's: torchrun stops the others as soon
        as a rank dies); a DataLoader worker that died (killed: out of memory?); running out of
        memory (the CPU allocator's failure is a plain RuntimeError): what to lower."""
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
