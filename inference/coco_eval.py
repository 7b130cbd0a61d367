"""COCO keypoint AP of a list of results, scored by pycocotools (iouType='keypoints'), quietly.

The ground truth is a COCO dataset dict (as `data.h5format.KeypointH5.coco_ground_truth()` gives);
scoring can be restricted to the images that were evaluated; OKS uses the skeleton's sigmas. No
results gives AP 0, not a crash.
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
        gt.dataset = dict(gt_dict, annotations=[dict(a) for a in gt_dict.get("annotations", [])])
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
