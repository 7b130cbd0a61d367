"""Grouping of dense and long-chain skeletons from their own ground truth, links of length 0,
chains broken by a missing keypoint, and the people found on coco4 kept as they were."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from config.schema import InferenceConfig, TargetConfig
from data.skeleton import Skeleton, builtin
from data.targets import render_targets
from inference.grouping import group_people
from dense_skeletons import exlpose_like, halpe136_like, mhp_like, oracle_ap

COCO = builtin("coco")
CHAIN = Skeleton.from_spec({"name": "chain", "keypoints": list("abcdef"),
                            "limbs": [list(p) for p in ("ab", "bc", "cd", "de", "ef")]}, "chain")


@pytest.mark.parametrize("make, unlabelled", [(exlpose_like, 0.08), (mhp_like, 0.08)], ids=["exlpose", "mhp"])
def test_tree_skeletons_with_unlabelled_points_decode_their_ground_truth(make, unlabelled):
    # Bare trees of links (as a dataset's JSON gives them): an unlabelled joint splits a person.
    assert oracle_ap(make(), pictures=12, seed=3, unlabelled=unlabelled) >= 0.85


@pytest.mark.slow
def test_halpe136_like_decodes_its_ground_truth():
    # Face chains of 2-5 px links, hands hung on the wrists by links of length 0.
    assert oracle_ap(halpe136_like(), pictures=12, seed=3, unlabelled=0.04) >= 0.85


def chain_maps(people: np.ndarray, height=120, width=200) -> np.ndarray:
    return render_targets(people, height, width, 1, TargetConfig(), CHAIN)


def chain_person(x0: float, y0: float, step=(12.0, 4.0)) -> np.ndarray:
    person = np.zeros((6, 3), np.float32)
    person[:, 0], person[:, 1], person[:, 2] = x0 + step[0] * np.arange(6), y0 + step[1] * np.arange(6), 2
    return person


def test_a_link_of_length_zero_joins_its_keypoints():
    person = chain_person(30, 40)
    person[3, :2] = person[2, :2]                     # c and d labelled at the same spot
    keypoints, _ = group_people(chain_maps(person[None]), InferenceConfig(), CHAIN)
    assert len(keypoints) == 1 and (keypoints[0, :, 2] > 0).all()
    np.testing.assert_allclose(keypoints[0, :, :2], person[:, :2], atol=0.5)


def test_a_chain_broken_by_a_missing_keypoint_is_one_person_each():
    left, right = chain_person(20, 20), chain_person(110, 50)
    left[2] = right[3] = 0                            # c of one, d of the other: nobody labelled them
    people = np.stack([left, right])
    found, _ = group_people(chain_maps(people), InferenceConfig(), CHAIN)
    assert len(found) == 2
    for person in people:
        labelled = person[:, 2] > 0
        best = min(found, key=lambda f: np.abs(f[labelled, :2] - person[labelled, :2]).sum())
        assert ((best[:, 2] > 0) == labelled).all()
        np.testing.assert_allclose(best[labelled, :2], person[labelled, :2], atol=0.5)
    apart, _ = group_people(chain_maps(people), InferenceConfig(bridge_ratio=0), CHAIN)
    assert len(apart) == 4                            # without the joining: the halves


def test_halves_too_far_apart_are_not_joined():
    person = chain_person(20, 20, step=(8.0, 0.0))
    person[2] = 0
    person[3:, 0] += 120                              # the far half: 128 px from b, links of 8 px
    found, _ = group_people(chain_maps(person[None]), InferenceConfig(), CHAIN)
    assert len(found) == 2


def coco4_pictures(coco4_dir):
    """(name, maps) of coco4's images and of two crowds of its poses (10 and 20 people on 480 x 640)."""
    from bench.grouping import compose, load_poses

    data = json.loads((coco4_dir / "test_coco.json").read_text())
    for image in data["images"]:
        people = [COCO.from_annotation(a["keypoints"]) for a in data["annotations"]
                  if a["image_id"] == image["id"] and a["num_keypoints"] > 0]
        yield str(image["id"]), render_targets(np.stack(people), image["height"], image["width"], 1,
                                               TargetConfig(), COCO)
    rng, poses = np.random.default_rng(7), load_poses(coco4_dir / "test_coco.json")
    for count in (10, 20):
        yield f"crowd{count}", render_targets(compose(poses, count, 480, 640, rng), 480, 640, 1,
                                              TargetConfig(), COCO)


def test_people_found_on_coco4_are_those_stored(coco4_dir):
    """The people found on coco4's ground-truth maps are those the grouping found before its
    speed-ups and the joining of broken chains (stored in tests/data/grouping_coco4_expected.json
    from commit 83d9579)."""
    expected = json.loads((Path(__file__).parent / "data" / "grouping_coco4_expected.json").read_text())
    for name, maps in coco4_pictures(coco4_dir):
        keypoints, scores = group_people(maps, InferenceConfig(), COCO)
        stored = expected[name]
        assert keypoints.shape[0] == len(stored["scores"]) > 0, name
        np.testing.assert_array_equal(keypoints[:, :, 2] > 0, np.array(stored["keypoints"])[:, :, 2] > 0)
        np.testing.assert_allclose(keypoints, stored["keypoints"], atol=1e-3)
        np.testing.assert_allclose(scores, stored["scores"], atol=1e-5)


@pytest.mark.slow
def test_grouping_bench_alternates_two_checkouts(capsys):
    from bench import grouping as bench

    repo = Path(__file__).resolve().parents[1]
    assert bench.main(["--people", "1", "3", "--reps", "1", "--size", "96", "128", "--cpu-time",
                       "--against", str(repo), "--rounds", "2"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert sum(line.startswith("round ") for line in out) == 4
    result = json.loads(out[-1])
    assert result["bench"] == "grouping_against" and result["clock"] == "cpu" and result["rounds"] == 2
    assert set(result["rows"]) == {"1", "3"}
    for row in result["rows"].values():
        assert row["against_ms"] > 0 and row["ratio"] == pytest.approx(row["this_ms"] / row["against_ms"], rel=0.02)


def test_grouping_bench_splits_the_time_into_stages(capsys):
    from bench import grouping as bench

    assert bench.main(["--people", "2", "--reps", "2", "--size", "96", "128", "--stages"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    row = result["stages_ms"]["2"]
    assert set(row) == {"total", "peaks", "limbs", "rest", "read_once"}
    assert row["total"] > 0 and row["peaks"] > 0 and row["read_once"] > 0
    assert row["rest"] == pytest.approx(row["total"] - row["peaks"] - row["limbs"], abs=0.02)
