"""Bottom-up grouping: keypoint peaks and limb maps at image size -> people with scores.

Steps (../shared/SPEC.md, "Inference and grouping"): peaks by 3x3 NMS with centroid refinement
(`inference.peaks`); for each limb, every candidate pair is scored along its segment at once
(numpy, in cache-sized chunks), pairs are matched greedily (in vectorised rounds, see
`greedy_matching`); people are assembled greedily over the skeleton's limbs in their order (main
links, a tree from its root, then redundant ones; COCO: 30), merging two partial people when the
joining limb is strong enough; weak or tiny people are dropped. Any skeleton works whose limbs
join every keypoint (`config.skeleton` refuses one that does not).
"""
from __future__ import annotations

import numpy as np

from config.schema import InferenceConfig
from config.skeleton import Skeleton
from inference.peaks import find_peaks


PAIR_CHUNK = 4096   # candidate pairs sampled at once (their samples stay in the CPU cache)
ROUNDS_FROM = 64    # candidates from which matching in vectorised rounds beats a Python walk
BLOCK_SLACK = 1 << 16  # cells allowed beyond 4 per candidate in one matching block of all limbs


def _score_pairs(limb_maps: np.ndarray, limb, x_a, y_a, x_b, y_b, cfg: InferenceConfig):
    """(score, length, accepted) of candidate segments (x_a, y_a) -> (x_b, y_b) on their limbs' maps."""
    _, height, width = limb_maps.shape
    dx, dy = x_b - x_a, y_b - y_a
    length = np.sqrt(dx * dx + dy * dy)
    t = np.linspace(0.0, 1.0, cfg.limb_samples, dtype=np.float32)
    columns, rows = t * dx[:, None], t * dy[:, None]                      # [N, S] sample points
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
    samples = limb_maps.reshape(-1).take(index, mode="clip")           # (indices all inside)
    score = samples.mean(-1) + np.minimum(0.5 * height / np.maximum(length, 1e-6) - 1.0, 0.0)
    above = (samples > cfg.limb_threshold).astype(np.float32)            # counted by a matrix product
    support = above @ np.ones(cfg.limb_samples, np.float32) >= cfg.limb_min_ratio * cfg.limb_samples
    return score, length, support & (score > 0) & (length >= 1e-6)


def greedy_matching(limb, row, column, rank, shape) -> np.ndarray:
    """Which candidates a greedy matcher takes, per limb: positions into the candidate arrays.

    Candidate k is cell (limb[k], row[k], column[k]) of a [limbs, rows, columns] `shape`, listed
    by limb then row-major. Per limb, the greedy matcher walks its candidates by decreasing `rank`
    (ties: the earlier candidate first) and takes one whose row and column are both still free.
    With many candidates it runs in rounds instead: every candidate that comes first in both its
    row and its column among those still free is taken at once (the greedy matcher takes it too:
    nothing before it can block it), then its row and column are closed. Returns the positions by
    limb, each limb's in the order the greedy matcher takes them.
    """
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
    """Per limb of `limbs` ((a, b) keypoint pairs), its connections matched greedily:
    [(peak_a, peak_b, score, length), ...].

    `bounds[k]:bounds[k + 1]` are the peaks of keypoint k in `xy` / `peak_score`. Every candidate
    pair of every limb is sampled at `cfg.limb_samples` points on its segment; a pair is kept when
    at least `limb_min_ratio` of its samples exceed `limb_threshold` and its score, the mean
    sample plus min(0.5 * image_height / length - 1, 0), is positive. Per limb, pairs are taken in
    decreasing order of 0.5 * score + 0.25 * (peak_a + peak_b), each peak at most once.
    """
    ends = np.asarray(limbs)
    start_a, start_b = bounds[ends[:, 0]], bounds[ends[:, 1]]
    count_a, count_b = bounds[ends[:, 0] + 1] - start_a, bounds[ends[:, 1] + 1] - start_b
    connections: list[list[tuple]] = [[] for _ in limbs]
    if (count_a * count_b).sum() == 0:
        return connections
    # Candidate pairs as cells (limb, a, b) of a [limbs, most a, most b] block, row-major.
    pairs = count_a * count_b
    limb = np.repeat(np.arange(len(limbs)), pairs)
    local_a, local_b = np.divmod(np.arange(pairs.sum()) - np.repeat(np.cumsum(pairs) - pairs, pairs),
                                 count_b[limb])
    shape = (len(limbs), count_a.max(), count_b.max())
    peak_a, peak_b = start_a[limb] + local_a, start_b[limb] + local_b
    score = np.empty(len(limb), np.float32)
    length = np.empty(len(limb), np.float32)
    accepted = np.empty(len(limb), bool)
    x, y = np.ascontiguousarray(xy[:, 0]), np.ascontiguousarray(xy[:, 1])
    for lo in range(0, len(limb), PAIR_CHUNK):
        part = slice(lo, lo + PAIR_CHUNK)
        a, b = peak_a[part], peak_b[part]
        score[part], length[part], accepted[part] = _score_pairs(
            limb_maps, limb[part], x[a], y[a], x[b], y[b], cfg)
    keep = np.flatnonzero(accepted)
    rank = 0.5 * score[keep] + 0.25 * (peak_score[peak_a[keep]] + peak_score[peak_b[keep]])
    chosen = keep[greedy_matching(limb[keep], local_a[keep], local_b[keep], rank, shape)]
    for l, a, b, s, n in zip(limb[chosen].tolist(), peak_a[chosen].tolist(), peak_b[chosen].tolist(),
                             score[chosen].tolist(), length[chosen].tolist()):
        connections[l].append((a, b, s, n))
    return connections


class _Person:
    """A partial person during assembly: peak id per keypoint slot, running scores."""

    __slots__ = ("slots", "total", "parts", "weakest", "longest")

    def __init__(self, num_keypoints: int):
        self.slots = [-1] * num_keypoints
        self.total = 0.0
        self.parts = 0
        self.weakest = float("inf")
        self.longest = 0.0


def _assemble(connections, peak_score, cfg: InferenceConfig, skeleton: Skeleton) -> list[_Person]:
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

    for (slot_a, slot_b), found in zip(skeleton.limbs, connections):
        for peak_a, peak_b, score, length in found:
            pa, pb = owner.get(peak_a), owner.get(peak_b)
            if pa is None and pb is None:
                person = _Person(skeleton.num_keypoints)
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


def group_people(maps, cfg: InferenceConfig, skeleton: Skeleton):
    """People in `maps` [C, H, W] (image size, the channels of `skeleton`): (keypoints float32
    [P, K, 3], scores float32 [P]).

    keypoints hold (x, y, peak score) in image pixels, score 0 for a missing keypoint; people are
    sorted by decreasing score = 1 - 1 / total, at most `cfg.max_people`.
    """
    maps = np.asarray(maps.detach().cpu() if hasattr(maps, "detach") else maps, dtype=np.float32)
    if maps.shape[0] != skeleton.num_channels:
        raise ValueError(f"{maps.shape[0]} maps but skeleton {skeleton.name} has "
                         f"{skeleton.num_channels} channels")
    channel, xy, peak_score = find_peaks(maps[skeleton.keypoint_channels], cfg.peak_threshold,
                                         cfg.refine_radius, cfg.max_peaks)
    bounds = np.searchsorted(channel, np.arange(skeleton.num_keypoints + 1))
    connections = limb_connections(maps[skeleton.limb_channels], bounds, xy, peak_score, cfg,
                                   skeleton.limbs)
    people = _assemble(connections, peak_score.tolist(), cfg, skeleton)
    people = [p for p in people
              if p.parts >= cfg.min_parts and p.total / p.parts >= cfg.min_mean_score]
    scores = np.array([1.0 - 1.0 / p.total for p in people], dtype=np.float32)
    order = np.argsort(-scores, kind="stable")[: cfg.max_people]
    keypoints = np.zeros((len(order), skeleton.num_keypoints, 3), dtype=np.float32)
    for row, index in enumerate(order):
        slots = np.array(people[index].slots)
        present = slots >= 0
        keypoints[row, present, :2] = xy[slots[present]]
        keypoints[row, present, 2] = peak_score[slots[present]]
    return keypoints, scores[order]


def to_coco_results(image_id: int, keypoints: np.ndarray, scores: np.ndarray, skeleton: Skeleton,
                    category_id: int = 1) -> list[dict]:
    """COCO keypoint results of one image: the skeleton's derived keypoints (COCO's neck) dropped,
    the others in the annotations' order.

    A missing keypoint is written as (0, 0, 0); a found one as (x, y, 1).
    """
    results = []
    for person, score in zip(keypoints, scores):
        coco = skeleton.to_dataset_order(person)
        found = coco[:, 2] > 0
        triples = np.zeros((len(coco), 3), dtype=np.float64)
        triples[found, :2] = coco[found, :2]
        triples[found, 2] = 1.0
        results.append({"image_id": int(image_id), "category_id": int(category_id),
                        "keypoints": [round(float(v), 2) for v in triples.reshape(-1)],
                        "score": float(score)})
    return results
