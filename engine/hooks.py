"""The engine's own hooks and `default_hooks`, those of a run; by priority a user's hook (50) runs
after LR, divergence, progress and logging and before the pre-emption save (80) and `EpochEnd` (90)."""
from __future__ import annotations

import contextlib
import math
import signal

import torch
from tqdm import tqdm

from common.errors import CheckpointError, TrainingDiverged
from config.schema import Config, OptimConfig, TrainConfig
from data.skeleton import LOWER_IS_BETTER
from runtime import distributed as dist
from runtime.distributed import DistContext
from engine.ema import WeightsEMA
from engine.freeze import set_frozen_bn_eval
from engine.loaders import STOP_SIGNALS
from engine.optim import lr_at
from engine.checkpoints import Checkpoints, bad_value
from engine.trainer import Hook


def weights_evaluated(trainer):
    """The hooks' `evaluating()` contexts, entered in order (e.g. EMA weights swapped in)."""
    stack = contextlib.ExitStack()
    for hook in trainer.hooks:
        stack.enter_context(hook.evaluating(trainer))
    return stack


def scored(value) -> bool:
    """A metric's value measures something: finite and >= 0 (not the -1 of a validation that found nobody)."""
    return isinstance(value, (int, float)) and math.isfinite(value) and value >= 0


class EpochEnd(Hook):
    """The end of an epoch, in short steps: last.pth, then `validate` when due (by `validator`, an
    `engine.validation.Validator`; None: no validation), `judge`, `record`, `report`, `save`."""
    KEPT = {"best_metric": ("best", (int, float, type(None))), "bad_validations": ("bad_validations", int),
            "best_loss": ("best_loss", (int, float, type(None)))}     # checkpoint key: (attribute, types)
    checkpoint_key = tuple(KEPT)
    priority = 90
    EXPLODED = 100.0            # a validation loss this many times the training loss is said

    def __init__(self, train: TrainConfig, checkpoints, logger, say=print, validator=None,
                 metric: str = "loss"):
        self.every = (train.val_every, train.ap_every) if validator is not None else (0, 0)
        self.save_every, self.patience = train.save_every, train.early_stop_patience
        self.checkpoints, self.logger, self.say, self.validator = checkpoints, logger, say, validator
        self.metric, self.best, self.bad_validations, self.best_loss = metric, None, 0, None
        self.stopped, self.results, self.said_exploded = False, {}, False

    def due(self, trainer, epoch: int) -> tuple[bool, bool]:
        """(validation loss, metrics) due after `epoch` (0-based)."""
        val_every, ap_every = self.every
        return (bool(val_every) and (epoch + 1) % val_every == 0,
                bool(ap_every) and ((epoch + 1) % ap_every == 0 or epoch + 1 == trainer.epochs))

    def before_train(self, trainer):
        if trainer.resumed is not None and trainer.resumed.validation_pending and trainer.epoch > 0:
            self.finish(trainer, trainer.epoch - 1, None)
        elif trainer.resumed is not None and self.patience and self.bad_validations >= self.patience:
            self.say(f"the run was ended by early stopping after epoch {trainer.epoch} "
                     f"({self.bad_validations} validations without improvement): nothing to train; a larger "
                     "--early-stop continues it")
            self.stopped = trainer.finish_requested = True

    def after_epoch(self, trainer, epoch, train_loss):
        pending = any(self.due(trainer, epoch))
        self.checkpoints.save(trainer, "last.pth", epoch + 1, 0, validation_pending=pending)
        self.finish(trainer, epoch, train_loss)

    def finish(self, trainer, epoch: int, train_loss: float | None) -> None:
        """The epoch's end from its validation on."""
        due, results, improved = self.due(trainer, epoch), {}, None
        if any(due):
            with weights_evaluated(trainer):
                results = self.validate(trainer, epoch, *due)
                for hook in trainer.hooks:
                    hook.after_validation(trainer, epoch, results)
            # the metrics of a run's last epoch off their schedule (--ap-every) set best.pth only
            # while there is no best: a run continued past it then judges as one never stopped
            off_schedule = self.metric != "loss" and (epoch + 1) % max(self.every[1], 1) > 0
            improved = self.judge(results, epoch, not off_schedule)
        self.record(trainer, epoch, train_loss, results, any(due))
        self.report(trainer, epoch, train_loss, results, improved)
        self.save(trainer, epoch, improved)

    def validate(self, trainer, epoch: int, loss_due: bool, ap_due: bool) -> dict:
        """The validator's loss and metrics, and its pictures once the metrics are measured."""
        results, stop = {}, lambda: trainer.stop_signal is not None
        for due, measure in ((loss_due, lambda: {"loss": self.validator.loss(stop)}),
                             (ap_due, lambda: self.validator.metrics(stop))):
            measured = measure() if due else {}
            if measured is None or None in measured.values():
                raise self.checkpoints.interrupted(
                    trainer, f"while validating epoch {epoch + 1} (resuming validates it again)")
            results.update(measured)
        if ap_due and self.validator.skeleton.scoring.key in results:
            if (path := self.validator.pictures(epoch)) is not None:
                self.logger.log_image("val_pictures", path, trainer.step)     # the TensorBoard tag
        return results

    def record(self, trainer, epoch: int, train_loss: float | None, results: dict, validated: bool) -> None:
        """The epoch in metrics.jsonl; last.pth again after a validation, with the hooks' states."""
        trained = {} if train_loss is None else {"train_loss": train_loss}
        self.logger.log("val", trainer.step, epoch=epoch, **trained, **results)
        if validated:
            self.checkpoints.save(trainer, "last.pth", epoch + 1, 0)
        self.logger.plot_curves()

    def report(self, trainer, epoch: int, train_loss: float | None, results: dict, improved) -> None:
        """The epoch's line, and once a validation loss far above the training loss."""
        shown = ", ".join(f"{k} {v:.4g}" for k, v in results.items())
        self.say(f"epoch {epoch + 1}/{trainer.epochs}: "
                 + ("no training step counted" if train_loss is None else f"train loss {train_loss:.4g}")
                 + (f", val {shown}" if shown else "") + (" (best)" if improved else ""))
        loss = results.get("loss")
        if train_loss and scored(loss) and loss > self.EXPLODED * train_loss and not self.said_exploded:
            self.say(f"the validation loss {loss:.3g} is {loss / train_loss:.3g} x the training loss "
                     f"{train_loss:.3g}: BatchNorm's running statistics likely come from pictures of another "
                     "domain (the --weights' data); they follow this data as training goes on")
            self.said_exploded = True
        self.results = results

    def save(self, trainer, epoch: int, improved) -> None:
        """best.pth when improved, epoch_N.pth when due; early stopping."""
        if improved:
            with weights_evaluated(trainer):
                self.checkpoints.save(trainer, "best.pth", epoch + 1, 0)
        if self.save_every and (epoch + 1) % self.save_every == 0:
            self.checkpoints.save(trainer, f"epoch_{epoch + 1}.pth", epoch + 1, 0)
        if self.patience and self.bad_validations >= self.patience:
            self.say(f"early stop after epoch {epoch + 1}: no improvement in {self.bad_validations} "
                     "validations")
            self.stopped = trainer.finish_requested = True

    def judge(self, results: dict, epoch: int = 0, counts: bool = True) -> bool | None:
        """Whether `results` improve on the best (None: `metric` not measured); an unscored value never
        improves nor blocks; a tie goes to the lower loss; off schedule (not `counts`) only a first best."""
        if self.metric not in results:
            return None
        value, best, loss = results[self.metric], self.best, results.get("loss")
        lower = self.metric in LOWER_IS_BETTER
        improved = scored(value) and (best is None or not scored(best)
                                      or (value < best if lower else value > best))
        if scored(value) and value == best and scored(loss) and self.metric != "loss":
            improved = self.best_loss is None or loss < self.best_loss
            kept = (f"below the best's {self.best_loss:.4g}" if self.best_loss is not None
                    else "the first known")
            self.say(f"epoch {epoch + 1} ties the best {self.metric} {value:.4g}: its validation loss "
                     f"{loss:.4g} " + (f"is {kept}, so it becomes best.pth" if improved else
                        f"is not below the best's {self.best_loss:.4g}, so best.pth stays"))
        if not counts:
            return improved and best is None
        if improved:
            self.best, self.best_loss = value, loss if scored(loss) else None
        self.bad_validations = 0 if improved else self.bad_validations + 1
        return improved

    def state_dict(self):
        return {key: getattr(self, attribute) for key, (attribute, _) in self.KEPT.items()}

    def load_state_dict(self, state):
        for key, (_, kind) in self.KEPT.items():
            if key in state and bad_value(state[key], kind):
                raise CheckpointError(f"its {key} is damaged ({type(state[key]).__name__} "
                                      f"{str(state[key])[:40]!r}); start from its weights with "
                                      "--weights instead of --resume")
        for key, (attribute, _) in self.KEPT.items():
            setattr(self, attribute, state.get(key, getattr(self, attribute)))

    def outcome(self) -> dict:
        return {**self.results, "best_metric": self.best, "early_stopped": self.stopped}


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
                                        trainer.batches_per_epoch, self.world_size, self.total_batch,
                                        trainer.epochs))


class FrozenBatchNorm(Hook):
    """`--freeze`'s BatchNorm layers (`freeze()`'s "all_modules") in eval mode each epoch: stats kept."""
    priority = 0

    def __init__(self, frozen_modules=()):
        self.frozen_modules = list(frozen_modules)

    def before_epoch(self, trainer, epoch):
        set_frozen_bn_eval(trainer.model, self.frozen_modules)


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
        names = list(out.loss_parts)
        means = dist.all_reduce_mean(torch.stack(
            [out.loss_parts[k].float().cpu() for k in names] + [torch.tensor(out.loss)])).tolist()
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
                f"{out.loss:.4g}); stopped. {self.checkpoints.good_checkpoint(trainer)}: "
                f"{self.checkpoints.advice(trainer, streak)}")


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


def best_metric(train: TrainConfig, skeleton) -> str:
    """What best.pth and early stopping follow: the skeleton's first metric if measured, else the loss."""
    return skeleton.scoring.key if train.ap_every else "loss"


def default_hooks(cfg: Config, checkpoints: Checkpoints, logger, say=print, ctx: DistContext = DistContext(),
                  validator=None, metric: str = "loss", frozen: dict | None = None) -> list[Hook]:
    """The engine's hooks for a run of `cfg` (`validator`, `metric`: see `EpochEnd`; `frozen`: freeze()'s)."""
    train = cfg.train
    hooks = [FrozenBatchNorm((frozen or {}).get("all_modules", ())),
             LRSchedule(cfg.optim, train.batch_size * train.accumulate, ctx.world_size),
             DivergenceStop(cfg.optim.max_bad_steps, checkpoints), ProgressBar(ctx.is_main, ctx.device),
             TrainLog(logger, train.log_every, ctx.device, say), Preemption(checkpoints),
             EpochEnd(train, checkpoints, logger, say, validator, metric)]
    if outside := [m for m in cfg.optim.milestones if m >= train.epochs]:     # shares are inside
        say(f"optim.milestones {cfg.optim.milestones}: epochs {outside} are not inside --epochs "
            f"{train.epochs}, so the LR never decays there (shares below 1 follow the run's length)")
    if train.ema:
        ema = WeightsEMA(train.ema, train.ema_tau, say).attach(checkpoints.model, checkpoints.precision)
        say(f"EMA of the weights, decay {ema.decay:g} warmed up over tau {ema.tau:g} steps")
        hooks.append(ema)
    return hooks
