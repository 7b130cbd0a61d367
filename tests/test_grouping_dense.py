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
from inference.coco_eval import keypoint_recall
from inference.grouping import group_people
from dense_skeletons import MPII16, exlpose_like, halpe136_like, mhp_like, oracle_ap, oracle_results

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


def test_halpe136_people_as_small_as_its_test_files_decode_their_ground_truth():
    """Halpe's test file labels face and hands of COCO val2017's people, many of them small: with
    sigma 0.015 a point must be found within a pixel or so. The peak's centre read from the
    Gaussian's log-parabola (the window's centroid had left it up to half a pixel off: 0.83)."""
    assert oracle_ap(builtin("halpe136"), pictures=12, seed=3, heights=(30, 165)) >= 0.9


@pytest.mark.parametrize("x, y", [(100.0, 50.0), (100.3, 50.7), (100.5, 50.5), (100.9, 50.1)])
def test_a_peak_is_read_at_its_gaussians_centre(x, y):
    from inference.peaks import find_peaks

    person = np.zeros((17, 3), np.float32)
    person[0] = [x, y, 2]
    maps = render_targets(COCO.from_annotation(person)[None], 120, 200, 1, TargetConfig(), COCO)
    channel, xy, _ = find_peaks(maps[COCO.keypoint_channels], 0.1)
    assert list(channel) == [COCO.keypoints.index("nose")]
    np.testing.assert_allclose(xy[0], [x, y], atol=0.01)


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


def test_a_keypoint_left_on_its_own_is_joined():
    person = chain_person(30, 40)
    person[4] = 0                                     # e unlabelled: f has no link to anyone
    keypoints, _ = group_people(chain_maps(person[None]), InferenceConfig(), CHAIN)
    assert len(keypoints) == 1 and ((keypoints[0, :, 2] > 0) == (person[:, 2] > 0)).all()
    np.testing.assert_allclose(keypoints[0, :, :2], person[:, :2], atol=0.5)


def test_mhp_right_legs_on_their_own_are_found():
    """MHP-like people whose right hip is never labelled, and one of its right knee and ankle:
    every labelled right knee and ankle is a keypoint on its own, joined to the person whose pelvis
    is nearest in that person's scale (in crowds of people overlapping, often another's: here
    23 % of the ankles and 68 % of the knees are placed right; none were before)."""
    def hide(people, rng):
        people[:, MPII16.index("right_hip"), 2] = 0
        knee = rng.random(len(people)) < 0.5
        people[knee, MPII16.index("right_knee"), 2] = 0
        people[~knee, MPII16.index("right_ankle"), 2] = 0
    skeleton = mhp_like()
    gt, results = oracle_results(skeleton, pictures=12, seed=3, unlabelled=0.0, hide=hide)
    recall = dict(zip(MPII16, keypoint_recall(gt, results, skeleton.sigmas)))
    for name in ("right_knee", "right_ankle"):
        labelled, recalled = recall[name]
        assert labelled >= 20 and recalled >= 0.2 * labelled, (name, labelled, recalled)


def test_a_far_part_is_not_joined_on_the_strength_of_a_large_one():
    """A small head and, 200 px below, the hips of a large person (their link 200 px long): the
    head's own links (< 10 px) cannot vouch for the gap, so they stay two people."""
    head, hips = np.zeros((17, 3), np.float32), np.zeros((17, 3), np.float32)
    head[:5] = [[100, 100, 2], [96, 97, 2], [104, 97, 2], [92, 99, 2], [108, 99, 2]]
    hips[11:13] = [[210, 300, 2], [10, 300, 2]]
    people = np.stack([COCO.from_annotation(p.reshape(-1)) for p in (head, hips)])
    maps = render_targets(people, 480, 640, 1, TargetConfig(), COCO)
    found, _ = group_people(maps, InferenceConfig(), COCO)
    assert sorted((f[:, 2] > 0).sum() for f in found) == [2, 5]


def test_joining_costs_coco4_no_person(coco4_dir, tmp_path):
    """The oracle AP of coco4 (real COCO pictures) with the joining is at least that without, and
    its lone left wrist (no labelled elbow) is joined."""
    from data.make_hdf5 import ConvertSettings, convert
    from config.views import EvalOptions, PredictSettings
    from config.loader import build_config
    from inference.evaluation import evaluate_h5

    convert(coco4_dir / "test_coco.json", coco4_dir, tmp_path / "coco4.h5",
            ConvertSettings(split="val", progress=False))
    ap = {}
    for ratio in (0, 2.5):
        cfg = build_config("imhn512", sets=[f"inference.bridge_ratio={ratio}"])
        ap[ratio] = evaluate_h5(None, tmp_path / "coco4.h5", PredictSettings.of(cfg), "cpu",
                                EvalOptions(oracle=True, progress=False))["AP"]
    assert ap[2.5] >= ap[0] and ap[2.5] > 0.99, ap


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
    from commit 83d9579), but for the left wrist on its own that the joining adds (40083's, and
    its pose in the crowds); each point within half a pixel of the stored one, which the centroid
    refinement of then had left up to half a pixel off the Gaussian's centre."""
    expected = json.loads((Path(__file__).parent / "data" / "grouping_coco4_expected.json").read_text())
    for name, maps in coco4_pictures(coco4_dir):
        keypoints, scores = group_people(maps, InferenceConfig(), COCO)
        stored = expected[name]
        assert keypoints.shape[0] == len(stored["scores"]) > 0, name
        np.testing.assert_array_equal(keypoints[:, :, 2] > 0, np.array(stored["keypoints"])[:, :, 2] > 0)
        np.testing.assert_allclose(keypoints[..., :2], np.array(stored["keypoints"])[..., :2], atol=0.5)
        np.testing.assert_allclose(keypoints[..., 2], np.array(stored["keypoints"])[..., 2], atol=1e-3)
        np.testing.assert_allclose(scores, stored["scores"], atol=1e-4)     # limbs sampled between them


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


MEMORY_CAPPED = """
import resource, sys
import numpy as np
from config.schema import InferenceConfig
from data.skeleton import builtin
from inference.grouping import group_people

skeleton = builtin("halpe136")
maps = np.random.default_rng(0).uniform(0, 1, (skeleton.num_channels, 48, 64)).astype(np.float32)
in_use = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (in_use + (1 << 30),) * 2)       # 1 GiB more than now
keypoints, scores = group_people(maps, InferenceConfig(max_peaks=1000), skeleton)
print(len(scores))
"""


@pytest.mark.slow
def test_grouping_memory_is_bounded_at_the_largest_max_peaks():
    """Noise maps of a 136-keypoint skeleton give every keypoint max_peaks peaks (1000, the bound;
    18 million candidate pairs over its 144 limbs, 3.3 GB at once before): grouped within 1 GiB."""
    import subprocess
    import sys

    from child_env import child_env

    done = subprocess.run([sys.executable, "-c", MEMORY_CAPPED], cwd=Path(__file__).resolve().parents[1],
                          env=child_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) > 0


def test_max_peaks_beyond_the_memory_bound_is_refused():
    from common.errors import ConfigError
    from config.loader import build_config

    with pytest.raises(ConfigError, match="inference.max_peaks: 10000 must be >= 1 and <= 1000"):
        build_config(sets=["inference.max_peaks=10000"])
