"""Decoding maps into people: peaks, plateaus, real multi-person maps, mirroring, empty maps."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from config.schema import InferenceConfig, TargetConfig
from data.skeleton import builtin
from config.views import PredictSettings
from data.targets import render_targets
from inference import grouping
from inference.grouping import group_people, limb_connections, to_coco_results
from inference.peaks import find_peaks, local_maxima
from inference.estimator import PoseEstimator
from inference.predict import resample_to_image

COCO = builtin("coco")
CHANNEL_FLIP = COCO.channel_flip
COCO_TO_OURS = COCO.dataset_index
KEYPOINT_FLIP = COCO.flip
LIMBS = COCO.limbs
NECK = COCO.keypoints.index("neck")
NUM_CHANNELS = COCO.num_channels
NUM_KEYPOINTS = COCO.num_keypoints


def coco4_people(coco4_dir, image_id: int):
    """(people [P,18,3] of the image's annotated people with keypoints, (height, width))."""
    data = json.loads((coco4_dir / "test_coco.json").read_text())
    info = next(img for img in data["images"] if img["id"] == image_id)
    people = [COCO.from_annotation(a["keypoints"]) for a in data["annotations"]
              if a["image_id"] == image_id and a["num_keypoints"] > 0]
    return np.stack(people), (info["height"], info["width"])


def match(found: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """For each true person, the largest keypoint error of its closest decoded person (px)."""
    errors = []
    for person in truth:
        labelled = person[:, 2] > 0
        per = [np.abs(f[labelled, :2] - person[labelled, :2]).max() if (f[labelled, 2] > 0).all()
               else np.inf for f in found]
        errors.append(min(per))
    return np.array(errors)


def test_plateau_of_equal_maxima_gives_one_peak_at_its_centre():
    maps = np.zeros((3, 20, 30), np.float32)
    maps[0, 5, 5:7] = 0.8                     # two equal neighbours: one peak, half-way
    maps[1, 10:12, 20:22] = 0.6               # a 2x2 plateau
    maps[2, 3, 3] = maps[2, 15, 25] = 0.5     # two separate peaks stay two
    channel, xy, score = find_peaks(maps, threshold=0.1, refine_radius=2)
    assert channel.tolist() == [0, 1, 2, 2]
    np.testing.assert_allclose(xy, [[5.5, 5.0], [20.5, 10.5], [3.0, 3.0], [25.0, 15.0]], atol=1e-6)
    np.testing.assert_allclose(score, [0.8, 0.6, 0.5, 0.5])


def test_peaks_below_threshold_and_caps():
    rng = np.random.default_rng(0)
    maps = rng.random((2, 40, 40), dtype=np.float32)
    channel, _, score = find_peaks(maps, threshold=0.1, refine_radius=0, max_per_map=5)
    assert (np.bincount(channel, minlength=2) == 5).all()
    every_channel, _, every_score = find_peaks(maps, threshold=0.1, refine_radius=0)
    for c in range(2):   # the cap keeps each map's strongest peaks
        np.testing.assert_allclose(np.sort(score[channel == c]),
                                   np.sort(every_score[every_channel == c])[-5:])
    assert len(find_peaks(maps * 0.05, threshold=0.1)[0]) == 0


def slow_local_maxima(heatmaps, threshold):
    """Reference: flat indices of pixels above threshold that are >= every in-map neighbour."""
    channels, height, width = heatmaps.shape
    found = []
    for c in range(channels):
        for i in range(height):
            for j in range(width):
                window = heatmaps[c, max(i - 1, 0):i + 2, max(j - 1, 0):j + 2]
                if heatmaps[c, i, j] > threshold and heatmaps[c, i, j] >= window.max():
                    found.append((c * height + i) * width + j)
    return found


def test_both_ways_of_finding_maxima_equal_the_straightforward_one():
    rng = np.random.default_rng(3)
    coarse = (rng.integers(0, 4, (3, 17, 23)) / 4).astype(np.float32)    # many ties, on sides too
    smooth = rng.random((2, 16, 9), dtype=np.float32)
    for maps in (coarse, smooth):
        expected = slow_local_maxima(maps, 0.1)
        assert local_maxima(maps, 0.1, dense=True).tolist() == expected
        assert local_maxima(maps, 0.1, dense=False).tolist() == expected
    noise = rng.random((2, 64, 64), dtype=np.float32)
    np.testing.assert_array_equal(local_maxima(noise, 0.1), local_maxima(noise, 0.1, dense=False))


def test_cap_with_plateaus_among_the_strongest_keeps_the_first_strongest():
    maps = np.random.default_rng(4).random((2, 30, 30), dtype=np.float32) * 0.5
    maps[:, 5, 5:8] = maps[:, 15:17, 10:12] = 0.9      # 7 maxima of the top value, but 2 plateaus
    maps[:, 25, 20:22] = 0.8
    channel, xy, score = find_peaks(maps, threshold=0.1, refine_radius=2, max_per_map=4)
    every_channel, every_xy, every_score = find_peaks(maps, threshold=0.1, refine_radius=2)
    for c in range(2):
        mine = np.flatnonzero(every_channel == c)
        strongest = np.sort(mine[np.lexsort((mine, -every_score[mine]))][:4])
        np.testing.assert_array_equal(xy[channel == c], every_xy[strongest])
        np.testing.assert_array_equal(score[channel == c], every_score[strongest])
        np.testing.assert_allclose(np.sort(score[channel == c])[1:], [0.8, 0.9, 0.9])
        assert score[channel == c].min() < 0.5                   # the strongest noise maximum


def test_peaks_on_the_map_sides_are_found():
    maps = np.zeros((2, 10, 12), np.float32)
    maps[0, 7, 11], maps[0, 8, 0] = 0.9, 0.7      # neighbours in memory, not in the image
    maps[1, 0, 0], maps[0, 9, 11] = 0.5, 0.6      # corners; channel 1 follows channel 0 in memory
    channel, xy, score = find_peaks(maps, threshold=0.1, refine_radius=0)
    assert channel.tolist() == [0, 0, 0, 1]
    np.testing.assert_allclose(xy, [[11, 7], [0, 8], [11, 9], [0, 0]])


def slow_limb_connections(limb_maps, bounds, xy, peak_score, cfg):
    """Reference: each pair of each limb sampled point by point, then a greedy walk by rank."""
    _, height, width = limb_maps.shape
    connections = []
    for limb, (keypoint_a, keypoint_b) in enumerate(LIMBS):
        candidates = []
        for a in range(bounds[keypoint_a], bounds[keypoint_a + 1]):
            for b in range(bounds[keypoint_b], bounds[keypoint_b + 1]):
                delta = xy[b] - xy[a]
                length = float(np.sqrt((delta ** 2).sum()))
                samples = []
                for t in np.linspace(0, 1, cfg.limb_samples, dtype=np.float32):
                    x, y = xy[a] + t * delta
                    row, column = min(max(round(y), 0), height - 1), min(max(round(x), 0), width - 1)
                    samples.append(limb_maps[limb, row, column])
                score = np.mean(samples) + min(0.5 * height / max(length, 1e-6) - 1, 0)
                support = sum(s > cfg.limb_threshold for s in samples)
                if support >= cfg.limb_min_ratio * cfg.limb_samples and score > 0 and length >= 1e-6:
                    rank = 0.5 * score + 0.25 * (peak_score[a] + peak_score[b])
                    candidates.append((rank, a, b, score, length))
        candidates.sort(key=lambda c: -c[0])                 # stable: ties in row-major order
        used, chosen = set(), []
        for _, a, b, score, length in candidates:
            if a not in used and b not in used:
                used.update((a, b))
                chosen.append((a, b, score, length))
        connections.append(chosen)
    return connections


@pytest.mark.parametrize("rounds_from, block_slack", [(10 ** 9, 0), (0, 1 << 16), (0, -10 ** 9)],
                         ids=["walk", "rounds", "rounds-per-limb"])
@pytest.mark.parametrize("ties", [False, True])
def test_limb_connections_equal_a_pair_by_pair_reference(monkeypatch, rounds_from, block_slack, ties):
    rng = np.random.default_rng(5)
    height, width = 200, 40                            # segments short: no length penalty
    per_keypoint = rng.integers(2, 10, NUM_KEYPOINTS)
    per_keypoint[[3, 9]] = 0                           # keypoints without peaks
    bounds = np.concatenate([[0], np.cumsum(per_keypoint)])
    limb_maps = rng.random((len(LIMBS), height, width), dtype=np.float32)
    xy = (rng.random((bounds[-1], 2)) * [width - 1, 39]).astype(np.float32)
    peak_score = rng.random(len(xy), dtype=np.float32)
    if ties:       # halves: many pairs score and rank alike, so the order among equals matters
        limb_maps, peak_score = np.round(limb_maps * 2) / 2, np.round(peak_score * 2) / 2
        xy = np.round(xy)
    cfg = InferenceConfig(limb_min_ratio=0.4)
    monkeypatch.setattr(grouping, "ROUNDS_FROM", rounds_from)
    monkeypatch.setattr(grouping, "BLOCK_SLACK", block_slack)
    found = limb_connections(limb_maps, bounds, xy, peak_score, cfg, LIMBS)
    expected = slow_limb_connections(limb_maps, bounds, xy, peak_score, cfg)
    assert sum(map(len, expected)) > len(LIMBS) and not all(expected)
    for mine, theirs in zip(found, expected):
        assert [(a, b) for a, b, _, _ in mine] == [(a, b) for a, b, _, _ in theirs]
        np.testing.assert_allclose([c[2:] for c in mine], [c[2:] for c in theirs], rtol=1e-6)


def test_neck_at_half_pixel_gives_one_person(coco4_dir):
    people, (height, width) = coco4_people(coco4_dir, 785)
    people[:, :, :2] = np.floor(people[:, :, :2])
    people[0, 5, :2] = people[0, 2, :2] + (41, 3)     # odd distances: the neck at (x.5, y.5)
    people[0, NECK, :2] = (people[0, 2, :2] + people[0, 5, :2]) / 2
    assert (people[0, NECK, :2] % 1 == 0.5).all()
    maps = render_targets(people, height, width, 1, TargetConfig(), COCO)
    keypoints, scores = group_people(maps, InferenceConfig(), COCO)
    assert len(keypoints) == 1 and (keypoints[0, :, 2] > 0).sum() == (people[0, :, 2] > 0).sum()
    np.testing.assert_allclose(keypoints[0, NECK, :2], people[0, NECK, :2], atol=0.1)


def test_ground_truth_maps_of_five_people_decode_to_them(coco4_dir):
    people, (height, width) = coco4_people(coco4_dir, 197388)
    assert len(people) == 5
    maps = render_targets(people, height, width, 1, TargetConfig(), COCO)
    keypoints, scores = group_people(maps, InferenceConfig(), COCO)
    assert keypoints.shape == (5, 18, 3) and scores.shape == (5,)
    assert (np.diff(scores) <= 0).all() and (scores > 0).all()
    assert (match(keypoints, people) <= 1.0).all()


def test_mirrored_maps_decode_to_mirrored_people(coco4_dir):
    people, (height, width) = coco4_people(coco4_dir, 197388)
    maps = render_targets(people, height, width, 1, TargetConfig(), COCO)
    mirrored = np.ascontiguousarray(maps[:, :, ::-1][list(CHANNEL_FLIP)])
    found, _ = group_people(maps, InferenceConfig(), COCO)
    found_mirrored, _ = group_people(mirrored, InferenceConfig(), COCO)
    expected = found[:, list(KEYPOINT_FLIP)]
    expected[:, :, 0] = np.where(expected[:, :, 2] > 0, width - 1 - expected[:, :, 0], 0)
    assert len(found_mirrored) == len(found) == 5
    assert (match(found_mirrored, expected) <= 1e-3).all()


def test_empty_maps_give_no_people():
    keypoints, scores = group_people(np.zeros((NUM_CHANNELS, 48, 64), np.float32), InferenceConfig(), COCO)
    assert keypoints.shape == (0, 18, 3) and scores.shape == (0,)
    assert to_coco_results(7, keypoints, scores, COCO) == []


def test_coco_results_drop_the_neck_and_use_coco_order():
    person = np.zeros((1, 18, 3), np.float32)
    for ours in range(18):
        person[0, ours] = (100 + ours, 200 + ours, 0.9)
    person[0, 13] = 0                                   # l_ankle missing
    (result,) = to_coco_results(42, person, np.array([0.75], np.float32), COCO)
    assert result["image_id"] == 42 and result["category_id"] == 1 and result["score"] == 0.75
    triples = np.array(result["keypoints"]).reshape(17, 3)
    for coco, ours in enumerate(COCO_TO_OURS):
        expected = (0, 0, 0) if ours == 13 else (100 + ours, 200 + ours, 1)
        np.testing.assert_allclose(triples[coco], expected)


def test_resampling_puts_stride4_cells_at_their_input_points():
    # Cell (i, j) of a stride-4 map sits at input x = (j + 0.5) * 4 - 0.5: store that x in it.
    xs = (torch.arange(16, dtype=torch.float32) + 0.5) * 4 - 0.5
    maps = xs.expand(1, 1, 8, 16).clone()
    same = resample_to_image(maps, 4, (32, 64), (32, 64))[0, 0]
    torch.testing.assert_close(same[5, 4:60], torch.arange(4, 60, dtype=torch.float32))
    # Image half the input size: image pixel x is input point (x + 0.5) * 2 - 0.5.
    half = resample_to_image(maps, 4, (32, 64), (16, 32))[0, 0]
    torch.testing.assert_close(half[3, 2:30], (torch.arange(2, 30, dtype=torch.float32) + 0.5) * 2 - 0.5)


@pytest.fixture(scope="module")
def tiny_estimator(tiny_network, tiny_cfg):
    return PoseEstimator(tiny_network, PredictSettings.of(tiny_cfg))


def test_the_maps_of_a_flip_test_are_mirror_equivariant(tiny_estimator):
    settings = tiny_estimator.settings
    settings.inference.flip, settings.inference.scales = True, [1.0]
    image = np.random.default_rng(1).integers(0, 255, (128, 192, 3), dtype=np.uint8)
    maps, maps_of_mirror = tiny_estimator.maps([image, np.ascontiguousarray(image[:, ::-1])])
    assert maps.shape == (NUM_CHANNELS, 128, 192) and maps.dtype == np.float32
    mirrored = maps[:, :, ::-1][list(CHANNEL_FLIP)]
    np.testing.assert_allclose(maps_of_mirror, mirrored, atol=1e-5 * np.abs(maps).max())
    assert np.abs(maps_of_mirror - maps[:, :, ::-1]).max() > 1e-3 * np.abs(maps).max()


def test_the_maps_of_several_scales_are_their_mean_at_the_pictures_size(tiny_estimator):
    settings = tiny_estimator.settings
    settings.inference.flip, settings.inference.scales = False, [0.5, 1.0]
    image = np.random.default_rng(2).integers(0, 255, (90, 150, 3), dtype=np.uint8)
    (maps,) = tiny_estimator.maps([image])
    assert maps.shape == (NUM_CHANNELS, 90, 150)
    singles = []
    for scale in (0.5, 1.0):
        settings.inference.scales = [scale]
        singles.extend(tiny_estimator.maps([image]))
    np.testing.assert_allclose(maps, (singles[0] + singles[1]) / 2, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("field, value, says", [
    ("max_peaks", 10 ** 9, "option inference.max_peaks: 1000000000 must be >= 1 and <= 1000"),
    ("min_parts", 0, "option inference.min_parts: 0 must be >= 1 and <= 18"),
    ("merge_ratio", float("nan"), "option inference.merge_ratio: nan is not a finite number"),
])
def test_a_config_built_in_python_meets_the_bounds_of_a_config_file(field, value, says):
    """The inference bounds held only for a config read from a file or flags (issue 47)."""
    from common.errors import ConfigError
    skeleton = builtin("coco")
    maps = np.zeros((skeleton.num_channels, 8, 8), np.float32)
    with pytest.raises(ConfigError) as refused:
        group_people(maps, InferenceConfig(**{field: value}), skeleton)
    assert str(refused.value) == says
