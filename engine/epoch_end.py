"""The end of an epoch's validation, as a hook: `Validation` measures the validation loss and the
skeleton's metrics (AP, or PCK, AUC, EPE: `data.skeleton.Scoring`; through the evaluator part the
entry script hands in) when they are due, hands the results to
every hook's `after_validation`, logs the epoch's line and saves last.pth again with the hooks'
updated states. best.pth, epoch_N.pth and early stopping are hooks of their own
(engine/checkpoint_hooks.py).

last.pth is saved before this runs (`LastCheckpoint`), marked `validation_pending` when a
validation is due: a stop signal during validation loses no training, and a resumed run validates
that epoch again (`EpochEndHook.before_train`).
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable

import torch

from config.views import PredictSettings
from runtime import distributed as dist
from engine.precision import cudnn_autotuning_off
from engine.hooks import Hook
from engine.device_feed import to_model_input
from engine.run_setup import val_loader

def validations_due(trainer, epoch: int) -> tuple[bool, bool]:
    """(validation loss, AP) due after `epoch` (0-based)."""
    cfg = trainer.cfg.train
    if trainer.data.val_set is None:
        return False, False
    return (bool(cfg.val_every) and (epoch + 1) % cfg.val_every == 0,
            bool(cfg.ap_every) and ((epoch + 1) % cfg.ap_every == 0 or epoch + 1 == cfg.epochs))


def revalidating(trainer) -> bool:
    """Whether the run resumed was stopped while validating: the epoch-end hooks then run again
    for its last epoch (`before_train`)."""
    resumed = getattr(trainer, "resumed", None)
    return resumed is not None and resumed.validation_pending and trainer.epoch > 0


def weights_evaluated(trainer):
    """The hooks' `evaluating()` contexts, entered in order (e.g. EMA weights swapped in)."""
    stack = contextlib.ExitStack()
    for hook in trainer.hooks:
        stack.enter_context(hook.evaluating(trainer))
    return stack


class EpochEndHook(Hook):
    """A hook of the epoch's end that runs again for the last epoch of a run resumed while
    validating (`revalidating`)."""

    def before_train(self, trainer):
        if revalidating(trainer):
            self.after_epoch(trainer, trainer.epoch - 1, None)


class Validation(EpochEndHook):
    """`evaluator(model, val_h5, settings, device, max_images=, progress=, stop=, skeleton=)` ->
    the stats of the skeleton's metrics (or None when stopped) is the AP part; without one, no AP. `settings` is the run's
    `config.views.PredictSettings`. `best` (a `BestCheckpoint`) marks the epoch's line."""
    priority = 90

    def __init__(self, evaluator: Callable | None = None, best=None):
        self.evaluator, self.best, self.results = evaluator, best, {}

    def after_epoch(self, trainer, epoch, train_loss):
        cfg = trainer.cfg.train
        loss_due, ap_due = validations_due(trainer, epoch)
        results = {}
        if loss_due or ap_due:
            with weights_evaluated(trainer):
                results = validate(trainer, self.evaluator, epoch, loss_due, ap_due)
                for hook in trainer.hooks:
                    hook.after_validation(trainer, epoch, results)
        trained = {} if train_loss is None else {"train_loss": train_loss}
        trainer.logger.log("val", trainer.step, epoch=epoch, **trained, **results)
        if loss_due or ap_due:   # last.pth again, now with the hooks' states after validation
            trainer.save("last.pth", epoch + 1, 0)
        trainer.logger.plot_curves()
        improved = self.best is not None and self.best.improved
        shown = ", ".join(f"{k} {v:.4g}" for k, v in results.items())
        trainer.say(f"epoch {epoch + 1}/{cfg.epochs}: "
                    + ("no training step counted" if train_loss is None else f"train loss {train_loss:.4g}")
                    + (f", val {shown}" if shown else "") + (" (best)" if improved else ""))
        self.results = results

    def outcome(self) -> dict:
        return dict(self.results)


@torch.no_grad()
def validate(trainer, evaluator, epoch: int, loss_due: bool, ap_due: bool) -> dict:
    """Validation loss (all ranks, sharded) and the skeleton's metrics (COCO AP, PCK, ...). A stop signal is acted on within a batch
    or an image (Interrupted; last.pth was saved before)."""
    results = {}
    ctx, cfg, val_set = trainer.ctx, trainer.cfg, trainer.data.val_set
    where = f"while validating epoch {epoch + 1} (resuming validates it again)"
    if loss_due:
        trainer.eval_net.eval()
        # summed on the host in Python floats: under Apex's O1, torch's functions and operators are
        # patched (float64 += float32 raises, a float64 sum is cast to float32)
        loss_sum, count = 0.0, 0
        if trainer.data.val_loader is None:       # made once: its workers serve every validation
            trainer.data.val_loader = val_loader(val_set, cfg.data, cfg.train.batch_size, ctx)
        loader = trainer.data.val_loader
        # a stop vote per batch while every rank still has one (shards differ by one at most)
        voted_batches = -(-(len(val_set) // ctx.world_size) // loader.batch_size)
        for n, batch in enumerate(loader):
            images, target, mask = to_model_input(batch, ctx.device, val_set.painter_for(ctx.device),
                                                  non_blocking=False)
            per_sample, _ = trainer.eval_net(images, target, mask)
            loss_sum += math.fsum(per_sample.detach().float().cpu().tolist())
            count += per_sample.numel()
            if n < voted_batches and dist.any_rank(trainer.stop_signal is not None):
                raise trainer.stopped(where)
        total = dist.all_reduce_sum(torch.tensor([loss_sum, count], dtype=torch.float64))
        loss_sum, count = total.tolist()
        results["loss"] = loss_sum / max(count, 1.0)
    if ap_due and evaluator is not None:
        with cudnn_autotuning_off():
            stats = evaluator(trainer.model, trainer.data.val_h5, PredictSettings.of(cfg),
                              ctx.device, max_images=cfg.train.ap_max_images, progress=ctx.is_main,
                              stop=lambda: trainer.stop_signal is not None, skeleton=trainer.skeleton)
        if stats is None:
            raise trainer.stopped(where)
        results.update({k: v for k, v in stats.items() if k != "num_images" and isinstance(v, float)})
    return results
