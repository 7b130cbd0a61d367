"""The training engine: one `Trainer` serves train.py, train_parallel.py and train_distributed.py.

A launch mode only decides how `ModelWithLoss` is wrapped (nothing, DataParallel, DDP) and what
`DistContext` it runs in. The parts are built by engine/build.py, where the run starts from by
engine/resume.py; the step is `run_step` (forward, `OptimStep` update, bookkeeping); everything
around it (LR, logging, progress, divergence and pre-emption stops, validation, AP, checkpoints,
early stopping, and any user feature) is a hook (engine/hooks.py). `fit()` runs the epochs.
"""
from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from tqdm import tqdm

from config.errors import UserError
from config.loader import to_dict
from config.schema import Config, TrainConfig
from runtime import distributed as dist
from engine.build import Parts, build_parts
from engine.ema import WeightsEMA
from engine.device_feed import DeviceFeed, to_model_input
from runtime.checkpoint import capture_rng_state, remove_stale_temps, save_checkpoint, unwrap_model
from engine.epoch_end import EpochEnd, validations_due
from engine.freeze import set_frozen_bn_eval, trainable_parameters
from engine.hooks import (DivergenceStop, Hook, Interrupted, LRSchedule, Preemption, ProgressBar,
                          Throughput, TrainLog)
from engine.logger import RunLogger
from engine.reference_resume import resume_state
from engine.resume import forget_state, plan_run, restore
from engine.run_setup import clear_run_dir, close_loaders, release_run_dir, save_resolved_config

__all__ = ["Launch", "Trainer", "Interrupted", "Hook", "default_hooks"]


@dataclass
class Launch:
    """How a launch mode runs the engine."""
    ctx: dist.DistContext
    wrap: Callable[[nn.Module], nn.Module] = lambda module: module
    mode: str = "single"                 # single | dataparallel | ddp
    wrapped_eval: bool = False           # validate through the wrapper (DataParallel) or not (DDP)


def default_hooks(train: TrainConfig | None = None) -> list[Hook]:
    """The engine's own hooks; with `train`, also those its settings ask for (`--ema`)."""
    hooks = [LRSchedule(), DivergenceStop(), ProgressBar(), TrainLog(), Preemption(), EpochEnd()]
    if train is not None and train.ema:
        hooks.append(WeightsEMA(train.ema, train.ema_tau))
    return hooks


class Trainer:
    """`evaluator(model, val_h5, settings, device, max_images=, progress=, stop=, skeleton=)` -> COCO
    stats (or None when stopped) is the AP part, handed in by the entry script; without one, no AP.
    `settings` is the run's `config.views.PredictSettings`."""

    def __init__(self, cfg: Config, launch: Launch, evaluator: Callable | None = None,
                 hooks: list[Hook] = (), build: Callable[..., Parts] = build_parts):
        self.launch, self.ctx, self.evaluator = launch, launch.ctx, evaluator
        plan = plan_run(cfg)
        self.cfg, self.run_dir = plan.config, plan.run_dir
        # the run's config (a resumed run's own): its settings choose hooks such as --ema
        self.hooks = sorted(default_hooks(self.cfg.train) + list(hooks), key=lambda hook: hook.priority)
        try:
            self._set_up(build(self.cfg, launch, plan, self.say))
        except BaseException:               # a run that did not start leaves no directory behind
            if self.ctx.is_main:
                release_run_dir(self.run_dir, remove_if_empty=plan.created)
            raise
        finally:
            forget_state()

    def _set_up(self, parts: Parts) -> None:
        cfg, ctx = self.cfg, self.ctx
        self.data, self.model, self.precision = parts.data, parts.model, parts.precision
        self.optimizer, self.optim_step = parts.optimizer, parts.optim_step
        self.net, self.eval_net = parts.net, parts.eval_net
        self.skeleton, self.train_set = self.data.skeleton, self.data.train_set
        self.painter = self.train_set.painter_for(ctx.device)     # draws the batches' targets
        self.epoch, self.start_batch, self.step = 0, 0, 0
        self.best_metric, self.bad_validations = None, 0
        self.validation_pending, self.stop_signal, self.early_stopped, self.results = False, None, False, {}
        self._call("after_build")
        state, reference, path = parts.start
        if reference is not None:
            names = [name for name, p in self.model.named_parameters() if p.requires_grad]
            state = resume_state(reference, str(path), self.model, self.optimizer, names, cfg.optim,
                                 cfg.model.depth)
        if state is not None:
            restore(self, state, path)
        # loader batches per epoch, a whole number of steps of `accumulate` batches each
        steps = self.data.sampler.batches_per_epoch // cfg.train.accumulate
        if cfg.train.max_steps_per_epoch:
            steps = min(steps, cfg.train.max_steps_per_epoch)
        self.batches_per_epoch = steps * cfg.train.accumulate
        if self.step is None:      # a run started elsewhere: the steps of the epochs it finished
            self.step = self.epoch * steps
        if ctx.is_main:     # the run directory is written only once everything above has worked
            clear_run_dir(cfg.train, self.run_dir)
            save_resolved_config(cfg, self.run_dir)
            remove_stale_temps(self.run_dir)   # of saves killed mid-write: checkpoint-sized each
        self.logger = RunLogger(self.run_dir, ctx.is_main, cfg.train.tensorboard,
                                resumed_step=self.step if state is not None else None)
        self._describe(parts.frozen)

    def _describe(self, frozen: dict | None) -> None:
        cfg, data = self.cfg, self.data
        batch, accumulate = cfg.train.batch_size, cfg.train.accumulate
        n_train = sum(p.numel() for p in trainable_parameters(self.model))
        self.say(f"run directory: {self.run_dir}")
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

    def say(self, text: str) -> None:
        if self.ctx.is_main:
            tqdm.write(text)

    def stopped(self, where: str) -> Interrupted:
        """The error that ends a run stopped by a signal, once last.pth holds what it resumes from."""
        name = signal.Signals(self.stop_signal).name if self.stop_signal else "a signal on another rank"
        return Interrupted(f"stopped by {name} {where}; saved {self.run_dir / 'last.pth'}. Resume with "
                           f"the same command and --resume auto --run-name {self.run_dir.name}")

    # -- one step -------------------------------------------------------------------------------
    def run_step(self, batches: list, epoch: int, first: int) -> dict:
        """One optimisation step over `batches` (more than one: gradient accumulation), the first of
        which is batch `first` of the epoch; returns the loss, its parts and whether it was skipped."""
        update, parts = self.optim_step, {}
        update.begin(len(batches))
        for i, batch in enumerate(batches):
            images, target, mask = to_model_input(batch, self.ctx.device, self.painter)
            with update.accumulating(last=i == len(batches) - 1):
                per_sample, losses = self.net(images, target, mask)
                for k, v in losses.items():
                    parts[k] = parts.get(k, 0) + v.detach().mean() / len(batches)
                update.backward(per_sample.mean(), stop_requested=self.stop_signal is not None)
        outcome = update.finish()
        return {"loss": outcome.loss, "lr": update.lr, "skipped": outcome.skipped,
                "stop": outcome.stop, "parts": parts}

    # -- epochs ---------------------------------------------------------------------------------
    def train_one_epoch(self, epoch: int) -> float | None:
        """The epoch's steps, hooks around each; the mean loss of its counted steps over all ranks."""
        self.net.train()
        set_frozen_bn_eval(self.model)
        self.train_set.set_epoch(epoch)
        self.data.sampler.set_epoch(epoch, self.start_batch)
        start, self.start_batch, accumulate = self.start_batch, 0, self.cfg.train.accumulate
        self.steps_this_epoch = max(0, self.batches_per_epoch - start) // accumulate
        self._call("before_epoch", epoch)
        loss_sum, count = torch.zeros((), dtype=torch.float64), 0
        rate = Throughput(self.cfg.train.batch_size * accumulate)
        batches = iter(DeviceFeed(self.data.loader, self.ctx.device, self.painter))
        for n in range(self.steps_this_epoch):
            first = start + n * accumulate
            self._call("before_step", epoch, first)
            out = self.run_step([next(batches) for _ in range(accumulate)], epoch, first)
            self.step += 1
            if not out["skipped"]:
                loss_sum += out["loss"]
                count += 1
            out.update(epoch=epoch, first=first, samples_per_s=rate.step(),
                       last_of_epoch=n == self.steps_this_epoch - 1)
            self._call("after_step", out)
        # mean over ranks too (every rank has the same count: skips are decided together)
        totals = dist.all_reduce_sum(torch.stack([loss_sum, torch.tensor(count, dtype=torch.float64)]))
        return None if totals[1] == 0 else (totals[0] / totals[1]).item()

    def _call(self, event: str, *args) -> None:
        for hook in self.hooks:
            getattr(hook, event)(self, *args)

    # -- checkpoints ----------------------------------------------------------------------------
    def save(self, name: str, epoch: int, iteration: int, validation_pending: bool = False) -> None:
        """Write RUN/name on the main process (all ranks call: ZeRO consolidates the optimiser)."""
        if self.cfg.dist.zero and self.ctx.distributed:
            self.optimizer.consolidate_state_dict(to=0)
        extra = {h.checkpoint_key: h.state_dict() for h in self.hooks if h.checkpoint_key}
        if self.ctx.is_main:
            state = {
                "model": self.precision.float32_state_dict(unwrap_model(self.model)),
                "optimizer": self.optimizer.state_dict(),
                "scaler": self.precision.state_dict(),
                "epoch": epoch, "iteration": iteration, "step": self.step,
                "best_metric": self.best_metric, "bad_validations": self.bad_validations,
                "skipped_steps": self.optim_step.skipped_total,
                "config": to_dict(self.cfg), "rng": capture_rng_state(),
                "skeleton": self.skeleton.to_spec(),
                "mode": self.launch.mode, "world_size": self.ctx.world_size,
                "validation_pending": validation_pending, **extra,
            }
            for hook in self.hooks:
                hook.before_save(self, name, state)
            save_checkpoint(self.run_dir / name, state)
        dist.barrier()

    # -- the run --------------------------------------------------------------------------------
    def fit(self) -> dict:
        try:
            self._call("before_train")
            return self._fit()
        except (torch.OutOfMemoryError, MemoryError) as exc:
            raise self._out_of_memory(exc) from None
        except RuntimeError as exc:              # the CPU allocator's failure is a plain RuntimeError
            if "can't allocate memory" not in str(exc):
                raise
            raise self._out_of_memory(exc) from None
        finally:
            self._call("on_stop")
            close_loaders(self.data.loader, self.data.val_loader)   # before the group is left
            if self.ctx.is_main:
                release_run_dir(self.run_dir)

    def _fit(self) -> dict:
        epochs_done = self.epoch
        for epoch in range(self.epoch, self.cfg.train.epochs):
            if self.early_stopped:
                break
            train_loss = self.train_one_epoch(epoch)
            epochs_done = epoch + 1
            # saved before validating: a stop signal during validation loses no training
            self.save("last.pth", epoch + 1, 0, validation_pending=any(validations_due(self, epoch)))
            self._call("after_epoch", epoch, train_loss)
        self.logger.close()
        dist.barrier()   # ranks leave together: none tears down its process group while one still works
        self.say(f"done. checkpoints: {self.run_dir / 'last.pth'}"
                 + (f", {self.run_dir / 'best.pth'}" if (self.run_dir / 'best.pth').exists() else "")
                 + f"; metrics: {self.run_dir / 'metrics.jsonl'}; curves: {self.run_dir / 'curves.png'}"
                 + (f"; pictures: {self.run_dir / 'val_pictures'}/" if (self.run_dir / "val_pictures").is_dir()
                    else ""))
        return {"run_dir": str(self.run_dir), "epoch": epochs_done, "step": self.step,
                "best_metric": self.best_metric, "early_stopped": self.early_stopped, **self.results}

    def _out_of_memory(self, exc: BaseException) -> UserError:
        size, batch = self.cfg.data.input_size, self.cfg.train.batch_size // self.ctx.world_size
        kept = self.run_dir / "last.pth"
        reason = (str(exc).splitlines() or [type(exc).__name__])[0][:120]
        return UserError(f"out of memory on {self.ctx.device} ({reason})"
                         f" with batch {batch} per process at input {size}: lower --batch-size (add "
                         f"--accumulate K to keep the total batch) or --input-size"
                         + (f"; the last good checkpoint {kept} is intact" if kept.exists() else ""))
