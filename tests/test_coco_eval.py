"""Scoring: COCO keypoint AP through our pycocotools wrapper (perfect, empty, restricted and shifted
results; whatever the ids), PCK, AUC and EPE against hand-computed cases, the recall table."""
from __future__ import annotations

import copy
import json

import pytest

from data.skeleton import Scoring, Skeleton
from inference.coco_eval import STAT_NAMES, coco_keypoint_stats, distance_stats, format_recall


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


def _renumber_image(gt: dict, old: int, new) -> None:
    next(img for img in gt["images"] if img["id"] == old)["id"] = new
    for ann in gt["annotations"]:
        if ann["image_id"] == old:
            ann["image_id"] = new


ID_CASES = {   # what pycocotools mishandles (id 0: a match read as none; a repeated id: one person lost)
    "annotation id 0": lambda gt: gt["annotations"][0].update(id=0),
    "negative annotation id": lambda gt: gt["annotations"][0].update(id=-3),
    "non-integer annotation id": lambda gt: gt["annotations"][0].update(id=2.5),
    "repeated annotation id": lambda gt: gt["annotations"][2].update(id=gt["annotations"][1]["id"]),
    "image id 0": lambda gt: _renumber_image(gt, 785, 0),
    "negative image id": lambda gt: _renumber_image(gt, 785, -7),
}


@pytest.mark.parametrize("case", sorted(ID_CASES))
def test_ground_truth_scores_one_whatever_the_ids(ground_truth, case):
    gt = copy.deepcopy(ground_truth)
    ID_CASES[case](gt)
    assert coco_keypoint_stats(gt, as_results(gt))["AP"] == pytest.approx(1.0)


TWO = Skeleton.from_spec({"name": "two", "keypoints": ["a", "b"], "limbs": [["a", "b"]], "sigmas": 0.1},
                         "test")


def _person(ann_id: int, box, a, b) -> dict:
    keypoints = [*a, 2, *b, 2] if b else [*a, 2, 0, 0, 0]
    return {"id": ann_id, "image_id": 1, "category_id": 1, "iscrowd": 0, "bbox": box,
            "area": box[2] * box[3], "keypoints": keypoints, "num_keypoints": 2 if b else 1}


def _found(image_id: int, a, b) -> dict:
    return {"image_id": image_id, "category_id": 1, "score": 1.0, "keypoints": [*a, 1, *b, 1]}


@pytest.fixture
def two_people():
    """Person 1 (box 100 x 50): a found 5 px off, b 30 px off; person 2 (box 40 x 80): a found
    16 px off (exactly 0.2 of 80: not under it, as mmpose counts), b not labelled; person 3: not
    found at all."""
    gt = {"images": [{"id": 1, "file_name": "x.jpg", "width": 500, "height": 500}],
          "categories": [{"id": 1, "name": "two"}],
          "annotations": [_person(1, [0, 0, 100, 50], (10, 10), (50, 10)),
                          _person(2, [200, 0, 40, 80], (210, 10), None),
                          _person(3, [390, 390, 20, 20], (400, 400), None)]}
    results = [_found(1, (13, 14), (50, 40)), _found(1, (226, 10), (230, 60))]
    return gt, results


def test_pck_auc_epe_of_a_hand_computed_case(two_people):
    gt, results = two_people
    stats = distance_stats(gt, results, TWO, Scoring(("pck", "auc", "epe")))
    # PCK@0.2 of the box: a 1 of 3 (5 < 20; 16 < 16 no; missed), b 0 of 1 (30 > 20): mean 1/6.
    assert stats["PCK"] == pytest.approx(1 / 6) and stats["PCK_unnormalised"] == 0
    # AUC: thresholds 1.5 i px (i < 20): a's 5 px counts from 6 px (i >= 4), its 16 px from 16.5 px
    # (i >= 11), b's 30 px never: (7 x 1/3 + 9 x 2/3) / 2 / 20.
    assert stats["AUC"] == pytest.approx((7 / 3 + 9 * 2 / 3) / 2 / 20)
    # EPE over the three points found (5, 30, 16 px); 3 of 4 labelled points found.
    assert stats["EPE"] == pytest.approx(17.0) and stats["EPE_found"] == pytest.approx(0.75)


def test_pck_normalised_by_two_keypoints_leaves_out_people_without_them(two_people):
    gt, results = two_people
    stats = distance_stats(gt, results, TWO, Scoring(("pck",), 0.2, ("a", "b")))
    # Person 1's a-b distance is 40: a (5 < 8) right, b (30) wrong; persons 2 and 3 lack b.
    assert stats["PCK"] == pytest.approx(0.5) and stats["PCK_unnormalised"] == 2


def test_ground_truth_as_predictions_scores_pck_one_and_epe_zero(ground_truth):
    from data.skeleton import builtin

    stats = distance_stats(ground_truth, as_results(ground_truth), builtin("coco"), Scoring(("pck",)))
    assert (stats["PCK"], stats["EPE"], stats["EPE_found"]) == (1.0, 0.0, 1.0)
    assert stats["AUC"] == pytest.approx(0.95)      # its first threshold, 0 px, counts nothing


def test_the_recall_table_says_n_a_for_a_keypoint_never_labelled():
    lines = format_recall(["nose", "tail"], [(4, 3), (0, 0)])
    assert lines[0].split() == ["nose", "3/4", "75.0%"]
    assert lines[1].split() == ["tail", "0/0", "n/a"]
