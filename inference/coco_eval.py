"""COCO keypoint AP of a list of results, scored by pycocotools (iouType='keypoints'), quietly.

The ground truth is a COCO dataset dict (`data.h5format.KeypointH5.coco_ground_truth()`), optionally
restricted to the images evaluated; OKS uses the skeleton's sigmas; no results give AP 0. The
annotations are numbered 1, 2, ... in the copy scored (pycocotools reads an id 0 as "no match"), so
AP does not depend on the file's ids. `matched_people` pairs each labelled person with a found one;
`keypoint_recall` counts, per keypoint, the labelled points in a found person at the right place.
"""
from __future__ import annotations

import contextlib
import io

import numpy as np

STAT_NAMES = ("AP", "AP50", "AP75", "APm", "APl", "AR")
"""The first six entries of COCOeval.stats for keypoints, in order."""


def coco_keypoint_stats(gt_dict: dict, results: list[dict], image_ids=None, sigmas=None) -> dict:
    """{AP, AP50, AP75, APm, APl, AR} of `results` against `gt_dict`, on `image_ids` (default all),
    OKS computed with the per-keypoint `sigmas` (a skeleton's; default: pycocotools' COCO ones).

    Images of `image_ids` without any result count as misses. Stats that COCO cannot define (no
    labelled person at all) are -1, as pycocotools reports them.
    """
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    if image_ids is None:
        image_ids = [img["id"] for img in gt_dict.get("images", [])]
    image_ids = sorted({int(i) for i in image_ids})
    wanted = set(image_ids)
    # pycocotools writes into the dicts it is given (ids, areas, ignore flags): give it copies.
    results = [dict(r) for r in results if int(r["image_id"]) in wanted]
    if not results:
        return {name: 0.0 for name in STAT_NAMES}
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO()
        gt.dataset = dict(gt_dict, annotations=[dict(_complete(a), id=n) for n, a in
                                                enumerate(gt_dict.get("annotations", []), 1)])
        gt.createIndex()
        dt = gt.loadRes(results)
        evaluator = COCOeval(gt, dt, iouType="keypoints")
        evaluator.params.imgIds = image_ids
        if sigmas is not None:
            evaluator.params.kpt_oks_sigmas = np.asarray(sigmas, dtype=np.float64)
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    stats = np.asarray(evaluator.stats, dtype=np.float64)
    return {name: float(stats[k]) for k, name in enumerate(STAT_NAMES)}


def format_stats(stats: dict) -> str:
    """One readable line: 'AP 0.712  AP50 0.880 ...'."""
    return "  ".join(f"{name} {stats[name]:.3f}" for name in STAT_NAMES if name in stats)


def _complete(ann: dict) -> dict:
    """A copy of a ground-truth annotation with the fields COCOeval reads, COCO's meaning when absent."""
    out = dict(ann)
    out.setdefault("iscrowd", 0)
    if "area" not in out and isinstance(out.get("bbox"), list) and len(out["bbox"]) == 4:
        out["area"] = float(out["bbox"][2] * out["bbox"][3])
    if "num_keypoints" not in out and isinstance(out.get("keypoints"), list):
        out["num_keypoints"] = sum(1 for v in out["keypoints"][2::3] if v > 0)
    return out


RIGHT_PLACE = 0.5          # a keypoint's own OKS term exp(-d^2 / (2 s^2 k^2)) at least this


def matched_people(gt_dict: dict, results: list[dict], sigmas, image_ids=None):
    """Each labelled person of `gt_dict` (not a crowd, at least one labelled keypoint, of an image
    in `image_ids`; default all) as (annotation, keypoints [K, 3], the keypoints [K, 3] of the found
    person paired with it, or None). Pairs are taken greedily per image, highest OKS first (the mean
    over its labelled keypoints), each person and each found person once."""
    sigmas = np.asarray(sigmas, np.float64)
    wanted = None if image_ids is None else {int(i) for i in image_ids}
    found: dict = {}
    for r in results:
        found.setdefault(int(r["image_id"]), []).append(np.asarray(r["keypoints"], np.float64).reshape(-1, 3))
    people: dict = {}
    for ann in gt_dict.get("annotations", []):
        if ann.get("iscrowd", 0) or (wanted is not None and int(ann["image_id"]) not in wanted):
            continue
        points = np.asarray(ann.get("keypoints", []), np.float64).reshape(-1, 3)
        if len(points) == len(sigmas) and (points[:, 2] > 0).any():
            people.setdefault(int(ann["image_id"]), []).append((ann, points))
    for image_id, persons in people.items():
        candidates = found.get(image_id, [])
        pairs = sorted(((oks_terms(points, guess, sigmas, ann)[points[:, 2] > 0].mean(), i, j)
                        for i, (ann, points) in enumerate(persons)
                        for j, guess in enumerate(candidates)), reverse=True)
        partner, found_taken = {}, set()
        for oks, i, j in pairs:
            if oks > 0 and i not in partner and j not in found_taken:
                partner[i] = j
                found_taken.add(j)
        for i, (ann, points) in enumerate(persons):
            yield ann, points, (candidates[partner[i]] if i in partner else None)


def oks_terms(points: np.ndarray, guess: np.ndarray, sigmas: np.ndarray, ann: dict) -> np.ndarray:
    """Per keypoint, COCO's OKS term exp(-d^2 / (2 s^2 k^2)) of `guess` against the labelled
    `points` of annotation `ann` (s^2: its area)."""
    d2 = ((guess[:, :2] - points[:, :2]) ** 2).sum(1)
    return np.exp(-d2 / (2 * (2 * sigmas) ** 2 * (_scale(ann) + np.spacing(1))))


def keypoint_recall(gt_dict: dict, results: list[dict], sigmas, image_ids=None) -> list[tuple]:
    """Per keypoint (the annotations' order): (labelled, recalled). A labelled keypoint of a person
    is recalled when the found person `matched_people` pairs with that person has the keypoint
    with an OKS term >= RIGHT_PLACE: within about 2.4 sigma x sqrt(area) of where it is labelled."""
    sigmas = np.asarray(sigmas, np.float64)
    labelled, recalled = np.zeros(len(sigmas), np.int64), np.zeros(len(sigmas), np.int64)
    for ann, points, guess in matched_people(gt_dict, results, sigmas, image_ids):
        on = points[:, 2] > 0
        labelled += on
        if guess is not None:
            recalled += on & (oks_terms(points, guess, sigmas, ann) >= RIGHT_PLACE)
    return [(int(n), int(r)) for n, r in zip(labelled, recalled)]


def _scale(ann: dict) -> float:
    area = ann.get("area")
    if isinstance(area, (int, float)) and area > 0:
        return float(area)
    box = ann.get("bbox") or [0, 0, 1, 1]
    return float(max(box[2] * box[3], 1.0))


def format_recall(names, recall: list[tuple]) -> list[str]:
    """Lines 'name  recalled/labelled  percent', the lowest recall first; 'n/a' for a keypoint
    never labelled (listed last)."""
    rows = sorted(((r / n if n else 2.0), name, n, r) for name, (n, r) in zip(names, recall))
    width = max((len(name) for _, name, _, _ in rows), default=0)
    return [f"  {name:<{width}}  {r:>6}/{n:<6} " + (f"{100 * share:5.1f}%" if n else "  n/a")
            for share, name, n, r in rows]
