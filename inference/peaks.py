"""Keypoint peaks: 3x3 non-maximum suppression on heatmaps, one peak per plateau (its first pixel in
raster order, which the centroid moves to the plateau's centre), refined to the Gaussian's centre."""
from __future__ import annotations

import cv2
import numpy as np

# Neighbour offsets (di, dj); the first four come before the centre in raster order.
_EARLIER = ((-1, -1), (-1, 0), (-1, 1), (0, -1))
_LATER = ((0, 1), (1, -1), (1, 0), (1, 1))
DENSE_FRACTION = 1 / 32    # above-threshold share of the pixels from which the dilation is cheaper
_SAMPLE_ROWS = 64          # that share is estimated on every 64th row
_SQUARE_3X3 = np.ones((3, 3), np.uint8)


def _neighbour(flat_index, i, j, di, dj, height, width):
    """Flat index of neighbour (i+di, j+dj) and whether it lies inside the map."""
    ni, nj = i + di, j + dj
    inside = (ni >= 0) & (ni < height) & (nj >= 0) & (nj < width)
    return np.where(inside, flat_index + di * width + dj, flat_index), inside


def local_maxima(heatmaps: np.ndarray, threshold: float, dense: bool | None = None) -> np.ndarray:
    """Sorted flat indices into float32 `heatmaps` [K, H, W] of the pixels above `threshold` and
    >= their 8 neighbours; `dense` forces one of two equal ways (None: the cheaper)."""
    if dense is None:
        sample = heatmaps[:, ::_SAMPLE_ROWS]
        dense = np.count_nonzero(sample > threshold) > DENSE_FRACTION * sample.size
    return (_local_maxima_dense if dense else _local_maxima_sparse)(heatmaps, threshold)


def _above_per_map(heatmaps, threshold):
    """(map index, sorted indices of its pixels above `threshold`) of each map with any."""
    _, height, width = heatmaps.shape
    is_above = np.empty(height * width, bool)
    for index, heatmap in enumerate(heatmaps):
        cand = np.flatnonzero(np.greater(heatmap.reshape(-1), threshold, out=is_above))
        if cand.size:
            yield index, cand


def _local_maxima_dense(heatmaps, threshold) -> np.ndarray:
    """Per map: pixels above threshold equal to their 3x3 dilation (over the rows that hold any)."""
    _, height, width = heatmaps.shape
    neighbourhood_max = np.empty((height, width), np.float32)
    found = []
    for index, cand in _above_per_map(heatmaps, threshold):
        heatmap = heatmaps[index]
        top, bottom = max(cand[0] // width - 1, 0), min(cand[-1] // width + 2, height)
        cv2.dilate(heatmap[top:bottom], _SQUARE_3X3, dst=neighbourhood_max[:bottom - top])
        peak = heatmap.reshape(-1)[cand] == neighbourhood_max.reshape(-1)[cand - top * width]
        found.append(cand[peak] + index * height * width)
    return np.concatenate(found) if found else np.zeros(0, np.intp)


def _local_maxima_sparse(heatmaps, threshold) -> np.ndarray:
    """Per map: pixels above threshold and >= their neighbours, comparing only those pixels."""
    _, height, width = heatmaps.shape
    flat = heatmaps.reshape(-1)
    found = [cand + index * height * width for index, cand in _above_per_map(heatmaps, threshold)]
    cand = np.concatenate(found) if found else np.zeros(0, np.intp)
    value = flat[cand]
    # a cheap horizontal test first leaves the exact test few candidates
    column = cand % width
    keep = (((value >= flat[cand - 1]) | (column == 0))
            & ((value >= flat[np.minimum(cand + 1, flat.size - 1)]) | (column == width - 1)))
    cand, value = cand[keep], value[keep]
    i, j = np.divmod(cand % (height * width), width)
    for di, dj in ((-1, 0), (1, 0), (-1, -1), (-1, 1), (1, -1), (1, 1)):   # left, right: done above
        nb, _ = _neighbour(cand, i, j, di, dj, height, width)
        keep = value >= flat[nb]
        cand, value, i, j = cand[keep], value[keep], i[keep], j[keep]
    return cand


def _plateau_firsts(flat, cand, height, width):
    """(kept mask, half_step [N, 2]) of maxima `cand`: one whose earlier neighbour is equal is
    dropped; a kept one notes its plateau's centre (dx, dy in {-0.5, 0, 0.5})."""
    value = flat[cand]
    i, j = np.divmod(cand % (height * width), width)
    first = np.ones(cand.shape, dtype=bool)
    for di, dj in _EARLIER:
        nb, inside = _neighbour(cand, i, j, di, dj, height, width)
        first &= ~(inside & (flat[nb] == value))
    cand, value, i, j = cand[first], value[first], i[first], j[first]
    shift = np.zeros((len(cand), 2), np.float32)        # (dx, dy) sums over plateau members
    members = np.ones(len(cand), np.float32)
    for di, dj in _LATER:
        nb, inside = _neighbour(cand, i, j, di, dj, height, width)
        same = inside & (flat[nb] == value)
        shift += same[:, None] * np.array([dj, di], np.float32)
        members += same
    return first, 0.5 * np.sign(shift / members[:, None])


def _strongest_floor(value, channel, channels: int, count: int) -> np.ndarray:
    """Per map, the `count`-th largest of its values (-inf where it has no more than `count`)."""
    floor = np.full(channels, -np.inf, np.float32)
    bounds = np.searchsorted(channel, np.arange(channels + 1))
    for c in np.flatnonzero(np.diff(bounds) > count):
        values = value[bounds[c]:bounds[c + 1]]
        floor[c] = np.partition(values, len(values) - count)[len(values) - count]
    return floor


def find_peaks(heatmaps: np.ndarray, threshold: float, refine_radius: int = 2, max_per_map: int = 0):
    """Peaks of each map [K, H, W] above `threshold`: (channel int64 [N], refined xy float32 [N, 2],
    score float32 [N]) by channel then raster order; `max_per_map` > 0 keeps each map's strongest."""
    heatmaps = np.ascontiguousarray(heatmaps, dtype=np.float32)
    channels, height, width = heatmaps.shape
    flat = heatmaps.reshape(-1)
    maxima = local_maxima(heatmaps, threshold)
    floor = None                    # per map: a weaker maximum cannot be among the strongest
    if 0 < max_per_map < len(maxima):
        floor = _strongest_floor(flat[maxima], maxima // (height * width), channels, max_per_map)
    while True:
        cand = maxima if floor is None else maxima[flat[maxima] >= floor[maxima // (height * width)]]
        first, half_step = _plateau_firsts(flat, cand, height, width)
        cand = cand[first]
        if floor is None:
            break
        found = np.bincount(cand // (height * width), minlength=channels)
        short = (found < max_per_map) & (floor > -np.inf)
        if not short.any():
            break
        floor[short] = -np.inf        # plateaus dropped some of that map's strongest: take it whole
    value = flat[cand]
    channel, i, j = np.unravel_index(cand, heatmaps.shape)
    if max_per_map > 0 and len(cand) > max_per_map:
        order = np.lexsort((-value, channel))                  # per map, strongest first
        rank = np.arange(len(order)) - np.searchsorted(channel[order], channel[order])
        kept = np.sort(order[rank < max_per_map])
        channel, value, i, j, half_step = channel[kept], value[kept], i[kept], j[kept], half_step[kept]
    xy = refine_peaks(heatmaps, channel, i, j, refine_radius, half_step)
    if refine_radius > 0:
        xy = gaussian_centres(heatmaps, channel, i, j, xy)
    return channel, xy, value.astype(np.float32)


def gaussian_centres(heatmaps: np.ndarray, channel, i, j, xy: np.ndarray) -> np.ndarray:
    """Per axis, the vertex of the parabola through the logs of the peak and its neighbours (docs:
    "Peaks"); `xy` kept where the map does not curve down or the vertex is over a pixel away."""
    _, height, width = heatmaps.shape
    out = xy.astype(np.float64)
    centre = np.log(np.maximum(heatmaps[channel, i, j], 1e-30))
    for axis, (di, dj) in enumerate(((0, 1), (1, 0))):
        inside = (i - di >= 0) & (j - dj >= 0) & (i + di < height) & (j + dj < width)
        before, after = (np.log(np.maximum(heatmaps[channel, np.clip(i + s * di, 0, height - 1),
                                                    np.clip(j + s * dj, 0, width - 1)], 1e-30))
                         for s in (-1, 1))
        curve = before - 2 * centre + after
        with np.errstate(divide="ignore", invalid="ignore"):
            vertex = 0.5 * (before - after) / curve
        use = inside & (curve < 0) & (np.abs(vertex) <= 1)
        out[use, axis] = (j if axis == 0 else i)[use] + vertex[use]
    return out.astype(np.float32)


def refine_peaks(heatmaps: np.ndarray, channel, i, j, radius: int, half_step: np.ndarray) -> np.ndarray:
    """Weighted centroid (x, y) of each peak's (2r+1)^2 window (outside the map: 0), widened by
    `half_step` [N, 2] to stay centred on a plateau."""
    xy = np.stack([j, i], axis=1).astype(np.float32)
    if radius <= 0 or len(channel) == 0:
        return xy + half_step
    _, height, width = heatmaps.shape
    offsets = np.arange(-radius - 1, radius + 2)
    rows = i[:, None, None] + offsets[None, :, None]
    cols = j[:, None, None] + offsets[None, None, :]
    inside = (rows >= 0) & (rows < height) & (cols >= 0) & (cols < width)
    # The outer ring takes part only on the side a plateau extends to: [N, offsets] per axis (x, y).
    use_col, use_row = ((np.abs(offsets) <= radius) | ((offsets == radius + 1) & (step > 0))
                        | ((offsets == -radius - 1) & (step < 0))
                        for step in (half_step[:, :1], half_step[:, 1:]))
    inside &= use_row[:, :, None] & use_col[:, None, :]
    weights = heatmaps[channel[:, None, None], np.clip(rows, 0, height - 1), np.clip(cols, 0, width - 1)]
    weights = np.where(inside, np.maximum(weights, 0.0), 0.0)
    total = weights.sum(axis=(1, 2))
    total = np.where(total > 0, total, 1.0)
    dy = (weights * offsets[None, :, None]).sum(axis=(1, 2)) / total
    dx = (weights * offsets[None, None, :]).sum(axis=(1, 2)) / total
    return xy + np.stack([dx, dy], axis=1).astype(np.float32)
