"""Scores of a list of results against the labelled people: COCO keypoint AP by pycocotools
(iouType='keypoints'), quietly, with the skeleton's sigmas, and PCK, AUC and EPE as mmpose's
PCKAccuracy, AUC and EPE define them (docs/evaluation.md). No results give AP 0; annotations are
renumbered 1, 2, ... in the copy scored (pycocotools reads id 0 as "no match"). `matched_people`
pairs labelled and found people, whose distances (a point the found person lacks: a miss) PCK, AUC
and EPE score; a stat nothing defines is -1, as pycocotools reports such stats.
"""
from __future__ import annotations

import contextlib
import io

import numpy as np

STAT_NAMES = ("AP", "AP50", "AP75", "APm", "APl", "AR")    # COCOeval.stats[:6] for keypoints


def coco_keypoint_stats(gt_dict: dict, results: list[dict], image_ids=None, sigmas=None) -> dict:
    """{AP, AP50, AP75, APm, APl, AR} of `results` against `gt_dict` on `image_ids` (default all;
    images without results are misses), OKS with `sigmas` (default COCO's); undefined stats -1."""
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


AUC_PIXELS, AUC_STEPS = 30.0, 20
RIGHT_PLACE = 0.5          # a keypoint's own OKS term exp(-d^2 / (2 s^2 k^2)) at least this


def matched_people(gt_dict: dict, results: list[dict], sigmas, image_ids=None):
    """(annotation, keypoints [K, 3], the found person's [K, 3] or None) of each labelled person of
    `gt_dict` (not a crowd) in `image_ids`, paired greedily per image by highest OKS."""
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
    """Per keypoint, COCO's OKS term exp(-d^2 / (2 s^2 k^2)) of `guess` against `points` of `ann`."""
    d2 = ((guess[:, :2] - points[:, :2]) ** 2).sum(1)
    area, box = ann.get("area"), ann.get("bbox") or [0, 0, 1, 1]
    scale = float(area) if isinstance(area, (int, float)) and area > 0 else float(max(box[2] * box[3], 1.0))
    return np.exp(-d2 / (2 * (2 * sigmas) ** 2 * (scale + np.spacing(1))))


def keypoint_recall(gt_dict: dict, results: list[dict], sigmas, image_ids=None) -> list[tuple]:
    """Per keypoint: (labelled, recalled: the matched person's OKS term >= RIGHT_PLACE)."""
    sigmas = np.asarray(sigmas, np.float64)
    labelled, recalled = np.zeros(len(sigmas), np.int64), np.zeros(len(sigmas), np.int64)
    for ann, points, guess in matched_people(gt_dict, results, sigmas, image_ids):
        on = points[:, 2] > 0
        labelled += on
        if guess is not None:
            recalled += on & (oks_terms(points, guess, sigmas, ann) >= RIGHT_PLACE)
    return [(int(n), int(r)) for n, r in zip(labelled, recalled)]


def format_recall(names, recall: list[tuple]) -> list[str]:
    """Lines 'name  recalled/labelled  percent', lowest first; never labelled: 'n/a', last."""
    rows = sorted(((r / n if n else 2.0), name, n, r) for name, (n, r) in zip(names, recall))
    width = max((len(name) for _, name, _, _ in rows), default=0)
    return [f"  {name:<{width}}  {r:>6}/{n:<6} " + (f"{100 * share:5.1f}%" if n else "  n/a")
            for share, name, n, r in rows]


def distance_stats(gt_dict: dict, results: list[dict], skeleton, scoring, image_ids=None) -> dict:
    """{PCK, PCK_unnormalised, AUC, EPE, EPE_found} of `results` against `gt_dict`, in the annotations'
    keypoints of `skeleton` (whose sigmas pair the people), PCK as `scoring` (`data.skeleton.Scoring`)
    says."""
    distances, norms = [], []
    names = list(skeleton.dataset_keypoints)
    for ann, points, guess in matched_people(gt_dict, results, skeleton.sigmas, image_ids):
        labelled = points[:, 2] > 0
        row = np.where(labelled, np.inf, np.nan)           # nan: not labelled; inf: not found
        if guess is not None:
            found = labelled & (guess[:, 2] > 0)
            row[found] = np.hypot(*(guess[found, :2] - points[found, :2]).T)
        distances.append(row)
        norms.append(_normaliser(ann, points, scoring.pck_normalize, names))
    distances = np.asarray(distances, np.float64).reshape(-1, len(names))
    norms = np.asarray(norms, np.float64)
    labelled = ~np.isnan(distances)
    normalised = labelled & (norms > 0)[:, None]
    found = labelled & np.isfinite(distances)
    with np.errstate(invalid="ignore", divide="ignore"):
        pck = _mean_share(distances / norms[:, None], normalised, scoring.pck_threshold)
    auc = [_mean_share(distances / AUC_PIXELS, labelled, step / AUC_STEPS) for step in range(AUC_STEPS)]
    return {"PCK": pck, "PCK_unnormalised": int((labelled & ~normalised).sum()),
            "AUC": float(np.mean(auc)) if labelled.any() else -1.0,
            "EPE": float(distances[found].mean()) if found.any() else -1.0,
            "EPE_found": float(found.sum() / labelled.sum()) if labelled.any() else -1.0}


def _mean_share(ratios: np.ndarray, counted: np.ndarray, threshold: float) -> float:
    """The mean over keypoints (columns) with a counted point of the share of those below threshold."""
    per_keypoint = counted.sum(0)
    if not per_keypoint.any():
        return -1.0
    below = (counted & (np.where(counted, ratios, np.inf) < threshold)).sum(0)
    return float(np.mean(below[per_keypoint > 0] / per_keypoint[per_keypoint > 0]))


def _normaliser(ann: dict, points: np.ndarray, normalize, names: list) -> float:
    """The length PCK's threshold is a share of, for this person (0: none)."""
    if normalize == "bbox":
        box = ann.get("bbox") or [0, 0, 0, 0]
        return float(max(box[2], box[3]))
    a, b = (names.index(n) for n in normalize)
    if points[a, 2] > 0 and points[b, 2] > 0:
        return float(np.hypot(*(points[a, :2] - points[b, :2])))
    return 0.0
