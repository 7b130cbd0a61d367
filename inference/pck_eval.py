"""PCK, AUC and EPE of found people against the labelled ones, as mmpose's PCKAccuracy, AUC and EPE
define them, bottom-up: each labelled person is scored against the found person
`inference.coco_eval.matched_people` pairs with it; a point that person lacks is a miss.

- PCK: per keypoint, the share of its labelled points closer than `threshold` x the person's
  normaliser (the box's longer side, or the distance of two labelled keypoints; a person without
  one is counted in `PCK_unnormalised`), then the mean over the keypoints labelled at all.
- AUC: the mean PCK at AUC_STEPS thresholds from 0 to AUC_PIXELS pixels (mmpose: 30, 20).
- EPE: the mean distance in pixels over the points found; `EPE_found` is their share.
A stat nothing defines is -1, as pycocotools reports such stats.
"""
from __future__ import annotations

import numpy as np

from inference.coco_eval import matched_people

AUC_PIXELS, AUC_STEPS = 30.0, 20


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
