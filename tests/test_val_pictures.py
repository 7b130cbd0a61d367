"""Validation pictures (inference/val_pictures.py): the grid shows the ground truth on the left and,
on the right, the people the model finds (nothing drawn where it finds none); the validation
writes it only after an AP pass, on the main process, and sends it to TensorBoard."""
from __future__ import annotations

from types import SimpleNamespace

import cv2
import numpy as np
import torch

from config import build_config
from data.skeleton import builtin
from config.views import PredictSettings
from data.h5format import KeypointH5
from engine.logger import RunLogger
from engine.hooks import EpochEnd
from engine.validation import Validator
from inference.val_pictures import HEADER, TILE, fitted, write_val_pictures

COCO = builtin("coco")
# loose grouping, so that a network with random but far from constant maps finds people
LOOSE = ["inference.peak_threshold=0.0003", "inference.max_peaks=6", "inference.limb_threshold=-1",
         "inference.min_mean_score=0", "inference.scales=[1.0]"]
NOBODY = ["inference.peak_threshold=2"]           # maps never reach it: no person is ever found


def settings(sets: list[str]) -> PredictSettings:
    return PredictSettings.of(build_config("tiny", sets=sets))


def tiles(path, count: int) -> list[tuple[np.ndarray, np.ndarray]]:
    picture = cv2.imread(str(path))
    assert picture.shape == (HEADER + count * TILE, 2 * TILE, 3)
    rows = [picture[HEADER + r * TILE: HEADER + (r + 1) * TILE] for r in range(count)]
    return [(row[:, :TILE], row[:, TILE:]) for row in rows]


def test_the_grid_has_the_truth_on_the_left_and_what_the_model_finds_on_the_right(tiny_network, synthetic_h5,
                                                                                   tmp_path):
    val_h5 = synthetic_h5[1]
    h5 = KeypointH5(val_h5)
    plain = [fitted(h5.decode_image(img)) for img in range(2)]
    assert all(len(h5.people(img)) for img in range(2))
    h5.close()
    finds = write_val_pictures(tiny_network, val_h5, COCO, settings(LOOSE), 3, tmp_path / "a",
                               torch.device("cpu"), count=2)
    assert finds == tmp_path / "a/val_pictures/epoch_3.png"
    blind = write_val_pictures(tiny_network, val_h5, COCO, settings(NOBODY), 3, tmp_path / "b",
                               torch.device("cpu"), count=2)
    for (truth, found), (truth_blind, found_blind), image in zip(tiles(finds, 2), tiles(blind, 2), plain):
        assert not np.array_equal(truth, image)             # the true people are drawn
        assert np.array_equal(truth, truth_blind)
        assert np.array_equal(found_blind, image)           # nobody found: the picture as it is
        assert not np.array_equal(found, image)             # people found: drawn over it
    assert not list((tmp_path / "a/val_pictures").glob(".*"))     # written atomically: no temp left


class Recorder:
    def __init__(self):
        self.images = []

    def add_image(self, tag, picture, step, dataformats):
        self.images.append((tag, picture.shape, step, dataformats))

    def close(self):
        pass


def test_validation_draws_after_an_ap_pass_on_the_main_process(tiny_network, synthetic_h5, tmp_path):
    logger = RunLogger(tmp_path, enabled=True, tensorboard=False)
    logger.tb = Recorder()
    cfg = build_config("tiny", sets=NOBODY + ["train.val_pictures=1"])
    ctx = SimpleNamespace(is_main=True, device=torch.device("cpu"))
    data = SimpleNamespace(val_set=None, val_h5=synthetic_h5[1], skeleton=COCO)
    validator = Validator(cfg, ctx, data, None, tiny_network, lambda *args, **kwargs: {"loss": 1.0},
                          write_val_pictures, tmp_path)
    end = EpochEnd(cfg.train, None, logger, validator=validator)
    trainer = SimpleNamespace(step=12, stop_signal=None)
    end.validate(trainer, 0, loss_due=False, ap_due=True)                       # no AP: no picture
    validator.evaluator, ctx.is_main = (lambda *args, **kwargs: {"AP": 0.0, "num_images": 2}), False
    assert end.validate(trainer, 1, loss_due=False, ap_due=True) == {"AP": 0.0}    # not the main process
    assert not (tmp_path / "val_pictures").exists() and not logger.tb.images
    ctx.is_main = True
    end.validate(trainer, 4, loss_due=False, ap_due=True)
    assert (tmp_path / "val_pictures/epoch_5.png").is_file()
    assert logger.tb.images == [("val_pictures", (HEADER + TILE, 2 * TILE, 3), 12, "HWC")]
