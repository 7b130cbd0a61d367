"""Validation pictures: after each AP validation `RUN/val_pictures/epoch_N.png` (and TensorBoard)
shows the first validation images, the true people on the left and those found on the right."""
from __future__ import annotations

import contextlib
from pathlib import Path

import cv2
import numpy as np

from config.views import PredictSettings
from data.h5format import KeypointH5
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
    top, left = (size - h) // 2, (size - w) // 2
    return cv2.copyMakeBorder(cv2.resize(picture, (w, h), interpolation=cv2.INTER_AREA), top, size - h - top,
                              left, size - w - left, cv2.BORDER_CONSTANT, value=GREY)


def write_val_pictures(model, val_h5, skeleton: Skeleton, settings: PredictSettings, epoch: int,
                       run_dir, device, count: int = 4) -> Path:
    """Write RUN/val_pictures/epoch_`epoch`.png of the first `count` images; returns its path."""
    with contextlib.closing(KeypointH5(val_h5)) as h5:
        chosen = range(min(count, h5.num_images))
        pictures = [h5.decode_image(img) for img in chosen]
        truths = [h5.people(img) for img in chosen]
    with eval_mode(model):         # the people the model finds, with the AP's own inference
        estimator = PoseEstimator(TorchNetwork(model, device), settings)
        found = [keypoints for _, keypoints, _ in estimator.grouped(pictures)]
    title = (f"epoch {epoch}: left ground truth ({sum(map(len, truths))} people), "
             f"right found ({sum(map(len, found))})")
    header = np.zeros((HEADER, 2 * TILE, 3), np.uint8)
    cv2.putText(header, title, (6, HEADER - 8), cv2.FONT_HERSHEY_SIMPLEX, 0.45, (255, 255, 255), 1,
                cv2.LINE_AA)
    rows = [np.hstack([fitted(draw_people(picture, truth, skeleton)),       # true people left, found right
                       fitted(draw_people(picture, people, skeleton))])
            for picture, truth, people in zip(pictures, truths, found)]
    return write_image(Path(run_dir) / FOLDER / f"epoch_{epoch}.png", np.vstack([header, *rows]),
                       option="validation picture")
