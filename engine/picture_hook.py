"""The validation pictures' hook: after each validation that measured the skeleton's metrics (AP,
PCK, ...: `data.skeleton.Scoring`), the main process draws
what the model finds on a few validation images (`train.val_pictures`, 0: none) and sends the
picture to TensorBoard.

The drawing is a part the entry script hands in, as it hands in the AP evaluator (the engine
imports no inference): `draw(model, val_h5, skeleton, settings, epoch, run_dir, device, count)`,
`settings` the run's `config.views.PredictSettings`, writes RUN/val_pictures/epoch_N.png (N from
1) and returns its path (`inference.val_pictures.write_val_pictures`). It runs inside the other
hooks' `evaluating()` contexts, so with `--ema` it draws the averaged weights, as the AP measured
them.
"""
from __future__ import annotations

from typing import Callable

from config.views import PredictSettings
from engine.precision import cudnn_autotuning_off
from engine.hooks import Hook

TENSORBOARD_TAG = "val_pictures"


class ValidationPictures(Hook):
    def __init__(self, draw: Callable):
        self.draw = draw

    def after_validation(self, trainer, epoch: int, results: dict) -> None:
        count = trainer.cfg.train.val_pictures
        if trainer.skeleton.scoring.key not in results or not count or not trainer.ctx.is_main:
            return
        with cudnn_autotuning_off():       # pictures of several sizes: none worth timing algorithms for
            path = self.draw(trainer.model, trainer.data.val_h5, trainer.skeleton,
                             PredictSettings.of(trainer.cfg), epoch + 1, trainer.run_dir,
                             trainer.ctx.device, count)
        trainer.logger.log_image(TENSORBOARD_TAG, path, trainer.step)
