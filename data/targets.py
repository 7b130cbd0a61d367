"""Ground-truth maps: limb maps, keypoint heatmaps, the person mask and the keypoint max.

`render_targets` draws the channels of a `config.skeleton.Skeleton` (COCO: 30 limbs, 18
keypoints, 50 channels) on an output grid whose cell (i, j)
samples the input point x = (j + 0.5) * stride - 0.5, y = (i + 0.5) * stride - 0.5 (the grid that
cv2.resize upsampling inverts). Keypoints are Gaussians (several people: max); limbs are Gaussians
of the perpendicular distance to the segment inside its box widened by a margin (several people:
mean of the contributing ones). Each Gaussian is computed only in a window around its joint or
limb (batched into a few numpy arrays), and set to 0 below exp(-GAUSSIAN_CUTOFF), so the cost
grows with the people, not the grid.

`HostTargetPainter` draws a batch of compact samples (`data.transfer`) this way, sample by sample:
what a CPU device uses instead of the whole-grid drawing of `data.device_targets`, which suits a
GPU but costs some 40x more on a CPU.
"""
from __future__ import annotations

import math

import cv2
import numpy as np
import torch

from config.schema import TargetConfig
from config.skeleton import Skeleton
from data.augment import mask_fraction

GAUSSIAN_CUTOFF = 4.6052          # exp(-4.6052) = 0.01: values below are set to 0
_MIN_VALUE = math.exp(-GAUSSIAN_CUTOFF)
_ERODE_KERNEL = np.ones((3, 3), np.uint8)
_BATCH_ELEMENTS = 1 << 18         # limb windows are padded into one batch up to this size


def _cell_range(lo: np.ndarray, hi: np.ndarray, stride: int, count: int):
    """Half-open cell ranges [first, last) whose sample points lie in [lo, hi], clipped to the grid."""
    first = np.maximum(np.ceil((lo + 0.5) / stride - 0.5), 0).astype(np.int64)
    last = np.minimum(np.floor((hi + 0.5) / stride - 0.5), count - 1).astype(np.int64) + 1
    return first, last


def _draw_keypoints(maps: np.ndarray, people: np.ndarray, stride: int, sigma: float) -> None:
    """Max-combine one Gaussian per labelled keypoint into maps [K,H,W] (square windows)."""
    height, width = maps.shape[1:]
    person, kind = np.nonzero(people[:, :, 2] > 0)
    if person.size == 0:
        return
    x, y = people[person, kind, 0].astype(np.float64), people[person, kind, 1].astype(np.float64)
    radius = math.sqrt(2 * GAUSSIAN_CUTOFF) * sigma
    span = int(math.ceil(2 * radius / stride)) + 2           # cells per window side, unclipped
    j_start = np.ceil((x - radius + 0.5) / stride - 0.5).astype(np.int64)
    i_start = np.ceil((y - radius + 0.5) / stride - 0.5).astype(np.int64)
    steps = np.arange(span)
    gx = np.exp(-0.5 / sigma ** 2 * (((j_start[:, None] + steps) + 0.5) * stride - 0.5 - x[:, None]) ** 2)
    gy = np.exp(-0.5 / sigma ** 2 * (((i_start[:, None] + steps) + 0.5) * stride - 0.5 - y[:, None]) ** 2)
    stamps = (gy[:, :, None] * gx[:, None, :]).astype(np.float32)
    stamps[stamps < _MIN_VALUE] = 0
    j0, i0 = np.maximum(j_start, 0), np.maximum(i_start, 0)
    j1, i1 = np.minimum(j_start + span, width), np.minimum(i_start + span, height)
    rows = zip(kind.tolist(), i0.tolist(), i1.tolist(), j0.tolist(), j1.tolist(),
               (i0 - i_start).tolist(), (j0 - j_start).tolist())
    for n, (k, a0, a1, b0, b1, da, db) in enumerate(rows):
        if a1 > a0 and b1 > b0:
            window = maps[k, a0:a1, b0:b1]
            np.maximum(window, stamps[n, da:da + a1 - a0, db:db + b1 - b0], out=window)


def _limb_windows(people: np.ndarray, limbs, stride: int, margin: float, height: int, width: int):
    """Per labelled (person, limb): limb index, endpoints and the clipped cell window of its box."""
    ends_a, ends_b = people[:, [a for a, _ in limbs]], people[:, [b for _, b in limbs]]
    person, limb = np.nonzero((ends_a[:, :, 2] > 0) & (ends_b[:, :, 2] > 0))
    a = ends_a[person, limb, :2].astype(np.float64)
    b = ends_b[person, limb, :2].astype(np.float64)
    j0, j1 = _cell_range(np.minimum(a[:, 0], b[:, 0]) - margin, np.maximum(a[:, 0], b[:, 0]) + margin,
                         stride, width)
    i0, i1 = _cell_range(np.minimum(a[:, 1], b[:, 1]) - margin, np.maximum(a[:, 1], b[:, 1]) + margin,
                         stride, height)
    keep = (j1 > j0) & (i1 > i0)
    return limb[keep], a[keep], b[keep], i0[keep], i1[keep], j0[keep], j1[keep]


def _draw_limbs(maps: np.ndarray, people: np.ndarray, limbs, stride: int, sigma: float,
                margin: float) -> None:
    """Mean-combine one perpendicular-distance Gaussian per labelled limb into maps [L,H,W].

    Windows are padded into one batch (or, when that gets large, one batch per size class:
    next power of two per side), so numpy works on a few arrays, not one per limb.
    """
    height, width = maps.shape[1:]
    limb, a, b, i0, i1, j0, j1 = _limb_windows(people, limbs, stride, margin, height, width)
    if limb.size == 0:
        return
    delta = b - a
    length = np.hypot(delta[:, 0], delta[:, 1])
    point = length < 1e-6                                  # degenerate limb: distance to a point
    unit = np.where(point[:, None], [1.0, 0.0], delta / np.maximum(length, 1e-6)[:, None])
    root = math.sqrt(0.5) / sigma                          # g = exp(-(root * distance)^2)
    h, w = i1 - i0, j1 - j0
    if limb.size * int(h.max()) * int(w.max()) <= _BATCH_ELEMENTS:
        size_class = np.zeros(limb.size, np.int64)         # one batch
    else:
        size_class = (np.ceil(np.log2(h)).astype(np.int64) << 8) | np.ceil(np.log2(w)).astype(np.int64)
    stamps: list = [None] * limb.size
    for cls in np.unique(size_class):
        idx = np.nonzero(size_class == cls)[0]
        hb, wb = int(h[idx].max()), int(w[idx].max())
        dx = ((j0[idx, None] + np.arange(wb)) + 0.5) * stride - 0.5 - a[idx, 0:1]
        dy = ((i0[idx, None] + np.arange(hb)) + 0.5) * stride - 0.5 - a[idx, 1:2]
        ux, uy = unit[idx, 0, None, None] * root, unit[idx, 1, None, None] * root
        across = dx[:, None, :] * uy - dy[:, :, None] * ux
        dist2 = across * across
        if point[idx].any():
            along = (dx[:, None, :] * ux + dy[:, :, None] * uy) * point[idx, None, None]
            dist2 += along * along
        g = np.exp(-dist2).astype(np.float32)
        g[dist2 > GAUSSIAN_CUTOFF] = 0
        for n, k in enumerate(idx.tolist()):
            stamps[k] = g[n, :h[k], :w[k]]
    boxes = np.stack([i0, i1, j0, j1], 1).tolist()
    by_limb: dict = {}
    for k, l in enumerate(limb.tolist()):
        by_limb.setdefault(l, []).append(k)
    for l, members in by_limb.items():
        for k in members:
            r0, r1, c0, c1 = boxes[k]
            maps[l, r0:r1, c0:c1] += stamps[k]
        if len(members) > 1 and _any_overlap([boxes[k] for k in members]):
            counts = np.zeros((height, width), np.float32)
            for k in members:
                r0, r1, c0, c1 = boxes[k]
                counts[r0:r1, c0:c1] += stamps[k] > 0
            np.divide(maps[l], counts, out=maps[l], where=counts > 1)


def _any_overlap(boxes: list) -> bool:
    for n, (r0, r1, c0, c1) in enumerate(boxes):
        for s0, s1, d0, d1 in boxes[n + 1:]:
            if r0 < s1 and s0 < r1 and c0 < d1 and d0 < c1:
                return True
    return False


def render_targets(people, out_h: int, out_w: int, stride: int, cfg: TargetConfig, skeleton: Skeleton,
                   person_mask=None) -> np.ndarray:
    """float32 [C, out_h, out_w] targets of `people` [P,K,3] (input pixels, v > 0 labelled), in
    the channel layout of `skeleton` (COCO: C = 50, K = 18).

    `person_mask` (out_h x out_w, values in [0, 1]) fills the person-mask channel after a 3x3
    erosion; without it that channel is 0. The last channel is the max over the keypoint maps.
    Values lie in [0, 1].
    """
    people = np.asarray(people, np.float32).reshape(-1, skeleton.num_keypoints, 3)
    out = np.zeros((skeleton.num_channels, out_h, out_w), np.float32)
    keypoint_maps = out[skeleton.keypoint_channels]
    _draw_keypoints(keypoint_maps, people, stride, cfg.keypoint_sigma)
    _draw_limbs(out[skeleton.limb_channels], people, skeleton.limbs, stride, cfg.limb_sigma,
                cfg.limb_margin)
    if person_mask is not None:
        mask = np.clip(np.asarray(person_mask, np.float32), 0.0, 1.0)
        if mask.shape != (out_h, out_w):
            raise ValueError(f"person_mask is {mask.shape}, expected {(out_h, out_w)}")
        out[skeleton.person_mask_channel] = cv2.erode(mask, _ERODE_KERNEL,
                                                      borderType=cv2.BORDER_REPLICATE)
    keypoint_maps.max(axis=0, out=out[skeleton.keypoint_max_channel])
    return out


class HostTargetPainter:
    """`data.device_targets.TargetPainter`'s call on the host: padded people [B, P, K, 3] and
    uint8 person masks [B, 1, h, w] (0-255) -> float32 targets [B, C, h, w], each sample drawn by
    `render_targets` with the mask as `data.augment.mask_fraction` makes it (so a sample's maps
    are those of `KeypointDataset.sample_arrays`, bit for bit). Padding rows (v = 0) draw nothing."""

    def __init__(self, skeleton: Skeleton, cfg: TargetConfig, stride: int):
        self.skeleton = skeleton
        self.cfg = cfg
        self.stride = int(stride)

    def __call__(self, people: torch.Tensor, person_mask: torch.Tensor) -> torch.Tensor:
        height, width = person_mask.shape[-2:]
        out = torch.empty(people.shape[0], self.skeleton.num_channels, height, width)
        for n, (person, mask) in enumerate(zip(people.cpu().numpy(), person_mask.cpu().numpy())):
            out[n] = torch.from_numpy(render_targets(person, height, width, self.stride, self.cfg,
                                                     self.skeleton, mask_fraction(mask[0])))
        return out
