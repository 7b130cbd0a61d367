"""Augmentation of SPEC: one affine per sample (scale, rotation, shift, flip) and a colour tint; the
affine (`affine_matrix`) moves the image, the masks (straight to the output grid) and the joints."""
from __future__ import annotations

import math
from dataclasses import dataclass

import cv2
import numpy as np

from config.schema import AugmentConfig
from data.preprocess import GREY


@dataclass
class AugmentParams:
    """One draw of the random augmentation (the identity by default)."""
    scale: float = 1.0            # multiplies the main-person scale
    angle: float = 0.0            # degrees, counter-clockwise on screen
    shift_x: float = 0.0          # network-input pixels
    shift_y: float = 0.0
    flip: bool = False
    hue: float = 0.0              # added to OpenCV hue (0-180)
    saturation: float = 1.0       # multiplies saturation
    value: float = 1.0            # multiplies value
    color: bool = False           # whether to apply hue/saturation/value


def draw_params(rng: np.random.Generator, cfg: AugmentConfig, input_size: int) -> AugmentParams:
    """A random draw following `cfg` (probabilities and ranges of SPEC); shift scales with size."""
    params = AugmentParams()
    if rng.random() < cfg.scale_prob:
        params.scale = float(rng.uniform(cfg.scale_min, cfg.scale_max))
    params.angle = float(rng.uniform(-cfg.rotate_deg, cfg.rotate_deg))
    shift = cfg.shift_px * input_size / 512.0
    params.shift_x, params.shift_y = (float(v) for v in rng.uniform(-shift, shift, 2))
    params.flip = bool(rng.random() < cfg.flip_prob)
    if rng.random() < cfg.color_prob:
        params.color = True
        params.hue = float(rng.uniform(-cfg.hue_shift, cfg.hue_shift))
        params.saturation = float(rng.uniform(1 - cfg.sat_scale, 1 + cfg.sat_scale))
        params.value = float(rng.uniform(1 - cfg.val_scale, 1 + cfg.val_scale))
    return params


def affine_matrix(center, box_height: float, input_size: int, person_height: float,
                  params: AugmentParams) -> np.ndarray:
    """float64 [2,3]: image pixels -> input pixels for a main person at `center` of that height."""
    zoom = person_height * input_size / max(float(box_height), 1.0) * params.scale
    rad = math.radians(params.angle)
    cos, sin = math.cos(rad) * zoom, math.sin(rad) * zoom
    linear = np.array([[cos, sin], [-sin, cos]])
    if params.flip:
        linear[0] *= -1
    mid = (input_size - 1) / 2.0
    offset = np.array([mid + params.shift_x, mid + params.shift_y]) - linear @ np.asarray(center, float)
    return np.hstack([linear, offset[:, None]])


def to_grid(matrix: np.ndarray, stride: int) -> np.ndarray:
    """Image pixels -> stride-`stride` output cells (cell j samples input x = (j+.5)*stride-.5)."""
    s = 1.0 / stride
    down = np.array([[s, 0, 0.5 * s - 0.5], [0, s, 0.5 * s - 0.5], [0, 0, 1]])
    return (down @ np.vstack([matrix, [0, 0, 1]]))[:2]


def from_reduced(matrix: np.ndarray, reduce: int) -> np.ndarray:
    """The affine for an image decoded at 1/`reduce` size, whose pixels are cells of stride `reduce`."""
    return matrix @ np.vstack([to_grid(np.eye(2, 3), 1 / reduce), [0, 0, 1]])


def transform_people(people: np.ndarray, matrix: np.ndarray, flip=None) -> np.ndarray:
    """People [P,K,3] moved by `matrix`; with `flip` (the skeleton's), left and right swap."""
    out = people.copy()
    out[..., :2] = people[..., :2] @ matrix[:, :2].T + matrix[:, 2]
    if flip:
        out = out[:, list(flip)]
    return out


def warp_image(image: np.ndarray, matrix: np.ndarray, size: int) -> np.ndarray:
    """uint8 size x size x 3 image through `matrix`, `GREY` outside (warped as 4 channels: faster)."""
    padded = cv2.cvtColor(image, cv2.COLOR_BGR2BGRA)
    warped = cv2.warpAffine(padded, matrix, (size, size), flags=cv2.INTER_LINEAR,
                            borderMode=cv2.BORDER_CONSTANT, borderValue=GREY + (0,))
    return cv2.cvtColor(warped, cv2.COLOR_BGRA2BGR)


def warp_masks(planes: np.ndarray | None, grid_matrix: np.ndarray,
               size: int) -> tuple[np.ndarray, np.ndarray]:
    """(ignore, person): uint8 size x size masks (0-255, 0 outside the image) of `planes`
    (`decode_mask_planes`; None: zeros) through `grid_matrix`, in one 4-channel warp."""
    if planes is None:
        zeros = np.zeros((size, size), np.uint8)
        return zeros, zeros.copy()
    out = cv2.warpAffine(planes, grid_matrix, (size, size), flags=cv2.INTER_LINEAR,
                         borderMode=cv2.BORDER_CONSTANT, borderValue=0)
    return np.ascontiguousarray(out[:, :, 0]), np.ascontiguousarray(out[:, :, 1])


def mask_fraction(mask: np.ndarray) -> np.ndarray:
    """float32 [0, 1] of a uint8 0-255 mask of `warp_masks`."""
    return mask.astype(np.float32) * np.float32(1 / 255)


def tint(image: np.ndarray, params: AugmentParams) -> np.ndarray:
    """HSV jitter of a uint8 BGR image (hue shift, saturation and value scaling)."""
    hsv = cv2.cvtColor(image, cv2.COLOR_BGR2HSV)
    levels = np.arange(256, dtype=np.float32)
    table = np.empty((256, 1, 3), np.uint8)
    table[:, 0, 0] = np.mod(levels + params.hue, 180).astype(np.uint8)
    table[:, 0, 1] = np.clip(levels * params.saturation, 0, 255).astype(np.uint8)
    table[:, 0, 2] = np.clip(levels * params.value, 0, 255).astype(np.uint8)
    return cv2.cvtColor(cv2.LUT(hsv, table), cv2.COLOR_HSV2BGR)
