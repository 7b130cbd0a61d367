"""A skeleton for a COCO keypoint category: a built-in when its keypoints are one's, else one inferred
from the category's links (1- or 0-based, `--links-from`), joined where they leave parts apart by a
minimum spanning tree over the keypoints' mean distances; every decision is a line of the report."""
from __future__ import annotations

import re
from collections import Counter

import numpy as np

from data.skeleton import (DEFAULT_SIGMA, Skeleton, _fail, builtin, builtin_names, either_way_in, limb_walk,
                           name_flips, unpaired_sided)

MAX_PEOPLE = 2000          # people whose keypoints measure the distances (the file's first ones)
SHOWN = 12                 # names or links listed in one report line
SAME_SKELETON = ("these links depend on this file's people: give the other split this same skeleton "
                 "(--dump-skeleton FILE.yaml here, --skeleton FILE.yaml there)")
_WORDS = {"l": "left", "r": "right", "f": "front", "b": "back"}


def plain_name(name: str) -> str:
    """`name` in one spelling: `L_F_Paw`, `left_front_paw` and `LeftFrontPaw` are `leftfrontpaw`."""
    words = re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+", name)
    return "".join(_WORDS.get(w.lower(), w.lower()) for w in words)


def matching_builtin(names, count: int | None = None) -> Skeleton | None:
    """The built-in whose keypoints are `names` (with `count`: begin with them), spelling aside."""
    wanted = tuple(plain_name(n) for n in names)
    for name in builtin_names():
        known = builtin(name).dataset_keypoints
        if (len(known) == (count or len(names))
                and tuple(plain_name(n) for n in known[:len(names)]) == wanted):
            return builtin(name)
    return None


def listed(items, shown: int = SHOWN) -> str:
    items = list(items)
    more = f", ... ({len(items)} in all)" if len(items) > shown else ""
    return ", ".join(str(i) for i in items[:shown]) + more


def keypoint_names(category: dict, annotations: list, source: str) -> tuple[list, list]:
    """(the category's keypoint names, report lines); without names: a built-in's, or `keypoint_1`..."""
    if names := category.get("keypoints"):
        if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
            _fail(source, f"the {category.get('name')!r} category's keypoints are not a list of names")
        return list(names), []
    lengths = Counter(len(a["keypoints"]) for a in annotations
                      if isinstance(a, dict) and isinstance(a.get("keypoints"), list) and a["keypoints"])
    if not lengths:
        _fail(source, f"the {category.get('name', '?')!r} category has 0 keypoint names and no "
              "annotation has keypoints: not a keypoint annotation file")
    values = lengths.most_common(1)[0][0]
    if values % 3:
        _fail(source, f"the {category.get('name', '?')!r} category has no keypoint names and its "
              f"annotations' keypoints hold {values} values, not (x, y, v) triples")
    count = values // 3
    same = [n for n in builtin_names() if len(builtin(n).dataset_keypoints) == count]
    if len(same) == 1:
        return list(builtin(same[0]).dataset_keypoints), [
            f"the category names no keypoints; its annotations have {count}: those of built-in "
            f"skeleton {same[0]}"]
    which = f" (built-ins with {count}: {', '.join(same)}; give --skeleton NAME)" if same else ""
    return [f"keypoint_{k + 1}" for k in range(count)], [
        f"the category names no keypoints; its annotations have {count}: named keypoint_1 to "
        f"keypoint_{count}{which}"]


def _links(category: dict, count: int, source: str, links_from: int | None) -> tuple[list, list]:
    """The category's links as 0-based pairs, and a line saying how they were counted."""
    links = category.get("skeleton") or []
    if not isinstance(links, list):
        _fail(source, "the category's skeleton is not a list of keypoint pairs")
    flat = []
    for link in links:
        if (not isinstance(link, (list, tuple)) or len(link) != 2
                or not all(isinstance(i, int) and not isinstance(i, bool) for i in link)):
            _fail(source, f"skeleton link {link!r} is not a pair of keypoint numbers")
        flat.extend(link)
    if not flat:
        return [], []
    base = links_from if links_from is not None else 0 if min(flat) == 0 else 1
    why = ("as --links-from says" if links_from is not None else "a link uses keypoint 0" if base == 0
           else f"a link uses keypoint {count}" if max(flat) == count
           else f"COCO's rule; no link uses keypoint 0 or {count}, so either could be meant")
    low, high = base, count - 1 + base
    if (bad := next((link for link in links if not all(low <= i <= high for i in link)), None)) is not None:
        _fail(source, f"skeleton link {list(bad)} is not a pair of keypoint numbers {low}-{high} "
              f"(the category lists {count} keypoints)")
    shifted = [(a - base, b - base) for a, b in links]
    pairs = [(a, b) for k, (a, b) in enumerate(shifted)       # each once, either way round, no loops
             if a != b and not either_way_in((a, b), shifted[:k])]
    return pairs, [f"skeleton links (categories[].skeleton) counted from {base} ({why}); --links-from "
                   f"{1 - base} reads them the other way"]


def _mean_distances(points: np.ndarray) -> np.ndarray:
    """[K, K] mean distance between two keypoints over the people where both are labelled, in units
    of the person's size (the spread of their labelled keypoints); inf where never both."""
    count = points.shape[1]
    total, seen = np.zeros((count, count)), np.zeros((count, count))
    for person in points[:MAX_PEOPLE]:
        on = person[:, 2] > 0
        if on.sum() < 2:
            continue
        xy = person[on, :2]
        size = max(float(np.ptp(xy, axis=0).max()), 1.0)
        total[np.ix_(on, on)] += np.linalg.norm(xy[:, None] - xy[None], axis=-1) / size
        seen[np.ix_(on, on)] += 1
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(seen > 0, total / np.maximum(seen, 1), np.inf)


def _joins(links: list, flip: list, distance: np.ndarray, among) -> list:
    """Links, each with its mirror, that join the keypoints `among` which `links` leave apart: a
    minimum spanning forest over `distance`, nearest first; ends outside `among` join nothing."""
    inside = set(among)
    parent = list(range(len(flip)))

    def root(k):
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    def join(a, b) -> None:
        if a in inside and b in inside:
            parent[root(a)] = root(b)

    for a, b in links:
        join(a, b)
    added = []
    for _, a, b in sorted((distance[a, b], a, b) for a in inside for b in inside if a < b):
        if root(a) != root(b):
            for pair in ((a, b), (flip[a], flip[b])):
                if pair[0] != pair[1] and not either_way_in(pair, links + added):
                    added.append(pair)
                    join(*pair)
    return added


def fit_to_labels(skeleton: Skeleton, points: np.ndarray, source: str) -> tuple[Skeleton, list]:
    """(skeleton, report lines): `skeleton` with links (and mirrors) added, nearest first, where
    the keypoints `points` label reach each other only through keypoints never labelled."""
    if not len(points):
        return skeleton, []
    ours = skeleton.from_annotation(points)
    labelled = np.flatnonzero((ours[..., 2] > 0).any(0))
    usable = [(a, b) for a, b in skeleton.limbs if a in labelled and b in labelled]
    added = _joins(usable, list(skeleton.flip), _mean_distances(ours), labelled)
    added = [p for p in added if not either_way_in(p, skeleton.limbs)]
    if not added:
        return skeleton, []
    names = skeleton.keypoints
    spec = skeleton.to_spec()
    spec["redundant"] = spec["redundant"] + [[names[a], names[b]] for a, b in added]
    never = [names[k] for k in range(len(names)) if k not in labelled]
    keep = (f"; --skeleton {skeleton.name} keeps the built-in as it is"
            if skeleton.name in builtin_names() and skeleton == builtin(skeleton.name) else "")
    return Skeleton.from_spec(spec, source), [
        f"{skeleton.name}'s links join the keypoints this file labels only through keypoints it never "
        f"labels ({listed(never)}): added {listed(f'{names[a]}-{names[b]}' for a, b in added)} "
        f"(nearest in the data){keep}", SAME_SKELETON]


def infer_skeleton(category: dict, names: list, points: np.ndarray, source: str,
                   links_from: int | None = None) -> tuple[Skeleton, list]:
    """(skeleton, report lines) for a category whose keypoints `names` no built-in has."""
    pairs, report = _links(category, len(names), source, links_from)
    flip = name_flips(names)
    mirrors = [m for m in dict.fromkeys((flip[a], flip[b]) for a, b in pairs)
               if m[0] != m[1] and not either_way_in(m, pairs)]
    joins = _joins(pairs + mirrors, flip, _mean_distances(points), range(len(names)))   # inf: no people
    links = pairs + mirrors + joins
    degree = np.bincount(np.array(links, int).reshape(-1), minlength=len(names))
    start = int(np.argmax(degree))
    main = limb_walk(len(names), links, start)
    redundant = [p for p in links if not either_way_in(p, main)]
    spec = {"name": category.get("name") or "custom", "keypoints": list(names),
            "channels": [names[start]] + [n for k, n in enumerate(names) if k != start],
            "limbs": [[names[a], names[b]] for a, b in main],
            "redundant": [[names[a], names[b]] for a, b in redundant],
            "flip": [[names[k], names[f]] for k, f in enumerate(flip) if k < f],
            "sigmas": DEFAULT_SIGMA}
    skeleton = Skeleton.from_spec(spec, source)
    given = f"{len(pairs)} links from the JSON" if pairs else "no links in the JSON"
    report.insert(0, f"{skeleton.describe()} inferred from the JSON ({given}; main limbs: a tree "
                  f"from {names[start]})")
    show = lambda found: listed(f"{names[a]}-{names[b]}" for a, b in found)   # noqa: E731
    if mirrors:
        report.append(f"links added as mirrors of the JSON's: {show(mirrors)}")
    if joins:
        report.append(f"links added to reach every keypoint (nearest in the data): {show(joins)}")
        report.append(SAME_SKELETON)
    pairs_found = [f"{names[k]}/{names[f]}" for k, f in enumerate(flip) if k < f]
    report.append(f"flip pairs: {listed(pairs_found) if pairs_found else 'none found in the names'}")
    if alone := unpaired_sided(names):
        report.append(f"warning: keypoints that name a side have no partner: {listed(alone)} "
                      "(flip augmentation leaves them in place; give flip pairs with --skeleton)")
    report.append(f"OKS sigma {DEFAULT_SIGMA} for every keypoint (none published for these "
                  "keypoints); --dump-skeleton FILE.yaml writes this skeleton to edit")
    return skeleton, report
