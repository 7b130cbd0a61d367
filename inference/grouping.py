"""Bottom-up grouping: keypoint peaks and limb maps at image size -> people with scores.

Steps (../shared/SPEC.md, "Inference and grouping"): peaks by 3x3 NMS with centroid refinement
(`inference.peaks`); for each limb, every candidate pair is scored along its segment at once
(numpy, in cache-sized chunks), pairs are matched greedily (in vectorised rounds, see
`greedy_matching`); people are assembled greedily over the skeleton's limbs in their order (main
links, a tree from its root, then redundant ones; COCO: 30), merging two partial people when the
joining limb is strong enough; weak or tiny people are dropped. Any skeleton works whose limbs
join every keypoint (`data.skeleton` refuses one that does not).
"""
from __future__ import annotations

import math

import numpy as np

from config.schema import InferenceConfig
from data.skeleton import Skeleton
from inference.peaks import find_peaks


PAIR_CHUNK = 4096   # candidate pairs sampled at once (their samples stay in the CPU cache)
PROBE_FROM = 256    # candidate pairs from which a few samples first reject the hopeless ones
ROUNDS_FROM = 64    # candidates from which matching in vectorised rounds beats a Python walk
BLOCK_SLACK = 1 << 16  # cells allowed beyond 4 per candidate in one matching block of all limbs
BRIDGE_HOPS = 3     # partial people are joined across at most this many limbs (2 missing keypoints)


def _samples(limb_maps: np.ndarray, limb, x_a, y_a, x_b, y_b, t: np.ndarray) -> np.ndarray:
    """[N, len(t)] values of limb `limb[n]`'s map at the points (x_a, y_a) + t * (dx, dy) of each
    candidate segment, rounded to the nearest pixel inside the map."""
    _, height, width = limb_maps.shape
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
    samples = _samples(limb_maps, limb, x_a, y_a, x_b, y_b, _sample_steps(cfg.limb_samples))
    score = samples.mean(-1) + np.minimum(0.5 * height / np.maximum(length, 1.0) - 1.0, 0.0)
    above = (samples > cfg.limb_threshold).astype(np.float32)            # counted by a matrix product
    support = above @ np.ones(cfg.limb_samples, np.float32) >= cfg.limb_min_ratio * cfg.limb_samples
    return score, length, support & (score > 0)


def _sample_steps(count: int) -> np.ndarray:
    return np.linspace(0.0, 1.0, count, dtype=np.float32)


def _may_be_supported(limb_maps, limb, x_a, y_a, x_b, y_b, cfg: InferenceConfig) -> np.ndarray:
    """False for the segments that surely fail the support rule: more of a few of their inner
    samples (points that `_score_pairs` samples too; a wrong pair's ends lie on its people's maps,
    its middle does not) are at or under `limb_threshold` than the rule allows of all of them."""
    needed = math.ceil(cfg.limb_min_ratio * cfg.limb_samples)     # samples above, at least
    allowed = cfg.limb_samples - needed                            # samples under, at most
    inner = np.arange(1, cfg.limb_samples - 1)
    probes = inner[np.unique(np.linspace(0, len(inner) - 1, min(len(inner), allowed + 2)).round()
                             .astype(np.intp))]
    if len(probes) <= allowed:
        return np.ones(len(limb), bool)
    samples = _samples(limb_maps, limb, x_a, y_a, x_b, y_b, _sample_steps(cfg.limb_samples)[probes])
    return (samples <= cfg.limb_threshold).sum(-1) <= allowed


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
    sample plus min(0.5 * image_height / max(length, 1) - 1, 0), is positive (two keypoints on the
    same spot, length 0, are a pair too: Halpe's hand roots on the wrists). Per limb, pairs are taken in
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
    x, y = np.ascontiguousarray(xy[:, 0]), np.ascontiguousarray(xy[:, 1])
    if len(limb) > PROBE_FROM:               # most pairs join two people: a few samples reject them
        hopeful = np.flatnonzero(_may_be_supported(limb_maps, limb, x[peak_a], y[peak_a], x[peak_b],
                                                   y[peak_b], cfg))
        limb, local_a, local_b = limb[hopeful], local_a[hopeful], local_b[hopeful]
        peak_a, peak_b = peak_a[hopeful], peak_b[hopeful]
    score = np.empty(len(limb), np.float32)
    length = np.empty(len(limb), np.float32)
    accepted = np.empty(len(limb), bool)
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
    """A partial person during assembly: peak id per keypoint slot, running scores, and per slot
    the longest connection that reaches it."""

    __slots__ = ("slots", "reach", "total", "parts", "weakest", "longest")

    def __init__(self, num_keypoints: int):
        self.slots = [-1] * num_keypoints
        self.reach = [0.0] * num_keypoints
        self.total = 0.0
        self.parts = 0
        self.weakest = float("inf")
        self.longest = 0.0

    def shares_keypoint(self, other: "_Person") -> bool:
        """Whether both hold a keypoint of the same type."""
        return any(x >= 0 and y >= 0 for x, y in zip(self.slots, other.slots))

    def absorb(self, other: "_Person", score: float) -> None:
        """Take `other`'s keypoints (no slot in common), joined by a link of `score`."""
        for slot, peak in enumerate(other.slots):
            if peak >= 0:
                self.slots[slot] = peak
                self.reach[slot] = other.reach[slot]
        self.total += other.total + score
        self.parts += other.parts
        self.weakest = min(self.weakest, other.weakest)
        self.longest = max(self.longest, other.longest)


def _assemble(connections, peak_score, cfg: InferenceConfig, skeleton: Skeleton) -> list[_Person]:
    """Greedy assembly over limbs in order; `connections[l]` holds (peak_a, peak_b, score, length)."""
    people: list[_Person | None] = []
    owner: dict[int, int] = {}

    def add(pid: int, slot: int, peak: int, score: float, length: float) -> None:
        person = people[pid]
        person.slots[slot] = peak
        person.reach[slot] = max(person.reach[slot], length)
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
                person.reach[slot_a] = length
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
                    other = slot_a if pb is None else slot_b
                    person.reach[other] = max(person.reach[other], length)
            elif pa != pb:
                first, second = people[pa], people[pb]
                clash = first.shares_keypoint(second)
                weakest = min(first.weakest, second.weakest)
                longest = max(first.longest, second.longest)
                if clash or score < cfg.merge_ratio * weakest or length > cfg.max_limb_ratio * longest:
                    continue
                first.absorb(second, score)
                first.weakest = min(first.weakest, score)
                first.longest = max(first.longest, length)
                first.reach[slot_a] = max(first.reach[slot_a], length)
                first.reach[slot_b] = max(first.reach[slot_b], length)
                for peak in second.slots:
                    if peak >= 0:
                        owner[peak] = pa
                people[pb] = None
    return [p for p in people if p is not None]


_HOPS: dict = {}


def limb_hops(skeleton: Skeleton) -> np.ndarray:
    """[K, K] int: the fewest limbs joining two keypoints of `skeleton` (breadth-first)."""
    key = (skeleton.num_keypoints, skeleton.limbs)
    if key not in _HOPS:
        k = skeleton.num_keypoints
        adjacent = np.zeros((k, k), bool)
        ends = np.array(skeleton.limbs)
        adjacent[ends[:, 0], ends[:, 1]] = adjacent[ends[:, 1], ends[:, 0]] = True
        hops = np.where(adjacent, 1, k + 1)
        np.fill_diagonal(hops, 0)
        reached = adjacent | np.eye(k, dtype=bool)
        step = reached.copy()
        for distance in range(2, k):
            step = (step.astype(np.uint8) @ adjacent.astype(np.uint8)) > 0
            new = step & ~reached
            if not new.any():
                break
            hops[new] = distance
            reached |= new
        _HOPS[key] = hops
    return _HOPS[key]


def _bridge(people: list[_Person], xy: np.ndarray, hops: np.ndarray, ratio: float) -> list[_Person]:
    """Join partial people that only keypoints missing from both could link (a chain broken where
    a keypoint was not found): two people with no keypoint in common are joined when, between
    their closest keypoints in the skeleton (h >= 2 limbs apart), the image distance is at most
    `ratio` x h x the longest connection reaching either end, for h up to BRIDGE_HOPS. Pairs are
    joined closest first (distance over h x that length); a pair whose people, as joined so far,
    now share a keypoint is skipped."""
    if ratio <= 0 or len(people) < 2:
        return people
    slots = np.array([p.slots for p in people])
    present = slots >= 0
    reach = np.array([p.reach for p in people], np.float32)
    clash = (present.astype(np.uint8) @ present.T.astype(np.uint8)) > 0
    candidates = []
    for i, j in zip(*np.nonzero(np.triu(~clash, 1))):
        mine, theirs = np.flatnonzero(present[i]), np.flatnonzero(present[j])
        apart = hops[np.ix_(mine, theirs)]
        closest = apart.min()
        if not 2 <= closest <= BRIDGE_HOPS:
            continue
        a, b = np.nonzero(apart == closest)
        ka, kb = mine[a], theirs[b]
        gap = np.hypot(*(xy[slots[i, ka]] - xy[slots[j, kb]]).T)
        scale = np.maximum(reach[i, ka], reach[j, kb]) * closest
        relative = gap / np.maximum(scale, 1.0)
        best = relative.min()
        if best <= ratio:
            candidates.append((float(best), int(i), int(j)))
    if not candidates:
        return people
    group = list(range(len(people)))

    def root(n: int) -> int:
        while group[n] != n:
            n = group[n]
        return n
    for _, i, j in sorted(candidates):
        ri, rj = root(i), root(j)
        if ri == rj or people[ri].shares_keypoint(people[rj]):
            continue
        people[ri].absorb(people[rj], 0.0)
        group[rj] = ri
    return [p for n, p in enumerate(people) if group[n] == n]


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
    people = _bridge(people, xy, limb_hops(skeleton), cfg.bridge_ratio)
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
