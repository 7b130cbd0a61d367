"""Bottom-up grouping: keypoint peaks and limb maps at image size -> people with scores: limb candidates
matched greedily, people assembled over the skeleton's limbs in order, broken ones joined (`_bridge`)."""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np

from config.loader import check_section
from config.schema import InferenceConfig
from data.skeleton import Skeleton
from inference.peaks import find_peaks


SAMPLE_CELLS = 81920  # samples taken at once, pairs x samples (4096 pairs of 20: in the CPU cache)
PAIR_BUDGET = 1 << 18  # candidate pairs enumerated at once (a limb with more: in parts)
PROBE_FROM = 256    # candidate pairs from which a few samples first reject the hopeless ones
ROUNDS_FROM = 64    # candidates from which matching in vectorised rounds beats a Python walk
BLOCK_SLACK = 1 << 16  # cells allowed beyond 4 per candidate in one matching block of all limbs
BRIDGE_HOPS = 3     # partial people are joined across at most this many limbs (2 missing keypoints)
BRIDGE_PARTNERS = 8  # nearest partial people each partial person may be joined to
BRIDGE_LONE = 2     # nearest lone peaks per keypoint type each partial person may take
BRIDGE_CELLS = 1 << 20  # (person, part) or keypoint-pair cells the joining compares at once


def _samples(limb_maps: np.ndarray, limb, x_a, y_a, x_b, y_b, count: int, picked=slice(None)) -> np.ndarray:
    """[N, S] values of limb `limb[n]`'s map at (x_a, y_a) + t * (dx, dy), nearest pixel, for the
    `picked` of `count` steps t evenly from 0 to 1."""
    _, height, width = limb_maps.shape
    t = np.linspace(0.0, 1.0, count, dtype=np.float32)[picked]
    columns, rows = t * (x_b - x_a)[:, None], t * (y_b - y_a)[:, None]      # [N, S] sample points
    columns += x_a[:, None]
    rows += y_a[:, None]
    for values, size in ((columns, width), (rows, height)):
        np.rint(values, out=values)
        np.clip(values, 0, size - 1, out=values)
    # Whole numbers below 2 ** 24 add up exactly in float32.
    pixel = rows if height * width <= 2 ** 24 else rows.astype(np.float64)
    pixel *= width
    pixel += columns
    index = pixel.astype(np.intp)
    index += (limb * (height * width))[:, None]
    return limb_maps.reshape(-1).take(index, mode="clip")             # (indices all inside)


def _score_pairs(limb_maps: np.ndarray, limb, x_a, y_a, x_b, y_b, cfg: InferenceConfig):
    """(score, length, accepted) of candidate segments (x_a, y_a) -> (x_b, y_b) on their limbs' maps."""
    height = limb_maps.shape[1]
    dx, dy = x_b - x_a, y_b - y_a
    length = np.sqrt(dx * dx + dy * dy)
    samples = _samples(limb_maps, limb, x_a, y_a, x_b, y_b, cfg.limb_samples)
    score = samples.mean(-1) + np.minimum(0.5 * height / np.maximum(length, 1.0) - 1.0, 0.0)
    above = (samples > cfg.limb_threshold).astype(np.float32)            # counted by a matrix product
    support = above @ np.ones(cfg.limb_samples, np.float32) >= cfg.limb_min_ratio * cfg.limb_samples
    return score, length, support & (score > 0)


def _chunks(count: int, each: int, cells: int = SAMPLE_CELLS) -> list:
    """Slices of range(count): items of `each` cells, `cells` at most a slice."""
    step = max(1, cells // max(each, 1))
    return [slice(lo, lo + step) for lo in range(0, count, step)]


def _may_be_supported(limb_maps, limb, x_a, y_a, x_b, y_b, cfg: InferenceConfig) -> np.ndarray:
    """False for segments that surely fail the support rule, judged on a few inner samples."""
    needed = math.ceil(cfg.limb_min_ratio * cfg.limb_samples)     # samples above, at least
    allowed = cfg.limb_samples - needed                            # samples under, at most
    inner = np.arange(1, cfg.limb_samples - 1)
    probes = inner[np.unique(np.linspace(0, len(inner) - 1, min(len(inner), allowed + 2)).round()
                             .astype(np.intp))]
    if len(probes) <= allowed:
        return np.ones(len(limb), bool)
    samples = _samples(limb_maps, limb, x_a, y_a, x_b, y_b, cfg.limb_samples, probes)
    return (samples <= cfg.limb_threshold).sum(-1) <= allowed


def greedy_matching(limb, row, column, rank, shape) -> np.ndarray:
    """Positions of the candidates (cells (limb, row, column) of `shape`) a greedy matcher takes
    per limb by decreasing `rank` (ties: earlier first), each row and column once, in that order.
    With many candidates it runs in rounds: every candidate best in its row and column at once."""
    if len(rank) < ROUNDS_FROM:
        order = np.lexsort((-rank, limb))
        span = shape[1] + shape[2]               # keys: rows, then columns, of each limb
        taken, used = [], set()
        for index, row_key, column_key in zip(order.tolist(), (limb * span + row)[order].tolist(),
                                              (limb * span + shape[1] + column)[order].tolist()):
            if row_key not in used and column_key not in used:
                used.add(row_key)
                used.add(column_key)
                taken.append(index)
        return np.array(taken, np.intp)
    if shape[0] > 1 and np.prod(shape) > 4 * len(rank) + BLOCK_SLACK:    # unequal limbs: a block each
        starts = np.searchsorted(limb, np.arange(shape[0] + 1))
        return np.concatenate([lo + greedy_matching(limb[lo:hi] - l, row[lo:hi], column[lo:hi], rank[lo:hi],
                                                    (1, row[lo:hi].max() + 1, column[lo:hi].max() + 1))
                               for l, (lo, hi) in enumerate(zip(starts[:-1], starts[1:])) if hi > lo])
    free = np.full(shape, -np.inf, np.float32)          # rank of the cells still free
    free[limb, row, column] = rank
    position = np.zeros(shape, np.intp)
    position[limb, row, column] = np.arange(len(rank))
    taken = [np.zeros(0, np.intp)]
    limbs, rows = np.arange(shape[0])[:, None], np.arange(shape[1])
    while free.max() > -np.inf:
        best_column = free.argmax(axis=2)                   # [limbs, rows]: first best per row
        best_row = free.argmax(axis=1)                      # [limbs, columns]: first best per column
        best = free[limbs, rows, best_column]
        l, r = np.nonzero((best > -np.inf) & (best_row[limbs, best_column] == rows))
        c = best_column[l, r]
        taken.append(position[l, r, c])
        free[l, r, :] = -np.inf
        free.transpose(0, 2, 1)[l, c, :] = -np.inf
    taken = np.concatenate(taken)
    return taken[np.lexsort((taken, -rank[taken], limb[taken]))]


def limb_connections(limb_maps: np.ndarray, bounds: np.ndarray, xy: np.ndarray, peak_score: np.ndarray,
                     cfg: InferenceConfig, limbs) -> list[list[tuple]]:
    """Per limb ((a, b) keypoint pairs), [(peak_a, peak_b, score, length), ...] matched greedily
    by 0.5 * score + 0.25 * (peak_a + peak_b). `bounds[k]:bounds[k + 1]` are keypoint k's peaks.
    A pair is kept when `limb_min_ratio` of its samples exceed `limb_threshold` and its score (mean
    sample + min(0.5 * height / max(length, 1) - 1, 0)) is positive."""
    ends = np.asarray(limbs)
    count_a = bounds[ends[:, 0] + 1] - bounds[ends[:, 0]]
    count_b = bounds[ends[:, 1] + 1] - bounds[ends[:, 1]]
    connections: list[list[tuple]] = [[] for _ in limbs]
    pairs = count_a * count_b
    peaks = _Peaks(bounds, np.ascontiguousarray(xy[:, 0]), np.ascontiguousarray(xy[:, 1]), peak_score)
    first = 0
    while first < len(limbs):                   # limbs [first, last) together: one matching
        last = first + max(1, int(np.searchsorted(np.cumsum(pairs[first:]), PAIR_BUDGET, "right")))
        some = pairs[first:last]
        found = [_accepted(limb_maps, ends, peaks, count_b, some, first, lo, cfg)
                 for lo in range(0, int(some.sum()), PAIR_BUDGET)]
        if found:
            limb, local_a, local_b, score, length, rank = (np.concatenate(f) for f in zip(*found))
            shape = (last - first, count_a[first:last].max(), count_b[first:last].max())
            chosen = greedy_matching(limb - first, local_a, local_b, rank, shape)
            peak_a, peak_b = bounds[ends[limb, 0]] + local_a, bounds[ends[limb, 1]] + local_b
            for l, a, b, s, n in zip(limb[chosen].tolist(), peak_a[chosen].tolist(), peak_b[chosen].tolist(),
                                     score[chosen].tolist(), length[chosen].tolist()):
                connections[l].append((a, b, s, n))
        first = last
    return connections


# every keypoint's peaks: keypoint k's are `bounds[k]:bounds[k + 1]` of `x`, `y`, `score`
_Peaks = NamedTuple("_Peaks", [("bounds", np.ndarray), ("x", np.ndarray), ("y", np.ndarray),
                               ("score", np.ndarray)])


def _accepted(limb_maps, ends, peaks: _Peaks, count_b, pairs, first: int, lo: int,
              cfg: InferenceConfig) -> tuple:
    """(limb, local_a, local_b, score, length, rank) of the accepted pairs among candidates
    lo:lo + PAIR_BUDGET of the limbs from `first` (`pairs` each), listed by limb then (a, b) row-major."""
    bounds, x, y, peak_score = peaks
    starts = np.cumsum(pairs) - pairs
    index = np.arange(lo, min(lo + PAIR_BUDGET, int(pairs.sum())))
    limb = np.searchsorted(starts, index, "right") - 1
    local_a, local_b = np.divmod(index - starts[limb], count_b[first:][limb])
    limb += first
    peak_a, peak_b = bounds[ends[limb, 0]] + local_a, bounds[ends[limb, 1]] + local_b
    if len(limb) > PROBE_FROM:               # most pairs join two people: a few samples reject them
        hopeful = np.ones(len(limb), bool)
        for part in _chunks(len(limb), cfg.limb_samples):
            a, b = peak_a[part], peak_b[part]
            hopeful[part] = _may_be_supported(limb_maps, limb[part], x[a], y[a], x[b], y[b], cfg)
        hopeful = np.flatnonzero(hopeful)
        limb, local_a, local_b = limb[hopeful], local_a[hopeful], local_b[hopeful]
        peak_a, peak_b = peak_a[hopeful], peak_b[hopeful]
    score = np.empty(len(limb), np.float32)
    length = np.empty(len(limb), np.float32)
    accepted = np.empty(len(limb), bool)
    for part in _chunks(len(limb), cfg.limb_samples):
        a, b = peak_a[part], peak_b[part]
        score[part], length[part], accepted[part] = _score_pairs(
            limb_maps, limb[part], x[a], y[a], x[b], y[b], cfg)
    keep = np.flatnonzero(accepted)
    rank = 0.5 * score[keep] + 0.25 * (peak_score[peak_a[keep]] + peak_score[peak_b[keep]])
    return limb[keep], local_a[keep], local_b[keep], score[keep], length[keep], rank


class _Person:
    """A partial person: peak id per keypoint slot, scores, weakest and longest connection."""

    __slots__ = ("slots", "total", "parts", "weakest", "longest")

    def __init__(self, num_keypoints: int, slot: int, peak: int, score: float):
        """A person of one keypoint: `peak` in `slot`, of peak score `score`."""
        self.slots = [-1] * num_keypoints
        self.slots[slot] = peak
        self.total = score
        self.parts = 1
        self.weakest = float("inf")
        self.longest = 0.0

    def absorb(self, other: "_Person", score: float, length: float = 0.0) -> None:
        """Take `other`'s keypoints (no slot in common), joined by a link of `score` and `length`."""
        for slot, peak in enumerate(other.slots):
            if peak >= 0:
                self.slots[slot] = peak
        self.total += other.total + score
        self.parts += other.parts
        self.weakest = min(self.weakest, other.weakest, score)
        self.longest = max(self.longest, other.longest, length)


def _assemble(connections, peak_score, cfg: InferenceConfig, skeleton: Skeleton) -> list[_Person]:
    """Greedy assembly over limbs in order; `connections[l]` holds (peak_a, peak_b, score, length)."""
    people: list[_Person | None] = []
    owner: dict[int, int] = {}

    def add(pid: int, slot: int, peak: int, score: float, length: float) -> None:
        people[pid].absorb(_Person(skeleton.num_keypoints, slot, peak, peak_score[peak]), score, length)
        owner[peak] = pid

    for (slot_a, slot_b), found in zip(skeleton.limbs, connections):
        for peak_a, peak_b, score, length in found:
            pa, pb = owner.get(peak_a), owner.get(peak_b)
            if pa is None and pb is None:
                people.append(_Person(skeleton.num_keypoints, slot_a, peak_a, peak_score[peak_a]))
                owner[peak_a] = len(people) - 1
                add(len(people) - 1, slot_b, peak_b, score, length)
            elif pb is None or pa is None:
                pid, slot, peak = (pa, slot_b, peak_b) if pb is None else (pb, slot_a, peak_a)
                person = people[pid]
                if person.slots[slot] < 0 and length <= cfg.max_limb_ratio * person.longest:
                    add(pid, slot, peak, score, length)
            elif pa != pb:
                first, second = people[pa], people[pb]
                clash = any(x >= 0 and y >= 0 for x, y in zip(first.slots, second.slots))
                weakest = min(first.weakest, second.weakest)
                longest = max(first.longest, second.longest)
                if clash or score < cfg.merge_ratio * weakest or length > cfg.max_limb_ratio * longest:
                    continue
                first.absorb(second, score, length)
                for peak in second.slots:
                    if peak >= 0:
                        owner[peak] = pa
                people[pb] = None
    return [p for p in people if p is not None]


@functools.lru_cache(maxsize=None)
def limb_hops(num_keypoints: int, limbs: tuple) -> np.ndarray:
    """[K, K] int: the fewest of `limbs` joining two of `num_keypoints` keypoints (K + 1: none)."""
    k, ends = num_keypoints, np.array(limbs)
    hops = np.full((k, k), k + 1)
    hops[ends[:, 0], ends[:, 1]] = hops[ends[:, 1], ends[:, 0]] = 1
    np.fill_diagonal(hops, 0)
    for via in range(k):                          # Floyd-Warshall
        np.minimum(hops, hops[:, via, None] + hops[via], out=hops)
    return hops


def _nearest(rows: np.ndarray, relative: np.ndarray, count: int) -> np.ndarray:
    """Positions of the `count` smallest `relative` of each value of `rows` (ties: first listed)."""
    order = np.lexsort((relative, rows))
    return order[np.arange(len(order)) - np.searchsorted(rows[order], rows[order]) < count]


def _person_pairs(slots, longest, present, within, xy, hops, ratio) -> list:
    """(relative distance, i, j) of partial people i < j `_bridge` may join (BRIDGE_PARTNERS nearest)."""
    crowd = len(slots)
    found = []
    for rows in _chunks(crowd, crowd, BRIDGE_CELLS):
        # limbs from i's keypoints to j's closest one
        closest = BRIDGE_HOPS + 1 - sum((w[rows] @ present.T > 0).astype(np.intp) for w in within)
        closest[rows.start + np.arange(len(closest))[:, None] >= np.arange(crowd)] = 0     # each pair once
        i, j = np.nonzero(closest >= 2)
        h, i = closest[i, j], i + rows.start
        gap = np.full(len(i), np.inf, np.float32)
        for limbs in range(2, BRIDGE_HOPS + 1):   # the least distance between keypoints h limbs apart
            ka, kb = np.nonzero(hops == limbs)
            these = np.flatnonzero(h == limbs)
            for part in _chunks(len(these), len(ka), BRIDGE_CELLS):
                pair = these[part]
                mine, theirs = slots[i[pair]][:, ka], slots[j[pair]][:, kb]
                d = np.hypot(*np.moveaxis(xy[mine] - xy[theirs], -1, 0))
                gap[pair] = np.where((mine >= 0) & (theirs >= 0), d, np.inf).min(1)
        relative = gap / np.maximum(h * np.minimum(longest[i], longest[j]), 1.0)
        near = np.flatnonzero(relative <= ratio)
        kept = near[_nearest(i[near], relative[near], BRIDGE_PARTNERS)]
        found += zip(relative[kept].tolist(), i[kept].tolist(), j[kept].tolist())
    return found


def _lone_pairs(slots, longest, to_type, lone, channel, xy, hops, ratio) -> list:
    """(relative distance, i, crowd + n) of people i and lone peaks lone[n] `_bridge` may join."""
    crowd = len(slots)
    found = []
    for kind in np.unique(channel[lone]):
        which = np.flatnonzero(channel[lone] == kind)
        # (person, keypoint) ends: the person's keypoints closest to this type, 2+ limbs away
        person, end = np.nonzero((slots >= 0) & (hops[:, kind] == to_type[:, kind, None])
                                 & (to_type[:, kind, None] >= 2))
        for part in _chunks(len(person), len(which), BRIDGE_CELLS):
            i, k = person[part], end[part]
            gap = np.hypot(*np.moveaxis(xy[slots[i, k]][:, None] - xy[lone[which]][None], -1, 0))
            relative = gap / np.maximum(hops[k, kind] * longest[i], 1.0)[:, None]
            e, n = np.nonzero(relative <= ratio)
            kept = _nearest(i[e], relative[e, n], BRIDGE_LONE)
            e, n = e[kept], n[kept]
            found += zip(relative[e, n].tolist(), i[e].tolist(), (crowd + which[n]).tolist())
    return found


def _bridge(people: list[_Person], channel: np.ndarray, xy: np.ndarray, peak_score: np.ndarray,
            hops: np.ndarray, ratio: float) -> list[_Person]:
    """Join to partial people the parts (another person, or a lone peak) that only missing keypoints
    could link (docs/evaluation.md, "Joining broken people"), h = 2..BRIDGE_HOPS limbs apart."""
    if ratio <= 0 or not people:
        return people
    slots = np.array([p.slots for p in people])
    longest = np.array([p.longest for p in people], np.float32)
    taken = np.zeros(len(xy), bool)
    taken[slots[slots >= 0]] = True
    lone = np.flatnonzero(~taken)
    present = (slots >= 0).astype(np.float32)
    within = [present @ (hops <= h).astype(np.float32) for h in range(BRIDGE_HOPS + 1)]
    to_type = BRIDGE_HOPS + 1 - sum((w > 0).astype(np.intp) for w in within)   # [P, K]: limbs to each type
    found = _person_pairs(slots, longest, present, within, xy, hops, ratio)
    if len(lone):
        found += _lone_pairs(slots, longest, to_type, lone, channel, xy, hops, ratio)
    crowd, size = slots.shape
    parts: list = people + [None] * len(lone)
    group = list(range(len(parts)))

    def root(n: int) -> int:
        while group[n] != n:
            n = group[n]
        return n

    def part(n: int) -> _Person:
        if parts[n] is None:                     # a lone peak: a person of one keypoint
            peak = int(lone[n - crowd])
            parts[n] = _Person(size, channel[peak], peak, float(peak_score[peak]))
        return parts[n]
    touching = hops <= 1                          # the same keypoint, or one limb apart
    for _, i, j in sorted(found):
        ri, rj = root(i), root(j)
        if ri == rj or (j >= crowd and rj != j) or touching[np.ix_(np.array(part(ri).slots) >= 0,
                                                                   np.array(part(rj).slots) >= 0)].any():
            continue
        part(ri).absorb(part(rj), 0.0)
        group[rj] = ri
    return [p for n, p in enumerate(people) if group[n] == n]


def group_people(maps, cfg: InferenceConfig, skeleton: Skeleton):
    """People in `maps` [C, H, W]: keypoints [P, K, 3] (x, y, peak score; 0 if missing) and
    scores [P] (1 - 1 / total, decreasing, at most `cfg.max_people`), float32. `cfg` is checked
    as a config file's would be (one built in Python too): ConfigError naming the field."""
    check_section(cfg, "inference")
    maps = np.asarray(maps.detach().cpu() if hasattr(maps, "detach") else maps, dtype=np.float32)
    if maps.shape[0] != skeleton.num_channels:
        raise ValueError(f"{maps.shape[0]} maps but skeleton {skeleton.name} has "
                         f"{skeleton.num_channels} channels")
    channel, xy, peak_score = find_peaks(maps[skeleton.keypoint_channels], cfg.peak_threshold,
                                         cfg.refine_radius, cfg.max_peaks)
    bounds = np.searchsorted(channel, np.arange(skeleton.num_keypoints + 1))
    connections = limb_connections(maps[skeleton.limb_channels], bounds, xy, peak_score, cfg, skeleton.limbs)
    people = _assemble(connections, peak_score.tolist(), cfg, skeleton)
    hops = limb_hops(skeleton.num_keypoints, skeleton.limbs)
    people = _bridge(people, channel, xy, peak_score, hops, cfg.bridge_ratio)
    people = [p for p in people if p.parts >= cfg.min_parts and p.total / p.parts >= cfg.min_mean_score]
    scores = np.array([1.0 - 1.0 / p.total for p in people], dtype=np.float32)
    order = np.argsort(-scores, kind="stable")[: cfg.max_people]
    slots = np.array([people[index].slots for index in order], np.intp)
    slots = slots.reshape(len(order), skeleton.num_keypoints)      # peak ids; -1: missing, zeroed below
    found = np.column_stack([xy, peak_score])[slots]
    return np.where(slots[..., None] >= 0, found, 0).astype(np.float32), scores[order]


def to_coco_results(image_id: int, keypoints: np.ndarray, scores: np.ndarray, skeleton: Skeleton,
                    category_id: int = 1) -> list[dict]:
    """COCO keypoint results of one image in the dataset's order: found (x, y, 1), missing 0s."""
    results = []
    for person, score in zip(keypoints, scores):
        coco = skeleton.to_dataset_order(person)
        triples = np.where(coco[:, 2:] > 0, np.column_stack([coco[:, :2], np.ones(len(coco))]), 0.0)
        results.append({"image_id": int(image_id), "category_id": int(category_id),
                        "keypoints": [round(float(v), 2) for v in triples.reshape(-1)],
                        "score": float(score)})
    return results
