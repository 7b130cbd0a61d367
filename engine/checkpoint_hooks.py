"""The checkpoints of a run and early stopping, each a hook that keeps its own state:

- `LastCheckpoint`: last.pth after every epoch, before any other hook's end of epoch (marked
  `validation_pending` when a validation follows: a stop during it loses no training);
- `BestCheckpoint`: best.pth whenever the run's metric improves (with `train.ap_every` the
  skeleton's first metric: AP, PCK, AUC or EPE, else the validation loss; a value that is not
  finite never does), saved with the weights that were
  evaluated (e.g. the EMA's); its state is the best value;
- `PeriodicCheckpoint`: epoch_N.pth every `every` epochs;
- `EarlyStop`: ends the run after `patience` validations without improvement; its state is the
  count.

Each of the last three runs again for the last epoch of a run resumed while validating.
"""
from __future__ import annotations

import math

from data.skeleton import LOWER_IS_BETTER
from engine.epoch_end import EpochEndHook, validations_due, weights_evaluated
from engine.hooks import Hook


class LastCheckpoint(Hook):
    priority = 0

    def after_epoch(self, trainer, epoch, train_loss):
        trainer.save("last.pth", epoch + 1, 0, validation_pending=any(validations_due(trainer, epoch)))


class BestCheckpoint(EpochEndHook):
    """`metric`: the name of a validation result ("AP", "loss", ...; EPE and loss: lower is better),
    or None: the first metric of the skeleton's scoring (`data.skeleton.Scoring.key`)."""
    checkpoint_key = "best_metric"
    priority = 91

    def __init__(self, metric: str):
        self.metric, self.best = metric, None
        self.improved: bool | None = None   # this epoch's verdict; None: its metric not measured

    def after_validation(self, trainer, epoch, results):
        metric = self.metric or trainer.skeleton.scoring.key
        if metric not in results:           # a loss-only pass between AP passes: no verdict
            return
        value = results[metric]
        if not math.isfinite(value):        # a NaN loss (float16 overflow) is never the best
            self.improved = False
            return
        self.improved = (self.best is None or not math.isfinite(self.best)
                         or (value < self.best if metric in LOWER_IS_BETTER else value > self.best))
        if self.improved:
            self.best = value

    def after_epoch(self, trainer, epoch, train_loss):
        if self.improved:
            with weights_evaluated(trainer):
                trainer.save("best.pth", epoch + 1, 0)
        self.improved = None

    def state_dict(self):
        return self.best

    def load_state_dict(self, state):
        self.best = state

    def outcome(self) -> dict:
        return {"best_metric": self.best}


class PeriodicCheckpoint(EpochEndHook):
    priority = 92

    def __init__(self, every: int):
        self.every = every

    def after_epoch(self, trainer, epoch, train_loss):
        if self.every and (epoch + 1) % self.every == 0:
            trainer.save(f"epoch_{epoch + 1}.pth", epoch + 1, 0)


class EarlyStop(EpochEndHook):
    """Counts the validations since `best` (a `BestCheckpoint`) last improved; `patience` 0: never
    stops."""
    checkpoint_key = "bad_validations"
    priority = 93

    def __init__(self, best: BestCheckpoint, patience: int):
        self.best, self.patience, self.bad_validations, self.stopped = best, patience, 0, False

    def after_validation(self, trainer, epoch, results):
        if self.best.improved is not None:
            self.bad_validations = 0 if self.best.improved else self.bad_validations + 1

    def after_epoch(self, trainer, epoch, train_loss):
        if self.patience and self.bad_validations >= self.patience:
            trainer.say(f"early stop after epoch {epoch + 1}: no improvement in "
                        f"{self.bad_validations} validations")
            self.stopped = trainer.finish_requested = True

    def state_dict(self):
        return self.bad_validations

    def load_state_dict(self, state):
        self.bad_validations = state

    def outcome(self) -> dict:
        return {"early_stopped": self.stopped}
