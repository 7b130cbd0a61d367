"""Each built-in skeleton scored as its dataset's authors score it: the area rule (OKS with 0.53 x box
w x h), per-category AP, CrowdPose's statistics, sigmas; against hand-computed cases and against
an independent evaluator (faster-coco-eval, and pycocotools' COCOeval configured by hand), on
ground truth and perturbed predictions with several people per picture and unlabelled keypoints."""
from __future__ import annotations

import contextlib
import copy
import io
import json
import math

import numpy as np
import pytest

from common.errors import ConfigError
from data.skeleton import Skeleton, builtin, builtin_names
from inference.coco_eval import coco_keypoint_stats, distance_stats

THRESHOLDS = np.linspace(0.5, 0.95, 10)
CROWD = {"AP": 0, "AP50": 1, "AP75": 2, "AR": 3, "AR50": 4, "AR75": 5, "AP_easy": 6, "AP_medium": 7,
         "AP_hard": 8}
COMMON = {"AP": 0, "AP50": 1, "AP75": 2, "APm": 3, "APl": 4, "AR": 5}


def scene(count: int, seed: int, species: int = 1, shift: float = 1.0):
    """(ground truth, predictions): 6 pictures of 3 people each (one without a labelled keypoint, a
    quarter of the keypoints unlabelled, v 1 and 2), boxes of every area range, crowdIndex on every
    side of the cuts, `species` categories; predictions: perturbed people (scaled by `shift`, 0: the
    ground truth), a few missed, one false person per picture."""
    rng = np.random.default_rng(seed)
    images, anns, results = [], [], []
    for i in range(6):
        image_id, category = 10 + i, 1 + i % species
        images.append({"id": image_id, "file_name": f"{i}.jpg", "width": 900, "height": 600,
                       "crowdIndex": [0.05, 0.15, 0.5, 0.9, 0.2, 0.85][i]})
        for p in range(3):
            w, h = rng.uniform(30, 200), rng.uniform(40, 300)
            x0, y0 = 10 + 280 * p, rng.uniform(0, 250)
            v = rng.choice([0, 1, 2], count, p=[0.3, 0.2, 0.5])
            v[0] = 2
            if (i, p) == (1, 2):
                v[:] = 0
            points = np.stack([x0 + rng.uniform(0, w, count), y0 + rng.uniform(0, h, count), v], 1)
            points[v == 0, :2] = 0
            anns.append({"id": len(anns) + 1, "image_id": image_id, "category_id": category, "iscrowd": 0,
                         "bbox": [x0, y0, w, h], "area": float(w * h * rng.uniform(0.4, 0.9)),
                         "keypoints": points.ravel().tolist(), "num_keypoints": int((v > 0).sum())})
            if v.any() and rng.uniform() < 0.9:
                guess = points.copy()
                guess[:, :2] += shift * rng.normal(0, rng.uniform(1, 12), (count, 2))
                guess[:, 2] = 1
                results.append({"image_id": image_id, "category_id": category, "score": rng.uniform(0.1, 1),
                                "keypoints": guess.ravel().tolist()})
        stray = np.stack([rng.uniform(0, 900, count), rng.uniform(0, 600, count), np.ones(count)], 1)
        results.append({"image_id": image_id, "category_id": category, "score": rng.uniform(0, 0.5),
                        "keypoints": stray.ravel().tolist()})
    categories = [{"id": c, "name": f"species {c}"} for c in range(1, species + 1)]
    return {"images": images, "annotations": anns, "categories": categories}, results


def library_stats(gt: dict, results: list, skeleton, tmp_path) -> dict:
    """faster-coco-eval's stats with the dataset's sigmas, area rule and statistics (its crowd AP
    per difficulty is rounded to 4 decimals, as xtcocotools rounds it)."""
    from faster_coco_eval import COCO, COCOeval_faster

    scoring = skeleton.scoring
    path = tmp_path / "gt.json"
    path.write_text(json.dumps(gt))
    truth = COCO(str(path))
    evaluator = COCOeval_faster(truth, truth.loadRes(copy.deepcopy(results)),
                                iouType="keypoints_crowd" if scoring.oks_stats == "crowd" else "keypoints",
                                kpt_oks_sigmas=list(skeleton.sigmas), use_area=scoring.oks_area == "area",
                                print_function=lambda *args: None)
    evaluator.evaluate()
    evaluator.accumulate()
    evaluator.summarize()
    names = CROWD if scoring.oks_stats == "crowd" else COMMON
    return {name: float(evaluator.stats[k]) for name, k in names.items()}


def cocoeval_stats(gt: dict, results: list, sigmas, box_area: bool, image_ids=None) -> dict:
    """pycocotools' COCOeval configured by hand: the sigmas, areas 0.53 x w x h for the box rule
    (xtcocotools' use_area=False, ranges too); AP over `image_ids` as CrowdPose's mean precision."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    gt = copy.deepcopy(gt)
    for ann in gt["annotations"]:
        if box_area:
            ann["area"] = ann["bbox"][2] * ann["bbox"][3] * 0.53
    with contextlib.redirect_stdout(io.StringIO()):
        truth = COCO()
        truth.dataset = gt
        truth.createIndex()
        evaluator = COCOeval(truth, truth.loadRes(copy.deepcopy(results)), "keypoints")
        evaluator.params.kpt_oks_sigmas = np.asarray(sigmas)
        if image_ids is not None:
            evaluator.params.imgIds = image_ids
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    stats = dict(zip(["AP", "AP50", "AP75", "APm", "APl", "AR", "AR50", "AR75"], evaluator.stats[:8]))
    return dict(stats, mean_precision=float(np.mean(evaluator.eval["precision"][:, :, :, 0, :])))


def none_as_minus_one(stats: dict) -> dict:
    return {k: -1.0 if v is None else v for k, v in stats.items()}


@pytest.mark.parametrize("name", builtin_names())
@pytest.mark.parametrize("shift", [0.0, 1.0])
def test_every_builtin_scores_as_the_authors_evaluator(name, shift, tmp_path):
    """Our AP equals faster-coco-eval's and COCOeval's configured with the dataset's settings to
    1e-9 (faster-coco-eval's per-difficulty APs are rounded to 4 decimals; its area ranges under
    use_area=False are the annotation's, where xtcocotools, mmpose's, takes 0.53 x w x h: those
    two against COCOeval configured as xtcocotools)."""
    skeleton = builtin(name)
    scoring = skeleton.scoring
    gt, results = scene(len(skeleton.dataset_keypoints), seed=len(name), shift=shift,
                        species=3 if scoring.per_category else 1)
    before = copy.deepcopy((gt, results))
    ours = none_as_minus_one(coco_keypoint_stats(gt, results, sigmas=skeleton.sigmas, scoring=scoring))
    assert (gt, results) == before
    library = library_stats(gt, results, skeleton, tmp_path)
    box = scoring.oks_area == "box"
    for stat, value in library.items():
        if stat.startswith("AP_"):
            assert ours[stat] == pytest.approx(value, abs=5e-5), stat
        elif not (box and stat in ("APm", "APl")):
            assert ours[stat] == pytest.approx(value, abs=1e-9), stat
    if not scoring.per_category:
        by_hand = cocoeval_stats(gt, results, skeleton.sigmas, box)
        for stat in ("AP", "AP50", "AP75", "APm", "APl", "AR"):
            assert ours[stat] == pytest.approx(by_hand[stat], abs=1e-9), stat
    if scoring.oks_stats == "crowd":
        cuts = {"AP_easy": [10, 11], "AP_medium": [12, 14], "AP_hard": [13, 15]}    # crowdIndex < .2, < .8
        for stat, image_ids in cuts.items():
            by_hand = cocoeval_stats(gt, results, skeleton.sigmas, box, image_ids)["mean_precision"]
            assert ours[stat] == pytest.approx(by_hand, abs=1e-9), stat
    if shift == 0.0:            # ground truth, less the people left out: every one found is right
        assert ours["AP"] > 0.7


def test_the_builtins_name_their_authors_settings():
    assert [n for n in builtin_names() if builtin(n).scoring.oks_area == "box"] == ["aic", "crowdpose", "mhp"]
    assert [n for n in builtin_names() if builtin(n).scoring.per_category] == ["ap10k"]
    assert [n for n in builtin_names() if builtin(n).scoring.oks_stats == "crowd"] == ["crowdpose"]
    assert builtin("ap10k").sigmas[:3] == (0.025, 0.025, 0.026) and builtin("mhp").sigmas[12] == 0.179
    assert builtin("animalpose").sigmas[5:8] == (0.1, 0.1, 0.1)
    assert not any(builtin(n).stand_in_sigmas for n in ("ap10k", "animalpose", "mhp"))
    horse = builtin("horse10").scoring
    assert (horse.pck_threshold, horse.pck_normalize) == (0.3, ("Nose", "Eye"))


def one_person(shift: float, area: float = 5000.0, image_id: int = 1, category: int = 1, crowd=None):
    """A 17-keypoint person in a 100 x 200 box, 12 labelled keypoints (5 not), and a prediction of
    it shifted by `shift` pixels in x."""
    points = np.zeros((17, 3))
    points[:12] = [[100 + 7 * k, 50 + 13 * k, 2] for k in range(12)]
    guess = points.copy()
    guess[:12, 0] += shift
    guess[:, 2] = 1
    image = {"id": image_id, "file_name": f"{image_id}.jpg", "width": 400, "height": 400}
    if crowd is not None:
        image["crowdIndex"] = crowd
    ann = {"id": image_id, "image_id": image_id, "category_id": category, "iscrowd": 0,
           "bbox": [90, 40, 100, 200], "area": area, "keypoints": points.ravel().tolist(),
           "num_keypoints": 12}
    return image, ann, {"image_id": image_id, "category_id": category, "score": 0.9,
                        "keypoints": guess.ravel().tolist()}


def oks_by_hand(shift: float, area: float, sigmas) -> float:
    return float(np.mean([math.exp(-shift ** 2 / (2 * (2 * s) ** 2 * area)) for s in sigmas[:12]]))


def ap_by_hand(oks: float) -> float:
    """One person, one prediction: matched at the thresholds its OKS reaches, AP 1 there, else 0."""
    return float(np.mean(THRESHOLDS <= oks))


def test_the_box_rule_by_hand():
    """OKS normalised by 0.53 x 100 x 200 = 10600 instead of the annotation's 5000, and the person
    counted as large (10600 > 96^2) instead of medium."""
    image, ann, result = one_person(shift=9.0)
    gt = {"images": [image], "annotations": [ann], "categories": [{"id": 1}]}
    sigmas = builtin("coco").sigmas
    by_area = coco_keypoint_stats(gt, [result], sigmas=sigmas)
    by_box = coco_keypoint_stats(gt, [result], sigmas=sigmas, scoring=builtin("aic").scoring)
    area_ap, box_ap = ap_by_hand(oks_by_hand(9.0, 5000, sigmas)), ap_by_hand(oks_by_hand(9.0, 10600, sigmas))
    assert area_ap != box_ap
    assert by_area["AP"] == pytest.approx(area_ap, abs=1e-12) and by_area["APm"] == by_area["AP"]
    assert by_box["AP"] == pytest.approx(box_ap, abs=1e-12) and by_box["APl"] == by_box["AP"]
    assert by_area["APl"] is None and by_box["APm"] is None       # nothing to score: None, not -1


def test_per_category_ap_is_the_mean_of_each_category_by_hand():
    """Species 1 found exactly, species 2 shifted: AP-10K's AP is the mean of the two APs; a result
    that names no species gets its picture's."""
    first, second = one_person(0.0, image_id=1, category=1), one_person(11.0, image_id=2, category=2)
    gt = {"images": [first[0], second[0]], "annotations": [first[1], second[1]],
          "categories": [{"id": 1}, {"id": 2}]}
    results = [first[2], dict(second[2], category_id=None)]
    sigmas = builtin("ap10k").sigmas
    expected = (1.0 + ap_by_hand(oks_by_hand(11.0, 5000, sigmas))) / 2
    stats = coco_keypoint_stats(gt, results, sigmas=sigmas, scoring=builtin("ap10k").scoring)
    assert stats["AP"] == pytest.approx(expected, abs=1e-12)
    merged = coco_keypoint_stats(gt, results, sigmas=sigmas)
    assert merged["AP"] != pytest.approx(expected, abs=1e-3)
    stored = copy.deepcopy(gt)        # converted files keep the species as source_category_id
    stored["annotations"][1].update(category_id=1, source_category_id=2)
    assert coco_keypoint_stats(stored, results, sigmas=sigmas, scoring=builtin("ap10k").scoring) == stats


def test_crowdpose_statistics_by_hand():
    """crowdIndex 0.05 and 0.15 (easy: the evaluator cuts at 0.2), 0.5 (medium), 0.9 (hard); easy
    found exactly, medium shifted, hard missed."""
    people = [one_person(0.0, image_id=1, crowd=0.05), one_person(0.0, image_id=2, crowd=0.15),
              one_person(14.0, image_id=3, crowd=0.5), one_person(0.0, image_id=4, crowd=0.9)]
    gt = {"images": [p[0] for p in people], "annotations": [p[1] for p in people], "categories": [{"id": 1}]}
    skeleton = builtin("crowdpose")
    sigmas = list(skeleton.sigmas) + [0.079] * 3          # 17 points: the hand case's layout
    oks = oks_by_hand(14.0, 0.53 * 100 * 200, sigmas)
    stats = coco_keypoint_stats(gt, [p[2] for p in people[:3]], sigmas=sigmas, scoring=skeleton.scoring)
    assert stats["AP_easy"] == pytest.approx(1.0, abs=1e-12)
    assert stats["AP_medium"] == pytest.approx(ap_by_hand(oks), abs=1e-12)
    assert stats["AP_hard"] == 0.0
    assert stats["AR50"] == pytest.approx((2 + (oks >= 0.5)) / 4, abs=1e-12)
    assert stats["AR75"] == pytest.approx((2 + (oks >= 0.75)) / 4, abs=1e-12)
    no_hard = dict(gt, images=gt["images"][:3], annotations=gt["annotations"][:3])
    assert coco_keypoint_stats(no_hard, [p[2] for p in people[:3]], sigmas=sigmas,
                               scoring=skeleton.scoring)["AP_hard"] is None


def test_nothing_to_score_is_none():
    fly = builtin("fly")
    gt = {"images": [{"id": 1, "width": 10, "height": 10, "file_name": "a"}], "annotations": [],
          "categories": [{"id": 1}]}
    assert distance_stats(gt, [], fly, fly.scoring) == {"PCK": None, "PCK_unnormalised": 0, "AUC": None,
                                                        "EPE": None, "EPE_found": None}
    assert set(coco_keypoint_stats(gt, []).values()) == {None}


@pytest.mark.parametrize("field, value, message", [
    ("oks_area", "bbox", "oks_area 'bbox': give one of area, box"),
    ("per_category", "yes", "per_category 'yes': give one of false, true"),
    ("oks_stats", "crowdpose", "oks_stats 'crowdpose': give one of coco, crowd"),
])
def test_a_skeleton_file_states_the_area_rule_and_categories(field, value, message):
    spec = dict(builtin("coco").to_spec(), name="mine", oks_area="box", per_category=True, oks_stats="crowd")
    mine = Skeleton.from_spec(spec, "mine.yaml")
    scoring = mine.scoring
    assert (scoring.oks_area, scoring.per_category, scoring.oks_stats) == ("box", True, "crowd")
    again = Skeleton.from_spec(mine.to_spec(), "again")
    assert again.scoring == mine.scoring and "oks_area" not in builtin("coco").to_spec()
    assert mine.scoring.describe() == ("scored with: OKS AP (0.53 x box w x h, per category, averaged, "
                                       "crowd stats)")
    with pytest.raises(ConfigError, match=f"^mine.yaml: {message}"):
        Skeleton.from_spec(dict(spec, **{field: value}), "mine.yaml")
