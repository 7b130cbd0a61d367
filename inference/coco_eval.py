"""Scores of results against the labelled people: COCO keypoint AP by pycocotools with the skeleton's sigmas
and `Scoring` (docs/evaluation.md), and PCK, AUC and EPE as mmpose defines them; a stat nothing defines is
None. Annotations are renumbered 1, 2, ... in the copy scored (pycocotools reads id 0 as "no match")."""
from __future__ import annotations

import contextlib
import io
import json
from collections import Counter
from pathlib import Path

import numpy as np

from common.errors import DataError, os_reason
from data.coco_checks import is_number
from data.skeleton import Scoring

STAT_NAMES = ("AP", "AP50", "AP75", "APm", "APl", "AR")    # COCOeval.stats[:6] for keypoints
CROWD_NAMES = ("AR50", "AR75", "AP_easy", "AP_medium", "AP_hard")   # oks_stats crowd adds these
BOX_AREA = 0.53            # oks_area box: OKS's area is 0.53 x the box's width x height
CROWD_SPLITS = (0.2, 0.8)  # crowdIndex below the first: easy; below the second: medium; else hard


def coco_keypoint_stats(gt_dict: dict, results: list[dict], image_ids=None, sigmas=None,
                        scoring: Scoring = Scoring()) -> dict:
    """{STAT_NAMES (and CROWD_NAMES for oks_stats crowd)} of `results` on `image_ids` (default all;
    images without results are misses), OKS with `sigmas` (default COCO's)."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    if image_ids is None:
        image_ids = [img["id"] for img in gt_dict.get("images", [])]
    image_ids = sorted({int(i) for i in image_ids})
    wanted = set(image_ids)
    if not wanted:
        return {name: None for name in STAT_NAMES + (CROWD_NAMES if scoring.oks_stats == "crowd" else ())}
    annotations = [_scored(a, n, scoring) for n, a in enumerate(gt_dict.get("annotations", []), 1)]
    seen: dict = {}
    for ann in annotations:
        seen.setdefault(ann["image_id"], Counter())[ann["category_id"]] += 1
    categories = sorted({a["category_id"] for a in annotations}) or [1]
    # pycocotools writes into the dicts it is given (ids, areas, ignore flags): give it copies.
    results = [dict(r, category_id=_category(r, seen.get(int(r["image_id"])), categories, scoring))
               for r in results if int(r["image_id"]) in wanted]
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO()
        gt.dataset = dict(gt_dict, annotations=annotations,
                          categories=[{"id": c, "name": str(c)} for c in categories])
        gt.createIndex()
        dt = gt.loadRes(results) if results else COCO()
        evaluator = COCOeval(gt, dt, iouType="keypoints")
        evaluator.params.imgIds = image_ids
        if sigmas is not None:
            evaluator.params.kpt_oks_sigmas = np.asarray(sigmas, dtype=np.float64)
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
        stats = {name: _defined(evaluator.stats[k]) for k, name in enumerate(STAT_NAMES)}
        if scoring.oks_stats == "crowd":
            stats.update(AR50=_defined(evaluator.stats[6]), AR75=_defined(evaluator.stats[7]))
            crowd = {int(img["id"]): img.get("crowdIndex") for img in gt_dict.get("images", [])}
            levels = {image: int(np.searchsorted(CROWD_SPLITS, crowd[image], side="right"))
                      for image in image_ids if isinstance(crowd.get(image), (int, float))}
            for level, name in enumerate(CROWD_NAMES[2:]):          # easy, medium, hard
                chosen = [image for image in image_ids if levels.get(image) == level]
                stats[name] = _subset_ap(evaluator, chosen)
    return stats


def _scored(ann: dict, number: int, scoring: Scoring) -> dict:
    """A renumbered copy of a labelled person with the fields COCOeval reads, as `scoring` scores it."""
    out = dict(ann, id=number)
    out.setdefault("iscrowd", 0)
    box = out.get("bbox")
    box = float(box[2] * box[3]) if isinstance(box, list) and len(box) == 4 else None
    out.setdefault("area", box)
    if scoring.oks_area == "box" and box is not None:
        out["area"] = BOX_AREA * box
    if out["area"] is None:
        del out["area"]
    if "num_keypoints" not in out and isinstance(out.get("keypoints"), list):
        out["num_keypoints"] = sum(1 for v in out["keypoints"][2::3] if v > 0)
    out["category_id"] = int(out.get("source_category_id", out.get("category_id", 1))
                             if scoring.per_category else 1)
    return out


def _category(result: dict, in_image: Counter | None, categories: list, scoring: Scoring) -> int:
    """A result's category: its picture's (that of most of its people), or its own where the picture
    holds people of several and it names one of them."""
    if not scoring.per_category:
        return 1
    own = result.get("category_id")
    if in_image and (len(in_image) == 1 or own not in in_image):
        return in_image.most_common(1)[0][0]
    return own if own in categories else categories[0]


def _defined(value) -> float | None:
    return None if value < 0 else float(value)      # pycocotools' -1: nothing to score


def _subset_ap(evaluator, image_ids: list) -> float | None:
    """The evaluator's AP over `image_ids` alone, as CrowdPose's: the mean of its precisions."""
    if not image_ids:
        return None
    evaluator.params.imgIds = image_ids
    evaluator.evaluate()
    evaluator.accumulate()
    precision = evaluator.eval["precision"][:, :, :, 0, -1]
    return float(np.mean(precision[precision > -1])) if (precision > -1).any() else None


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
    """{PCK, PCK_unnormalised, AUC, EPE, EPE_found} of `results`, people paired by `skeleton`'s sigmas."""
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
            "AUC": float(np.mean(auc)) if labelled.any() else None,
            "EPE": float(distances[found].mean()) if found.any() else None,
            "EPE_found": float(found.sum() / labelled.sum()) if labelled.any() else None}


def _mean_share(ratios: np.ndarray, counted: np.ndarray, threshold: float) -> float | None:
    """The mean over keypoints (columns) with a counted point of the share of those below threshold."""
    per_keypoint = counted.sum(0)
    if not per_keypoint.any():
        return None
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


def read_results(path, image_ids, names) -> dict:
    """{image id: COCO keypoint results} of a COCO results JSON or evaluate.py's .jsonl; a `DataError`
    names the file and its first record not of the split's `image_ids` and keypoint `names`."""
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"--results {path}: cannot read it ({os_reason(exc)})") from None
    lines = path.suffix == ".jsonl"
    try:
        records = ([json.loads(line) for line in text.splitlines() if line.strip()] if lines
                   else json.loads(text))
    except ValueError as exc:
        raise DataError(f"--results {path}: not {'JSON lines' if lines else 'JSON'} ({exc})") from None
    if not isinstance(records, list):
        raise DataError(f"--results {path}: a COCO keypoint results file is a JSON list of results")
    found: dict = {}
    for n, record in enumerate(records, 1):
        try:
            image_id, people = _record(record, lines, names, image_ids)
        except ValueError as exc:
            raise DataError(f"--results {path}: {'line' if lines else 'result'} {n}: {exc}") from None
        found.setdefault(image_id, []).extend(people)
    return found


def _record(record, lines: bool, names, image_ids) -> tuple:
    """(image id, its COCO results) of one record; a ValueError says what is wrong."""
    image_id = record.get("image_id") if isinstance(record, dict) else None
    if isinstance(image_id, bool) or not isinstance(image_id, int):
        raise ValueError("is not an object with an integer image_id")
    if image_id not in image_ids:
        raise ValueError(f"image_id {image_id} is not an image of the split")
    people = record.get("people") if lines else [record]
    if not isinstance(people, list):
        raise ValueError(f"image_id {image_id}: people is not a list")
    out = []
    for person in people:
        if not isinstance(person, dict) or not is_number(person.get("score")):
            raise ValueError(f"image_id {image_id}: a person without a finite score")
        points = person.get("keypoints")
        if lines:
            if not isinstance(points, dict) or not all(isinstance(p, list) and len(p) in (2, 3)
                                                       for p in points.values()):
                raise ValueError(f"image_id {image_id}: keypoints is not {{name: [x, y, score], ...}}")
            unknown = sorted(set(points) - set(names))
            if unknown:
                raise ValueError(f"image_id {image_id}: keypoint {unknown[0]!r} is not one of the split's")
            points = [v for name in names for v in ((*points[name][:2], 1) if name in points else (0, 0, 0))]
        if not isinstance(points, list) or len(points) != 3 * len(names) or not all(map(is_number, points)):
            count = len(points) if isinstance(points, (list, dict)) else "no"
            raise ValueError(f"image_id {image_id}: keypoints has {count} values, not {3 * len(names)} "
                             f"finite numbers (x, y, v of the split's {len(names)} keypoints)")
        out.append({"image_id": image_id, "category_id": record.get("category_id"),
                    "keypoints": [float(v) for v in points], "score": float(person["score"])})
    return image_id, out
