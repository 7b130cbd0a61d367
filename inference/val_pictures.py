"""Validation pictures: what the model finds on a few fixed validation images, beside the truth.

`write_val_pictures`, which the entry scripts hand the training engine (`engine.epoch_end.validate`
calls it), draws after each AP validation `RUN/val_pictures/epoch_N.png`: the first
`train.val_pictures` images of the validation file, one per row, the ground-truth people on the
left, on the right those the model finds with the AP's own inference (`inference.estimator`; the
averaged weights under `--ema`), each in a TILE x TILE square below a header; also to TensorBoard.
"""
from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np

from config.views import PredictSettings
from data.skeleton import Skeleton
from data.preprocess import GREY
from data.picture_files import write_image
from inference.draw import draw_people
from inference.estimator import PoseEstimator
from inference.evaluation import eval_mode
from inference.predict import TorchNetwork

TILE = 256          # pixels of the square each image is fitted into
HEADER = 24         # pixels of the header line above the rows
FOLDER = "val_pictures"


def fitted(picture: np.ndarray, size: int = TILE) -> np.ndarray:
    """The picture scaled to fit a size x size square (aspect kept), centred on grey."""
    height, width = picture.shape[:2]
    scale = size / max(height, width)
    h, w = max(1, round(height * scale)), max(1, round(width * scale))
    tile = np.full((size, size, 3), GREY, np.uint8)
    top, left = (size - h) // 2, (size - w) // 2
    tile[top:top + h, left:left + w] = cv2.resize(picture, (w, h), interpolation=cv2.INTER_AREA)
    return tile


def pictures_grid(pictures: list[np.ndarray], truths: list[np.ndarray], found: list[np.ndarray],
                  skeleton: Skeleton, title: str) -> np.ndarray:
    """BGR uint8: `title`, then one row per picture: its true people [P, K, 3] drawn on the left,
    the people found on the right."""
    rows = [np.hstack([fitted(draw_people(picture, truth, skeleton)),
                       fitted(draw_people(picture, people, skeleton))])
            for picture, truth, people in zip(pictures, truths, found)]
    header = np.zeros((HEADER, 2 * TILE, 3), np.uint8)
    cv2.putText(header, title, (6, HEADER - 8), cv2.FONT_HERSHEY_SIMPLEX, 0.45, (255, 255, 255), 1,
                cv2.LINE_AA)
    return np.vstack([header, *rows])


def found_people(model, pictures: list[np.ndarray], settings: PredictSettings, device) -> list[np.ndarray]:
    """The keypoints [P, K, 3] of the people `model` (a model of this project) finds in each picture,
    as the AP's inference finds them (at `settings`)."""
    with eval_mode(model):
        people = PoseEstimator(TorchNetwork(model, device), settings)(pictures)
    k = model.skeleton.num_keypoints
    return [np.stack([p.keypoints for p in found]) if found else np.zeros((0, k, 3), np.float32)
            for found in people]


def val_pictures_path(run_dir, epoch: int) -> Path:
    return Path(run_dir) / FOLDER / f"epoch_{epoch}.png"


def write_val_pictures(model, val_h5, skeleton: Skeleton, settings: PredictSettings, epoch: int,
                       run_dir, device, count: int = 4) -> Path:
    """Draw the first `count` images of `val_h5` with their true people and those `model` finds into
    RUN/val_pictures/epoch_`epoch`.png (1-based epoch), written atomically; returns its path."""
    from data.h5format import KeypointH5

    h5 = KeypointH5(val_h5)
    try:
        chosen = range(min(count, h5.num_images))
        pictures = [h5.decode_image(img) for img in chosen]
        truths = [h5.people(img) for img in chosen]
    finally:
        h5.close()
    found = found_people(model, pictures, settings, device)
    title = (f"epoch {epoch}: left ground truth ({sum(map(len, truths))} people), "
             f"right found ({sum(map(len, found))})")
    grid = pictures_grid(pictures, truths, found, skeleton, title)
    return write_image(val_pictures_path(run_dir, epoch), grid, option="validation picture")
