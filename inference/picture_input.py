"""What the inference API takes as a picture (docs/evaluation.md), made the BGR uint8 [H, W, 3] array
the network reads, shrunk to `MAX_SIDE`."""
from __future__ import annotations

import os

import cv2
import numpy as np

MAX_SIDE = 2048        # longer side a picture runs at; its maps take C x 2048 x 2048 floats at most
CHANNELS = {1: "grey", 3: "BGR", 4: "BGRA"}


def checked_picture(picture, name: str) -> np.ndarray:
    """`picture` as BGR uint8 [H, W, 3]; TypeError / ValueError naming it."""
    if picture is None:
        raise TypeError(f"{name} is None, not a picture (cv2.imread gives None for a file it cannot read)")
    if isinstance(picture, (str, bytes, os.PathLike)):
        raise TypeError(f"{name} is a path ({picture!r}), not a picture: read it first, e.g. with "
                        "cv2.imread(path)")
    if not isinstance(picture, np.ndarray):
        raise TypeError(f"{name} is a {type(picture).__name__}, not a numpy array: give a BGR uint8 "
                        "array [H, W, 3] as cv2.imread reads it")
    shape = tuple(picture.shape)
    if picture.dtype == np.bool_ or not (picture.dtype in (np.uint8, np.uint16)
                                         or np.issubdtype(picture.dtype, np.floating)):
        raise TypeError(f"{name} has dtype {picture.dtype}: give uint8 (0-255), uint16, or float "
                        "(0-1 or 0-255) values")
    if picture.ndim == 3 and shape[2] not in CHANNELS and shape[0] in CHANNELS:
        raise ValueError(f"{name} has shape {shape}, channels first: give [H, W, C], e.g. "
                         "picture.transpose(1, 2, 0)")
    if picture.ndim not in (2, 3) or (picture.ndim == 3 and shape[2] not in CHANNELS):
        raise ValueError(f"{name} has shape {shape}: give [H, W, 3] (BGR), [H, W, 4] (BGRA), or "
                         "[H, W] / [H, W, 1] (grey)")
    if shape[0] == 0 or shape[1] == 0:
        raise ValueError(f"{name} is empty (shape {shape})")
    picture = np.ascontiguousarray(_as_uint8(picture, name).reshape(*shape[:2], -1))
    conversion = {1: cv2.COLOR_GRAY2BGR, 4: cv2.COLOR_BGRA2BGR}.get(picture.shape[2])
    return picture if conversion is None else cv2.cvtColor(picture, conversion)


def _as_uint8(picture: np.ndarray, name: str) -> np.ndarray:
    if picture.dtype == np.uint8:
        return picture
    if picture.dtype == np.uint16:
        return ((picture.astype(np.uint32) + 128) // 257).astype(np.uint8)
    low, high = float(np.min(picture)), float(np.max(picture))
    if not (np.isfinite(low) and np.isfinite(high)):
        raise ValueError(f"{name} holds NaN or infinite values")
    if low < 0 or high > 255:
        raise ValueError(f"{name} holds values from {low:g} to {high:g}: give float pictures in 0-1 "
                         "or 0-255")
    scale = 255.0 if high <= 1.0 else 1.0
    return np.clip(np.rint(picture.astype(np.float32) * scale), 0, 255).astype(np.uint8)


def shrunk(picture: np.ndarray, max_side: int = MAX_SIDE) -> tuple[np.ndarray, float]:
    """(picture with its longer side at most `max_side`, picture pixels per returned pixel)."""
    height, width = picture.shape[:2]
    if max(height, width) <= max_side:
        return picture, 1.0
    factor = max(height, width) / max_side
    size = (max(1, round(width / factor)), max(1, round(height / factor)))
    small = cv2.resize(picture, size, interpolation=cv2.INTER_AREA)
    return small, width / small.shape[1]
