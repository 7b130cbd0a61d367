"""Bottom-up grouping: keypoint peaks and limb maps at image size -> people with scores.

Steps (../shared/SPEC.md, "Inference and grouping"): peaks by 3x3 NMS with centroid refinement
(`inference.peaks`); for each limb, every candidate pair is scored along its segment at once
(numpy), pairs are matched greedily; people are assembled greedily over the 30 limbs, merging two
partial people when the joining limb is strong enough; weak or tiny people are dropped.
"""
from __future__ import annotations

import numpy as np

from config.schema import InferenceConfig
from config.skeleton import COCO_TO_OURS, KEYPOINT_CHANNELS, LIMB_CHANNELS, LIMBS, NUM_KEYPOINTS
from inference.peaks import find_peaks


PAIR_CHUNK = 20000   # candidate pairs sampled at once


def _score_pairs(limb_maps: np.ndarray, limb, xy_a, xy_b, cfg: InferenceConfig):
    """(score, length, accepted) of candidate segments xy_a -> xy_b on their limbs' maps."""
    _, height, width = limb_maps.shape
    delta = xy_b - xy_a                                                   # [N, 2]
    length = np.sqrt((delta ** 2).sum(-1))
    t = np.linspace(0.0, 1.0, cfg.limb_samples, dtype=np.float32)
    points = xy_a[:, None, :] + t[None, :, None] * delta[:, None, :]      # [N, S, 2]
    cols = np.clip(np.rint(points[..., 0]).astype(np.int64), 0, width - 1)
    rows = np.clip(np.rint(points[..., 1]).astype(np.int64), 0, height - 1)
    samples = limb_maps.reshape(-1)[(limb[:, None] * height + rows) * width + cols]
    score = samples.mean(-1) + np.minimum(0.5 * height / np.maximum(length, 1e-6) - 1.0, 0.0)
    support = (samples > cfg.limb_threshold).sum(-1) >= cfg.limb_min_ratio * cfg.limb_samples
    return score, length, support & (score > 0) & (length >= 1e-6)


def limb_connections(limb_maps: np.ndarray, bounds: np.ndarray, xy: np.ndarray, peak_score: np.ndarray,
                     cfg: InferenceConfig) -> list[list[tuple]]:
    """Per limb, its connections matched greedily: [(peak_a, peak_b, score, length), ...].

    `bounds[k]:bounds[k + 1]` are the peaks of keypoint k in `xy` / `peak_score`. Every candidate
    pair of every limb is sampled at `cfg.limb_samples` points on its segment in one batch; a pair
    is kept when at least `limb_min_ratio` of its samples exceed `limb_threshold` and its score,
    the mean sample plus min(0.5 * image_height / length - 1, 0), is positive. Per limb, pairs are
    taken in decreasing order of 0.5 * score + 0.25 * (peak_a + peak_b), each peak at most once.
    """
    ends = np.asarray(LIMBS)
    start_a, start_b = bounds[ends[:, 0]], bounds[ends[:, 1]]
    count_a, count_b = bounds[ends[:, 0] + 1] - start_a, bounds[ends[:, 1] + 1] - start_b
    pairs = count_a * count_b
    connections: list[list[tuple]] = [[] for _ in LIMBS]
    if pairs.sum() == 0:
        return connections
    limb = np.repeat(np.arange(len(LIMBS)), pairs)
    local = np.arange(pairs.sum()) - np.repeat(np.cumsum(pairs) - pairs, pairs)
    peak_a = start_a[limb] + local // count_b[limb]
    peak_b = start_b[limb] + local % count_b[limb]
    score = np.empty(len(limb), np.float32)
    length = np.empty(len(limb), np.float32)
    accepted = np.empty(len(limb), bool)
    for lo in range(0, len(limb), PAIR_CHUNK):            # bounded memory on noisy maps
        part = slice(lo, lo + PAIR_CHUNK)
        score[part], length[part], accepted[part] = _score_pairs(
            limb_maps, limb[part], xy[peak_a[part]], xy[peak_b[part]], cfg)
    keep = np.flatnonzero(accepted)
    rank = 0.5 * score[keep] + 0.25 * (peak_score[peak_a[keep]] + peak_score[peak_b[keep]])
    keep = keep[np.lexsort((-rank, limb[keep]))]                      # by limb, best first
    used = set()
    for l, a, b, s, n in zip(limb[keep].tolist(), peak_a[keep].tolist(), peak_b[keep].tolist(),
                             score[keep].tolist(), length[keep].tolist()):
        if (l, a) in used or (l, b) in used:
            continue
        used.add((l, a))
        used.add((l, b))
        connections[l].append((a, b, s, n))
    return connections


class _Person:
    """A partial person during assembly: peak id per keypoint slot, running scores."""

    __slots__ = ("slots", "total", "parts", "weakest", "longest")

    def __init__(self):
        self.slots = [-1] * NUM_KEYPOINTS
        self.total = 0.0
        self.parts = 0
        self.weakest = float("inf")
        self.longest = 0.0


def _assemble(connections, peak_score, cfg: InferenceConfig) -> list[_Person]:
    """Greedy assembly over limbs in order; `connections[l]` holds (peak_a, peak_b, score, length)."""
    people: list[_Person | None] = []
    owner: dict[int, int] = {}

    def add(pid: int, slot: int, peak: int, score: float, length: float) -> None:
        person = people[pid]
        person.slots[slot] = peak
        person.total += peak_score[peak] + score
        person.parts += 1
        person.weakest = min(person.weakest, score)
        person.longest = max(person.longest, length)
        owner[peak] = pid

    for (slot_a, slot_b), found in zip(LIMBS, connections):
        for peak_a, peak_b, score, length in found:
            pa, pb = owner.get(peak_a), owner.get(peak_b)
            if pa is None and pb is None:
                person = _Person()
                person.slots[slot_a] = peak_a
                person.total = peak_score[peak_a]
                person.parts = 1
                people.append(person)
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
                for slot, peak in enumerate(second.slots):
                    if peak >= 0:
                        first.slots[slot] = peak
                        owner[peak] = pa
                first.total += second.total + score
                first.parts += second.parts
                first.weakest = min(weakest, score)
                first.longest = max(longest, length)
                people[pb] = None
    return [p for p in people if p is not None]


def group_people(maps, cfg: InferenceConfig):
    """People in `maps` [50, H, W] (image size): (keypoints float32 [P, 18, 3], scores float32 [P]).

    keypoints hold (x, y, peak score) in image pixels, score 0 for a missing keypoint; people are
    sorted by decreasing score = 1 - 1 / total, at most `cfg.max_people`.
    """
    maps = np.asarray(maps.detach().cpu() if hasattr(maps, "detach") else maps, dtype=np.float32)
    channel, xy, peak_score = find_peaks(maps[KEYPOINT_CHANNELS], cfg.peak_threshold,
                                         cfg.refine_radius, cfg.max_peaks)
    bounds = np.searchsorted(channel, np.arange(NUM_KEYPOINTS + 1))
    connections = limb_connections(maps[LIMB_CHANNELS], bounds, xy, peak_score, cfg)
    people = _assemble(connections, peak_score.tolist(), cfg)
    people = [p for p in people
              if p.parts >= cfg.min_parts and p.total / p.parts >= cfg.min_mean_score]
    scores = np.array([1.0 - 1.0 / p.total for p in people], dtype=np.float32)
    order = np.argsort(-scores, kind="stable")[: cfg.max_people]
    keypoints = np.zeros((len(order), NUM_KEYPOINTS, 3), dtype=np.float32)
    for row, index in enumerate(order):
        slots = np.array(people[index].slots)
        present = slots >= 0
        keypoints[row, present, :2] = xy[slots[present]]
        keypoints[row, present, 2] = peak_score[slots[present]]
    return keypoints, scores[order]


def to_coco_results(image_id: int, keypoints: np.ndarray, scores: np.ndarray) -> list[dict]:
    """COCO keypoint results of one image: the neck dropped, the 17 others in COCO order.

    A missing keypoint is written as (0, 0, 0); a found one as (x, y, 1).
    """
    results = []
    for person, score in zip(keypoints, scores):
        coco = person[list(COCO_TO_OURS)]
        found = coco[:, 2] > 0
        triples = np.zeros((len(coco), 3), dtype=np.float64)
        triples[found, :2] = coco[found, :2]
        triples[found, 2] = 1.0
        results.append({"image_id": int(image_id), "category_id": 1,
                        "keypoints": [round(float(v), 2) for v in triples.reshape(-1)],
                        "score": float(score)})
    return results
