"""COCO keypoint AP through our pycocotools wrapper: perfect, empty, restricted and shifted results."""
from __future__ import annotations

import copy
import json

import pytest

from inference.coco_eval import STAT_NAMES, coco_keypoint_stats, format_stats


@pytest.fixture(scope="module")
def ground_truth(coco4_dir) -> dict:
    return json.loads((coco4_dir / "test_coco.json").read_text())


def as_results(gt: dict, shift: float = 0.0, image_ids=None) -> list[dict]:
    """The labelled people of `gt` submitted as predictions (score 1), optionally shifted in x."""
    results = []
    for ann in gt["annotations"]:
        if ann["num_keypoints"] == 0 or (image_ids and ann["image_id"] not in image_ids):
            continue
        keypoints = list(ann["keypoints"])
        for k in range(0, len(keypoints), 3):
            if keypoints[k + 2] > 0:
                keypoints[k] += shift
        results.append({"image_id": ann["image_id"], "category_id": 1, "keypoints": keypoints,
                        "score": 1.0})
    return results


def test_ground_truth_as_predictions_scores_one(ground_truth):
    before = copy.deepcopy(ground_truth)
    results = as_results(ground_truth)
    results_before = copy.deepcopy(results)
    stats = coco_keypoint_stats(ground_truth, results)
    assert set(stats) == set(STAT_NAMES)
    for name in STAT_NAMES:
        assert stats[name] == pytest.approx(1.0), name
    assert ground_truth == before and results == results_before   # inputs left untouched
    assert format_stats(stats).startswith("AP 1.000  AP50 1.000")


def test_no_results_scores_zero_without_crashing(ground_truth):
    assert coco_keypoint_stats(ground_truth, []) == {name: 0.0 for name in STAT_NAMES}


def test_shifted_keypoints_lose_ap(ground_truth):
    stats = coco_keypoint_stats(ground_truth, as_results(ground_truth, shift=12.0))
    assert 0.0 <= stats["AP"] < 0.9


def test_scoring_is_restricted_to_the_evaluated_images(ground_truth):
    results = as_results(ground_truth, image_ids={197388})
    assert coco_keypoint_stats(ground_truth, results, image_ids=[197388])["AP"] == pytest.approx(1.0)
    # Over all four images, the people of the other three are misses.
    assert coco_keypoint_stats(ground_truth, results)["AR"] < 0.6
