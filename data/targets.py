"""Ground-truth maps (limbs, keypoints, person mask, keypoint max); output cell (i, j) samples the input
point ((j + 0.5) * stride - 0.5, (i + 0.5) * stride - 0.5). Keypoints are Gaussians (several people: max),
limbs Gaussians of the distance to the segment inside its box widened by a margin (several: mean), each
drawn in a window, 0 below exp(-GAUSSIAN_CUTOFF). `HostTargetPainter` draws a batch on a CPU device."""
from __future__ import annotations

import math

import cv2
import numpy as np
import torch

from config.schema import TargetConfig
from data.skeleton import Skeleton
from data.augment import mask_fraction

GAUSSIAN_CUTOFF = 4.6052          # exp(-4.6052) = 0.01: values below are set to 0
MIN_VALUE = math.exp(-GAUSSIAN_CUTOFF)
_ERODE_KERNEL = np.ones((3, 3), np.uint8)
_CHUNK_CELLS = 1 << 19            # limb cells computed at once (a few MB per temporary array)


def _draw_keypoints(maps: np.ndarray, people: np.ndarray, stride: int, sigma: float) -> None:
    """Max-combine one Gaussian per labelled keypoint into maps [K,H,W] (square windows)."""
    height, width = maps.shape[1:]
    person, kind = np.nonzero(people[:, :, 2] > 0)
    if person.size == 0:
        return
    xy = people[person, kind, :2].astype(np.float64)[:, :, None]                # [n, 2 (x, y), 1]
    radius = math.sqrt(2 * GAUSSIAN_CUTOFF) * sigma
    span = int(math.ceil(2 * radius / stride)) + 2           # cells per window side, unclipped
    cells = np.ceil((xy - radius + 0.5) / stride - 0.5).astype(np.int64) + np.arange(span)   # [n, 2, span]
    gx, gy = np.exp(-0.5 / sigma ** 2 * ((cells + 0.5) * stride - 0.5 - xy) ** 2).transpose(1, 0, 2)
    stamps = (gy[:, :, None] * gx[:, None, :]).astype(np.float32)
    stamps[stamps < MIN_VALUE] = 0
    cols, rows = cells.transpose(1, 0, 2)                                   # [n, span] cells
    inside = (((rows >= 0) & (rows < height))[:, :, None] & ((cols >= 0) & (cols < width))[:, None, :]
              & (stamps > 0))
    cell = (kind[:, None, None] * height + rows[:, :, None]) * width + cols[:, None, :]
    np.maximum.at(maps.reshape(-1), cell[inside], stamps[inside])


def _draw_limbs(maps: np.ndarray, people: np.ndarray, limbs, stride: int, sigma: float,
                margin: float) -> None:
    """Mean of one perpendicular-distance Gaussian per labelled limb into maps [L,H,W]."""
    height, width = maps.shape[1:]
    ends_a, ends_b = people[:, [a for a, _ in limbs]], people[:, [b for _, b in limbs]]
    person, limb = np.nonzero((ends_a[:, :, 2] > 0) & (ends_b[:, :, 2] > 0))
    a = ends_a[person, limb, :2].astype(np.float64)
    b = ends_b[person, limb, :2].astype(np.float64)
    # each limb's window: the cells [first, last) whose sample points lie in its box widened by margin
    first = np.maximum(np.ceil((np.minimum(a, b) - margin + 0.5) / stride - 0.5), 0).astype(np.int64)
    last = np.minimum(np.floor((np.maximum(a, b) + margin + 0.5) / stride - 0.5), [width - 1, height - 1]) + 1
    (j0, i0), (j1, i1) = first.T, last.astype(np.int64).T
    keep = (j1 > j0) & (i1 > i0)
    limb, a, b, i0, i1, j0, j1 = (v[keep] for v in (limb, a, b, i0, i1, j0, j1))
    if limb.size == 0:
        return
    delta = b - a
    length = np.hypot(delta[:, 0], delta[:, 1])
    point = length < 1e-6                                  # degenerate limb: distance to a point
    unit = np.where(point[:, None], [1.0, 0.0], delta / np.maximum(length, 1e-6)[:, None])
    root = math.sqrt(0.5) / sigma                          # g = exp(-(root * distance)^2)
    cols = j1 - j0
    area = (i1 - i0) * cols
    flat = maps.reshape(-1)
    ends = np.cumsum(area)
    reached_cells = []
    first = 0
    while first < limb.size:            # limbs in order, a bounded number of cells at a time
        last = max(first + 1, int(np.searchsorted(ends, ends[first] - area[first] + _CHUNK_CELLS,
                                                  side="right")))
        part = np.arange(first, last)
        owner = np.repeat(part, area[part])                    # the limb of each flat cell
        starts = ends[part] - area[part]
        local = np.arange(owner.size) - np.repeat(starts - starts[0], area[part])
        row, col = i0[owner] + local // cols[owner], j0[owner] + local % cols[owner]
        dx = (col + 0.5) * stride - 0.5 - a[owner, 0]
        dy = (row + 0.5) * stride - 0.5 - a[owner, 1]
        ux, uy = unit[owner, 0] * root, unit[owner, 1] * root
        across = dx * uy - dy * ux
        dist2 = across * across
        if point[part].any():
            along = (dx * ux + dy * uy) * point[owner]
            dist2 += along * along
        reached = dist2 <= GAUSSIAN_CUTOFF
        cell = ((limb[owner] * height + row) * width + col)[reached]
        np.add.at(flat, cell, np.exp(-dist2[reached]).astype(np.float32))
        reached_cells.append(cell)
        first = last
    shared, counts = np.unique(np.concatenate(reached_cells), return_counts=True)
    if (several := counts > 1).any():
        flat[shared[several]] /= counts[several].astype(np.float32)


def render_targets(people, out_h: int, out_w: int, stride: int, cfg: TargetConfig, skeleton: Skeleton,
                   person_mask=None, out: np.ndarray | None = None) -> np.ndarray:
    """float32 [C, out_h, out_w] targets in [0, 1] of `people` [P,K,3] (input pixels) in `skeleton`'s
    channels; `person_mask` fills its channel after a 3x3 erosion; `out`: a zeroed array to fill."""
    people = np.asarray(people, np.float32).reshape(-1, skeleton.num_keypoints, 3)
    shape = (skeleton.num_channels, out_h, out_w)
    if out is None:
        out = np.zeros(shape, np.float32)
    elif out.shape != shape or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"out is {out.dtype} {out.shape}, expected a contiguous float32 {shape}")
    keypoint_maps = out[skeleton.keypoint_channels]
    _draw_keypoints(keypoint_maps, people, stride, cfg.keypoint_sigma)
    _draw_limbs(out[skeleton.limb_channels], people, skeleton.limbs, stride, cfg.limb_sigma, cfg.limb_margin)
    if person_mask is not None:
        mask = np.clip(np.asarray(person_mask, np.float32), 0.0, 1.0)
        if mask.shape != (out_h, out_w):
            raise ValueError(f"person_mask is {mask.shape}, expected {(out_h, out_w)}")
        out[skeleton.person_mask_channel] = cv2.erode(mask, _ERODE_KERNEL, borderType=cv2.BORDER_REPLICATE)
    keypoint_maps.max(axis=0, out=out[skeleton.keypoint_max_channel])
    return out


class HostTargetPainter:
    """`TargetPainter` on the host: people [B, P, K, 3], uint8 masks [B, 1, h, w] -> float32 [B, C, h, w]."""

    def __init__(self, skeleton: Skeleton, cfg: TargetConfig, stride: int):
        self.skeleton = skeleton
        self.cfg = cfg
        self.stride = int(stride)

    def __call__(self, people: torch.Tensor, person_mask: torch.Tensor) -> torch.Tensor:
        height, width = person_mask.shape[-2:]
        maps = np.zeros((people.shape[0], self.skeleton.num_channels, height, width), np.float32)
        for n, (person, mask) in enumerate(zip(people.cpu().numpy(), person_mask.cpu().numpy())):
            render_targets(person, height, width, self.stride, self.cfg, self.skeleton,
                           mask_fraction(mask[0]), out=maps[n])
        return torch.from_numpy(maps)
