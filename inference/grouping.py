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


def score_limb(limb_map: np.ndarray, xy_a, score_a, xy_b, score_b, cfg: InferenceConfig):
    """Candidate connections of one limb, matched greedily: list of (index_a, index_b, score, length).

    Each pair is sampled at `cfg.limb_samples` points on its segment; it is kept when at least
    `limb_min_ratio` of the samples exceed `limb_threshold` and its score, the mean sample plus
    min(0.5 * image_height / length - 1, 0), is positive. Pairs are taken in decreasing order of
    0.5 * score + 0.25 * (peak_a + peak_b), each peak at most once.
    """
    height, width = limb_map.shape
    delta = xy_b[None, :, :] - xy_a[:, None, :]                      # [na, nb, 2]
    length = np.sqrt((delta ** 2).sum(-1))
    t = np.linspace(0.0, 1.0, cfg.limb_samples, dtype=np.float32)
    points = xy_a[:, None, None, :] + t[None, None, :, None] * delta[:, :, None, :]
    cols = np.clip(np.rint(points[..., 0]).astype(np.int64), 0, width - 1)
    rows = np.clip(np.rint(points[..., 1]).astype(np.int64), 0, height - 1)
    samples = limb_map.reshape(-1)[rows * width + cols]               # [na, nb, S]
    safe_length = np.maximum(length, 1e-6)
    score = samples.mean(-1) + np.minimum(0.5 * height / safe_length - 1.0, 0.0)
    support = (samples > cfg.limb_threshold).sum(-1) >= cfg.limb_min_ratio * cfg.limb_samples
    ok = support & (score > 0) & (length >= 1e-6)
    ia, ib = np.nonzero(ok)
    if len(ia) == 0:
        return []
    rank = 0.5 * score[ia, ib] + 0.25 * (score_a[ia] + score_b[ib])
    used_a, used_b, out = set(), set(), []
    for k in np.argsort(-rank, kind="stable"):
        a, b = int(ia[k]), int(ib[k])
        if a in used_a or b in used_b:
            continue
        used_a.add(a)
        used_b.add(b)
        out.append((a, b, float(score[a, b]), float(length[a, b])))
        if len(used_a) == len(xy_a) or len(used_b) == len(xy_b):
            break
    return out


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
    channel, xy, peak_score = find_peaks(maps[KEYPOINT_CHANNELS], cfg.peak_threshold, cfg.refine_radius)
    bounds = np.searchsorted(channel, np.arange(NUM_KEYPOINTS + 1))
    limb_maps = maps[LIMB_CHANNELS]
    connections = []
    for limb, (a, b) in enumerate(LIMBS):
        sa, sb = slice(bounds[a], bounds[a + 1]), slice(bounds[b], bounds[b + 1])
        if sa.start == sa.stop or sb.start == sb.stop:
            connections.append([])
            continue
        found = score_limb(limb_maps[limb], xy[sa], peak_score[sa], xy[sb], peak_score[sb], cfg)
        connections.append([(sa.start + i, sb.start + j, s, n) for i, j, s, n in found])
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
