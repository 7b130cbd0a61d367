"""The training engine: one `Trainer` serves train.py, train_parallel.py and train_distributed.py.

A launch mode only decides how `ModelWithLoss` is wrapped (nothing, DataParallel, DDP) and what
`DistContext` it runs in; everything else (precision, schedule, skipping bad steps, validation,
checkpoints, logging, pre-emption) lives here once. `fit()` runs the epochs; `run_step()` is one
optimisation step; `save()`/`_restore()` are the two halves of resuming.
"""
from __future__ import annotations

import contextlib
import math
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from tqdm import tqdm

from config.errors import CheckpointError, ConfigError, DataError, TrainingDiverged, UserError
from config.loader import to_dict
from config.schema import Config
from config.skeleton import Skeleton, from_checkpoint
from engine import distributed as dist
from engine.amp import cudnn_autotuning_off, set_cuda_backends
from engine.backend import build_precision, convert_sync_bn
from engine.checkpoint import (capture_rng_state, check_resumable, find_latest_checkpoint,
                               load_checkpoint, load_weights, read_file, read_reference,
                               remove_stale_temps, restore_rng_state, save_checkpoint, unwrap_model)
from engine.freeze import freeze, set_frozen_bn_eval, trainable_parameters
from engine.logger import RunLogger
from engine.model_with_loss import ModelWithLoss
from engine.optim import build_optimizer, clip_grads, grad_norm, lr_at, set_lr
from engine.reference_resume import resume_state
from engine.run_setup import (STOP_SIGNALS, choose_run_dir, clear_run_dir, memory_gb, release_run_dir,
                              resolve_data, save_resolved_config, train_loader, val_loader)


class Interrupted(UserError):
    """SIGTERM / SIGUSR1: the run saved a checkpoint and stopped; resume continues it."""

    plain_message = True


@dataclass
class Launch:
    """How a launch mode runs the engine."""
    ctx: dist.DistContext
    wrap: Callable[[nn.Module], nn.Module] = lambda module: module
    mode: str = "single"                 # single | dataparallel | ddp
    wrapped_eval: bool = False           # validate through the wrapper (DataParallel) or not (DDP)


class Trainer:
    def __init__(self, cfg: Config, launch: Launch):
        self.cfg, self.launch, self.ctx = cfg, launch, launch.ctx
        self.run_dir, created = choose_run_dir(cfg, launch.ctx)
        try:
            self._set_up()
        except BaseException:               # a run that did not start leaves no directory behind
            if self.ctx.is_main:
                release_run_dir(self.run_dir, remove_if_empty=created)
            raise

    def _set_up(self) -> None:
        from data.dataset import KeypointDataset
        from models import FocalL2Loss, build_model

        cfg, ctx, launch = self.cfg, self.ctx, self.launch
        resume_path = self._resume_path()
        self.train_h5, self.val_h5 = resolve_data(cfg, ctx)
        # one augmentation stream per (seed, epoch, sample), not per rank: the global batch sampler
        # never gives a sample to two ranks, and N processes then train exactly as one process
        self.train_set = KeypointDataset(self.train_h5, cfg, train=True, rank=0)
        self.loader, self.sampler = train_loader(self.train_set, cfg, ctx)
        self.val_set = KeypointDataset(self.val_h5, cfg, train=False) if self.val_h5 else None
        self.skeleton = self.train_set.skeleton      # the data's: heads, loss, checkpoints follow it
        if self.val_set is not None and self.val_set.skeleton != self.skeleton:
            raise DataError(f"--val-h5 {self.val_h5}: its skeleton ({_skeleton_words(self.val_set.skeleton)})"
                            f" is not that of --train-h5 {self.train_h5} "
                            f"({_skeleton_words(self.skeleton)}); convert both with the same skeleton")

        torch.manual_seed(cfg.train.seed)          # the same initial weights on every rank
        model = build_model(cfg.model, self.skeleton)
        # memory-mapped: tensors are read from the file once, when copied into model and optimiser
        state = load_checkpoint(resume_path, mmap=True) if resume_path else None
        reference = None           # the authors' checkpoint whose run continues (--resume-reference)
        if state is not None:
            check_resumable(state, resume_path)
            self._check_skeleton(from_checkpoint(state), resume_path, "resume")
            load_weights(model, state)
        elif cfg.train.resume_reference:
            if cfg.train.weights:
                raise ConfigError("--resume-reference and --weights: give one (the authors' checkpoint "
                                  "already holds the weights)")
            resume_path = Path(cfg.train.resume_reference)
            reference = read_reference(resume_path)
            report = load_weights(model, reference)
            self.say(f"loaded weights from {resume_path}: {_load_summary(report)}")
        elif cfg.train.weights:
            weights = read_file(cfg.train.weights)
            if isinstance(weights, dict) and "skeleton" in weights and not cfg.train.allow_partial:
                self._check_skeleton(from_checkpoint(weights), cfg.train.weights, "weights")
            report = load_weights(model, weights, allow_partial=cfg.train.allow_partial,
                                  source=str(cfg.train.weights))
            self.say(f"loaded weights from {cfg.train.weights}: {_load_summary(report)}")
        counts = freeze(model, cfg.train.freeze) if cfg.train.freeze else None
        dist.seed_everything(cfg.train.seed, ctx.rank)
        if cfg.dist.sync_bn and ctx.distributed:
            model = convert_sync_bn(model, ctx, cfg)
        model = model.to(ctx.device)
        set_cuda_backends(cfg.amp, cfg.train.cudnn_benchmark)
        self.precision = build_precision(cfg.amp, ctx.device)
        model = self.precision.prepare_model(model)
        trainable = trainable_parameters(model)
        self.opt_params = self.precision.optimizer_params(trainable)
        self.optimizer = build_optimizer(self.opt_params, cfg.optim, zero=cfg.dist.zero and ctx.distributed,
                                         device_type=ctx.device.type)
        # before any wrapper (Apex's amp.initialize refuses a wrapped model); Apex O2: its masters
        model, self.optimizer = self.precision.attach(model, self.optimizer)
        self.opt_params = self.precision.optimizer_params(trainable)
        self.model = model
        self.buffers = list(model.buffers())    # restored when a step is skipped (BN statistics)
        self.buffers_before_step = [b.clone() for b in self.buffers]
        loss = FocalL2Loss(cfg.loss, self.skeleton).to(ctx.device)
        self.model_with_loss = ModelWithLoss(torch.compile(model) if cfg.amp.compile else model,
                                             loss, self.precision)
        self.net = launch.wrap(self.model_with_loss)
        # validation runs the model eagerly: under --compile its no-grad graph and its smaller last
        # batch would each be compiled again, minutes apiece
        eval_model = ModelWithLoss(model, loss, self.precision) if cfg.amp.compile else self.model_with_loss
        self.eval_net = launch.wrap(eval_model) if launch.wrapped_eval else eval_model

        self.epoch, self.start_batch, self.step = 0, 0, 0
        self.best_metric, self.bad_validations, self.skipped_total, self.bad_streak = None, 0, 0, 0
        self.validation_pending = False
        if reference is not None:
            names = [name for name, p in model.named_parameters() if p.requires_grad]
            state = resume_state(reference, str(resume_path), model, self.optimizer, names, cfg)
        if state is not None:
            self._restore(state, resume_path)
        # loader batches per epoch, a whole number of steps of `accumulate` batches each
        accumulate = cfg.train.accumulate
        steps = self.sampler.batches_per_epoch // accumulate
        if cfg.train.max_steps_per_epoch:
            steps = min(steps, cfg.train.max_steps_per_epoch)
        self.batches_per_epoch = steps * accumulate
        if self.step is None:      # a run started elsewhere: the steps of the epochs it finished
            self.step = self.epoch * steps
        self.stop_signal = None
        if ctx.is_main:     # the run directory is written only once everything above has worked
            clear_run_dir(cfg, self.run_dir)
            save_resolved_config(cfg, self.run_dir)
            remove_stale_temps(self.run_dir)   # of saves killed mid-write: checkpoint-sized each
        self.logger = RunLogger(self.run_dir, ctx.is_main, cfg.train.tensorboard,
                                resumed_step=self.step if state is not None else None)
        n_train = sum(p.numel() for p in trainable)
        n_all = sum(p.numel() for p in model.parameters())
        self.say(f"run directory: {self.run_dir}")
        self.say(f"mode {launch.mode}, {ctx.world_size} process(es) on {ctx.device}; "
                 f"batch {cfg.train.batch_size // ctx.world_size} per process, "
                 f"{cfg.train.batch_size} in total"
                 + (f", {accumulate} batches per step ({cfg.train.batch_size * accumulate} samples)"
                    if accumulate > 1 else "") + f"; {self.precision.describe()}")
        self.say(f"data: {len(self.train_set)} training samples from {self.train_h5}"
                 + (f", {len(self.val_set)} validation samples from {self.val_h5}" if self.val_set
                    else "; no --val-h5, so no validation loss, no AP and no best.pth")
                 + f"; {self.skeleton.describe()}")
        self.say(f"parameters: {n_train:,} trainable of {n_all:,}"
                 + (f" ({counts['frozen']:,} frozen by {' '.join(cfg.train.freeze)})" if counts else ""))

    # -- helpers --------------------------------------------------------------------------------
    def say(self, text: str) -> None:
        if self.ctx.is_main:
            tqdm.write(text)

    def _check_skeleton(self, theirs: Skeleton, path, how: str) -> None:
        """CheckpointError when a checkpoint's skeleton is not the data's (see the messages)."""
        if theirs == self.skeleton:
            return
        fix = ("continue it on data of its skeleton, or start a new run from it with --weights "
               "and --allow-partial" if how == "resume" else
               "pass --allow-partial to load everything but the output heads and merges whose "
               "shapes differ (they start fresh)")
        raise CheckpointError(f"{path} was trained on skeleton {_skeleton_words(theirs)} but the data "
                              f"has {_skeleton_words(self.skeleton)}: {fix}")

    def _resume_path(self) -> Path | None:
        resume = self.cfg.train.resume
        if not resume:
            return None
        if resume == "auto":
            # rank 0 chooses: on a shared filesystem each rank could see another newest file
            path = dist.decided_on_main(lambda: find_latest_checkpoint(self.run_dir))
            if path is None:
                self.say(f"--resume auto: no checkpoint in {self.run_dir} yet, starting afresh")
            return path
        if not Path(resume).is_file():
            raise CheckpointError(f"--resume {resume}: no such file")
        return Path(resume)

    def _restore(self, state: dict, path: Path) -> None:
        try:
            self.optimizer.load_state_dict(state["optimizer"])
            self.precision.load_state_dict(state.get("scaler") or {})
            if self.ctx.is_main and state.get("rng"):
                restore_rng_state(state["rng"])
        except (ValueError, KeyError, TypeError, RuntimeError, IndexError, AttributeError) as exc:
            first_line = str(exc).splitlines()[0] if str(exc) else ""
            raise CheckpointError(f"checkpoint {path}: its optimiser, scaler or RNG state does not fit "
                                  f"this run ({type(exc).__name__}: {first_line}); start from its "
                                  "weights with --weights instead of --resume") from None
        self.epoch, self.start_batch, self.step = state["epoch"], state["iteration"], state["step"]
        self.best_metric = state.get("best_metric")
        self.bad_validations = state.get("bad_validations", 0)
        self.skipped_total = state.get("skipped_steps", 0)
        self.validation_pending = bool(state.get("validation_pending", False))
        origin = state.get("origin") or (f"saved by a {state.get('mode', '?')} run of "
                                         f"{state.get('world_size', '?')} process(es)")
        self.say(f"resumed from {path}: epoch {self.epoch + 1}, batch {self.start_batch}"
                 + (f", step {self.step}" if self.step is not None else "") + f" ({origin})")

    def _out_of_memory(self, exc: BaseException) -> UserError:
        size, batch = self.cfg.data.input_size, self.cfg.train.batch_size // self.ctx.world_size
        kept = self.run_dir / "last.pth"
        reason = (str(exc).splitlines() or [type(exc).__name__])[0][:120]
        return UserError(f"out of memory on {self.ctx.device} ({reason})"
                         f" with batch {batch} per process at input {size}: lower --batch-size (add "
                         f"--accumulate K to keep the total batch) or --input-size"
                         + (f"; the last good checkpoint {kept} is intact" if kept.exists() else ""))

    def _install_signal_handlers(self) -> dict:
        """SIGTERM / SIGUSR1 ask for a stop after the step; returns the handlers they replaced."""
        def request_stop(signum, frame):
            self.stop_signal = signum
        previous = {}
        for sig in STOP_SIGNALS:
            try:
                previous[sig] = signal.signal(sig, request_stop)
            except ValueError:     # not the main thread (e.g. under a test runner thread)
                pass
        return previous

    def _stopped(self, where: str) -> Interrupted:
        """The error that ends a run stopped by a signal, once last.pth holds what it resumes from."""
        name = signal.Signals(self.stop_signal).name if self.stop_signal else "a signal on another rank"
        return Interrupted(f"stopped by {name} {where}; saved {self.run_dir / 'last.pth'}. Resume with "
                           f"the same command and --resume auto --run-name {self.run_dir.name}")

    def _stop_voted(self) -> bool:
        """Whether any rank was asked to stop (a collective: every rank calls it together)."""
        return dist.any_rank(self.stop_signal is not None)

    # -- one step -------------------------------------------------------------------------------
    def run_step(self, batches: list, epoch: int, first: int) -> dict:
        """One optimisation step over `batches` (more than one: gradient accumulation), the first of
        which is batch `first` of the epoch; returns the loss, its parts and whether it was skipped."""
        last_batch = first + len(batches) - 1
        lr = lr_at(self.cfg.optim, epoch, last_batch, self.batches_per_epoch, self.ctx.world_size)
        set_lr(self.optimizer, lr)
        if self.buffers:                 # one multi-tensor copy, not a kernel per buffer
            torch._foreach_copy_(self.buffers_before_step, self.buffers)
        losses, parts_sum, abnormal, stop = [], {}, False, False
        for i, batch in enumerate(batches):
            images, target, mask = (t.to(self.ctx.device, non_blocking=True) for t in batch)
            with self._grad_sync(i == len(batches) - 1):
                per_sample, parts = self.net(images, target, mask)
                loss = per_sample.mean()
                losses.append(loss.item())
                for k, v in parts.items():
                    parts_sum[k] = parts_sum.get(k, 0) + v.detach().mean() / len(batches)
                bad = not math.isfinite(losses[-1]) or losses[-1] > self.cfg.optim.skip_loss_above
                # voted before every backward: SyncBN's backward is a collective even under no_sync
                abnormal, stop_now = dist.any_ranks([bad, self.stop_signal is not None])
                stop = stop or stop_now
                if abnormal:
                    break
                self.precision.backward(loss / len(batches))
        grads_finite = False
        if not abnormal:
            self.precision.unscale_(self.optimizer)
            norm = grad_norm(self.opt_params)                 # float32 whatever the gradients' dtype
            grads_finite = bool(torch.isfinite(norm))
            if grads_finite and self.cfg.optim.clip_grad_norm:   # no clipping pass when clipping is off
                clip_grads(self.opt_params, self.cfg.optim.clip_grad_norm, norm)
            self.precision.step(self.optimizer, grads_finite)
        self.precision.zero_grad(self.optimizer)
        skipped = not grads_finite
        if skipped and self.buffers:   # a skipped step leaves no trace, not even in BN statistics
            with torch.no_grad():
                torch._foreach_copy_(self.buffers, self.buffers_before_step)
        self.skipped_total += skipped
        self.bad_streak = self.bad_streak + 1 if skipped else 0
        return {"loss": sum(losses) / len(losses), "lr": lr, "skipped": skipped, "stop": stop,
                "parts": parts_sum}

    def _grad_sync(self, last: bool):
        """DDP all-reduces gradients in the backward of a step's last batch only. With
        dist.static_graph it all-reduces every batch (the same mean): DDP's static graph mode
        fails an internal assert under no_sync."""
        no_sync = getattr(self.net, "no_sync", None)
        if no_sync is None or last or self.cfg.dist.static_graph:
            return contextlib.nullcontext()
        return no_sync()

    # -- epochs ---------------------------------------------------------------------------------
    def train_one_epoch(self, epoch: int) -> float | None:
        self.net.train()
        set_frozen_bn_eval(self.model)
        self.train_set.set_epoch(epoch)
        self.sampler.set_epoch(epoch, self.start_batch)
        start, self.start_batch = self.start_batch, 0
        accumulate = self.cfg.train.accumulate
        steps = max(0, self.batches_per_epoch - start) // accumulate
        bar = tqdm(total=steps, desc=f"epoch {epoch + 1}/{self.cfg.train.epochs}",
                   disable=not self.ctx.is_main, dynamic_ncols=True, leave=False)
        loss_sum, count, tick = torch.zeros((), dtype=torch.float64), 0, time.perf_counter()
        batches = iter(self.loader)
        for n in range(steps):
            first = start + n * accumulate
            out = self.run_step([next(batches) for _ in range(accumulate)], epoch, first)
            self.step += 1
            if not out["skipped"]:
                loss_sum += out["loss"]
                count += 1
            if self.bad_streak >= self.cfg.optim.max_bad_steps:
                raise TrainingDiverged(
                    f"{self.bad_streak} consecutive steps had a non-finite or abnormal loss or "
                    f"gradients (last loss {out['loss']:.4g}); stopped. The last good checkpoint is "
                    f"{self.run_dir / 'last.pth'}: lower optim.lr, enable --clip-grad, or use O0")
            rate = self.cfg.train.batch_size * accumulate * (n + 1) / (time.perf_counter() - tick)
            bar.set_postfix(loss=f"{out['loss']:.4g}", lr=f"{out['lr']:.3g}", img_s=f"{rate:.1f}",
                            mem=f"{memory_gb(self.ctx.device):.2f}G")
            bar.update()
            if self.step % self.cfg.train.log_every == 0 or n == steps - 1:
                names = list(out["parts"])
                means = dist.all_reduce_mean(torch.stack(
                    [out["parts"][k].float().cpu() for k in names] + [torch.tensor(out["loss"])])).tolist()
                self.logger.log("train", self.step, epoch=epoch, loss=means[-1], lr=out["lr"],
                                samples_per_s=rate, skipped_steps=self.skipped_total,
                                memory_gb=memory_gb(self.ctx.device), **dict(zip(names, means)))
            if out["stop"]:
                bar.close()
                self.save("last.pth", epoch, first + accumulate)
                raise self._stopped(f"at epoch {epoch + 1}, batch {first + accumulate}")
        bar.close()
        # mean over ranks too (every rank has the same count: skips are decided together)
        totals = dist.all_reduce_sum(torch.stack([loss_sum, torch.tensor(count, dtype=torch.float64)]))
        if totals[1] == 0:     # resumed at the epoch's end, or every step skipped: no loss to report
            return None
        return (totals[0] / totals[1]).item()

    def _validations_due(self, epoch: int) -> tuple[bool, bool]:
        """(validation loss, AP) due after `epoch` (0-based)."""
        cfg = self.cfg.train
        if self.val_set is None:
            return False, False
        return (bool(cfg.val_every) and (epoch + 1) % cfg.val_every == 0,
                bool(cfg.ap_every) and ((epoch + 1) % cfg.ap_every == 0 or epoch + 1 == cfg.epochs))

    @torch.no_grad()
    def validate(self, epoch: int) -> dict:
        """Validation loss (all ranks, sharded) and, every `ap_every` epochs, COCO AP. A stop signal
        is acted on within a batch or an image (Interrupted; last.pth was saved before)."""
        results = {}
        loss_due, ap_due = self._validations_due(epoch)
        where = f"while validating epoch {epoch + 1} (resuming validates it again)"
        if loss_due:
            self.eval_net.eval()
            total = torch.zeros(2, dtype=torch.float64)
            shards = self.ctx.world_size
            # a stop vote per batch while every rank still has one (shards differ by one at most)
            voted_batches = -(-(len(self.val_set) // shards) // max(1, self.cfg.train.batch_size // shards))
            for n, batch in enumerate(val_loader(self.val_set, self.cfg, self.ctx)):
                images, target, mask = (t.to(self.ctx.device) for t in batch)
                per_sample, _ = self.eval_net(images, target, mask)
                total += torch.tensor([per_sample.double().sum().item(), per_sample.numel()])
                if n < voted_batches and self._stop_voted():
                    raise self._stopped(where)
            total = dist.all_reduce_sum(total)
            results["loss"] = (total[0] / total[1].clamp(min=1)).item()
        if ap_due:
            from inference.evaluation import evaluate_h5
            with cudnn_autotuning_off():
                stats = evaluate_h5(self.model, self.val_h5, self.cfg, self.ctx.device,
                                    max_images=self.cfg.train.ap_max_images, progress=self.ctx.is_main,
                                    stop=lambda: self.stop_signal is not None,
                                    skeleton=self.skeleton)
            if stats is None:
                raise self._stopped(where)
            results.update({k: stats[k] for k in ("AP", "AP50", "AP75", "APm", "APl", "AR")})
        return results

    def _improved(self, results: dict) -> bool | None:
        """Whether the run's metric (AP with --ap-every, else the validation loss) improved; None
        when this validation did not measure it (a loss-only pass between AP passes)."""
        key = "AP" if self.cfg.train.ap_every else "loss"
        if key not in results:
            return None
        value = results[key]
        better = (self.best_metric is None or
                  (value > self.best_metric if key == "AP" else value < self.best_metric))
        if better:
            self.best_metric = value
        return better

    # -- checkpoints ----------------------------------------------------------------------------
    def save(self, name: str, epoch: int, iteration: int, validation_pending: bool = False) -> None:
        """Write RUN/name on the main process (all ranks call: ZeRO consolidates the optimiser)."""
        if self.cfg.dist.zero and self.ctx.distributed:
            self.optimizer.consolidate_state_dict(to=0)
        if self.ctx.is_main:
            state = {
                "model": self.precision.float32_state_dict(unwrap_model(self.model)),
                "optimizer": self.optimizer.state_dict(),
                "scaler": self.precision.state_dict(),
                "epoch": epoch, "iteration": iteration, "step": self.step,
                "best_metric": self.best_metric, "bad_validations": self.bad_validations,
                "skipped_steps": self.skipped_total,
                "config": to_dict(self.cfg), "rng": capture_rng_state(),
                "skeleton": self.skeleton.to_spec(),
                "mode": self.launch.mode, "world_size": self.ctx.world_size,
                "validation_pending": validation_pending,
            }
            save_checkpoint(self.run_dir / name, state)
        dist.barrier()

    # -- the run --------------------------------------------------------------------------------
    def fit(self) -> dict:
        previous_handlers = self._install_signal_handlers()
        try:
            return self._fit()
        except (torch.OutOfMemoryError, MemoryError) as exc:
            raise self._out_of_memory(exc) from None
        except RuntimeError as exc:              # the CPU allocator's failure is a plain RuntimeError
            if "can't allocate memory" not in str(exc):
                raise
            raise self._out_of_memory(exc) from None
        finally:   # the handlers hold this trainer (model, process group): let both go after the run
            for sig, handler in previous_handlers.items():
                signal.signal(sig, handler)
            if self.ctx.is_main:
                release_run_dir(self.run_dir)

    def _fit(self) -> dict:
        cfg = self.cfg.train
        results: dict = {}
        epochs_done, stopped_early = self.epoch, False
        if self.validation_pending and self.epoch > 0:    # stopped while validating: validate again
            results, stopped_early = self._end_epoch(self.epoch - 1, None)
        for epoch in range(self.epoch, cfg.epochs):
            if stopped_early:
                break
            train_loss = self.train_one_epoch(epoch)
            epochs_done = epoch + 1
            # saved before validating: a stop signal during validation loses no training
            self.save("last.pth", epoch + 1, 0, validation_pending=any(self._validations_due(epoch)))
            results, stopped_early = self._end_epoch(epoch, train_loss)
        self.logger.close()
        dist.barrier()   # ranks leave together: none tears down its process group while one still works
        self.say(f"done. checkpoints: {self.run_dir / 'last.pth'}"
                 + (f", {self.run_dir / 'best.pth'}" if (self.run_dir / 'best.pth').exists() else "")
                 + f"; metrics: {self.run_dir / 'metrics.jsonl'}; curves: {self.run_dir / 'curves.png'}")
        return {"run_dir": str(self.run_dir), "epoch": epochs_done, "step": self.step,
                "best_metric": self.best_metric, "early_stopped": stopped_early, **results}

    def _end_epoch(self, epoch: int, train_loss: float | None) -> tuple[dict, bool]:
        """Validation, best.pth, epoch_N.pth, logs after `epoch` (last.pth is already saved);
        returns the validation results and whether early stopping ends the run."""
        cfg = self.cfg.train
        due = any(self._validations_due(epoch))
        results = self.validate(epoch) if due else {}
        improved = self._improved(results)
        if improved is not None:    # a loss-only pass between AP passes is no verdict either way
            self.bad_validations = 0 if improved else self.bad_validations + 1
        trained = {} if train_loss is None else {"train_loss": train_loss}
        self.logger.log("val", self.step, epoch=epoch, **trained, **results)
        if due:      # last.pth again, now with the validation's best metric and patience count
            self.save("last.pth", epoch + 1, 0)
        if improved:
            self.save("best.pth", epoch + 1, 0)
        if cfg.save_every and (epoch + 1) % cfg.save_every == 0:
            self.save(f"epoch_{epoch + 1}.pth", epoch + 1, 0)
        self.logger.plot_curves()
        shown = ", ".join(f"{k} {v:.4g}" for k, v in results.items())
        self.say(f"epoch {epoch + 1}/{cfg.epochs}: "
                 + ("no training step counted" if train_loss is None else f"train loss {train_loss:.4g}")
                 + (f", val {shown}" if shown else "") + (" (best)" if improved else ""))
        if cfg.early_stop_patience and self.bad_validations >= cfg.early_stop_patience:
            self.say(f"early stop after epoch {epoch + 1}: no improvement in {self.bad_validations} "
                     f"validations")
            return results, True
        return results, False


def _load_summary(report: dict) -> str:
    loaded = report.get("loaded", "?")
    missing = report.get("missing") or []
    fresh = [name.split(" (")[0] for name in report.get("mismatched") or []]
    return (f"{loaded} tensors" + (f", {len(missing)} missing (--allow-partial)" if missing else "")
            + (f"; {report['converted']}" if report.get("converted") else "")
            + (f"; {len(fresh)} of another shape start fresh (--allow-partial): {', '.join(fresh)}"
               if fresh else ""))


def _skeleton_words(skeleton: Skeleton) -> str:
    return f"{skeleton.name}, {skeleton.num_keypoints} keypoints, {skeleton.num_channels} channels"
