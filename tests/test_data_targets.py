"""Targets: exact values against a direct formula, peaks, mean/max combination, flip, masks."""
from __future__ import annotations

import math

import numpy as np
import pytest

from config.schema import TargetConfig
from data.skeleton import builtin
from data.augment import transform_people
from data.targets import GAUSSIAN_CUTOFF, render_targets

COCO = builtin("coco")
CHANNEL_FLIP = COCO.channel_flip
KEYPOINT_FLIP = COCO.flip
LIMBS = COCO.limbs
NUM_CHANNELS = COCO.num_channels


def flip_people(people: np.ndarray, width: int, flip) -> np.ndarray:
    """People [P,K,3] mirrored in an image `width` pixels wide, left and right swapped (`flip`), as
    the augmentation's flip moves them (`transform_people` with a mirroring affine)."""
    return transform_people(people, np.array([[-1.0, 0.0, width - 1.0], [0.0, 1.0, 0.0]]), flip)


def direct_targets(people, height, width, stride, cfg):
    """The 48 maps by their definition, over the whole grid (slow, obviously right)."""
    xs = (np.arange(width) + 0.5) * stride - 0.5
    ys = (np.arange(height) + 0.5) * stride - 0.5
    grid_x, grid_y = np.meshgrid(xs, ys)
    out = np.zeros((48, height, width))
    for person in people:
        for k in range(18):
            if person[k, 2] > 0:
                d2 = ((grid_x - person[k, 0]) ** 2 + (grid_y - person[k, 1]) ** 2)
                d2 /= 2 * cfg.keypoint_sigma ** 2
                out[30 + k] = np.maximum(out[30 + k], np.where(d2 > GAUSSIAN_CUTOFF, 0, np.exp(-d2)))
    m = cfg.limb_margin
    for limb, (a, b) in enumerate(LIMBS):
        total, count = np.zeros((height, width)), np.zeros((height, width))
        for person in people:
            if person[a, 2] > 0 and person[b, 2] > 0:
                pa, pb = person[a, :2].astype(float), person[b, :2].astype(float)
                ux, uy = (pb - pa) / np.hypot(*(pb - pa))
                d2 = ((grid_x - pa[0]) * uy - (grid_y - pa[1]) * ux) ** 2 / (2 * cfg.limb_sigma ** 2)
                inside = ((grid_x >= min(pa[0], pb[0]) - m) & (grid_x <= max(pa[0], pb[0]) + m)
                          & (grid_y >= min(pa[1], pb[1]) - m) & (grid_y <= max(pa[1], pb[1]) + m))
                g = np.where(inside & (d2 <= GAUSSIAN_CUTOFF), np.exp(-d2), 0)
                total += g
                count += g > 0
        out[limb] = total / np.maximum(count, 1)
    return out


def random_people(rng, count, width, height):
    people = np.zeros((count, 18, 3), np.float32)
    people[..., 0] = rng.uniform(-15, width + 15, (count, 18))
    people[..., 1] = rng.uniform(-15, height + 15, (count, 18))
    people[..., 2] = rng.integers(0, 3, (count, 18))
    return people


@pytest.mark.parametrize("stride,height,width", [(4, 64, 48), (1, 70, 90)])
def test_targets_match_their_definition(stride, height, width):
    rng = np.random.default_rng(stride)
    people = random_people(rng, 4, width * stride, height * stride)
    cfg = TargetConfig()
    target = render_targets(people, height, width, stride, cfg, COCO)
    expected = direct_targets(people, height, width, stride, cfg)
    assert target.shape == (NUM_CHANNELS, height, width) and target.dtype == np.float32
    np.testing.assert_allclose(target[:48], expected, atol=1e-6)
    np.testing.assert_allclose(target[49], expected[30:48].max(0), atol=1e-6)
    assert target.min() >= 0 and target.max() <= 1


def test_keypoint_peak_is_at_the_nearest_cell_and_equals_the_gaussian():
    people = np.zeros((1, 18, 3), np.float32)
    people[0, 3] = (101.3, 57.9, 2)
    target = render_targets(people, 32, 40, 4, TargetConfig(), COCO)
    i, j = np.unravel_index(target[33].argmax(), target[33].shape)
    assert (i, j) == (round((57.9 + 0.5) / 4 - 0.5), round((101.3 + 0.5) / 4 - 0.5))
    d2 = ((j + 0.5) * 4 - 0.5 - 101.3) ** 2 + ((i + 0.5) * 4 - 0.5 - 57.9) ** 2
    assert target[33, i, j] == pytest.approx(math.exp(-d2 / (2 * 9.0 ** 2)), rel=1e-5)
    assert target[30:48].sum() == pytest.approx(target[33].sum())   # only the labelled joint


def test_people_combine_by_max_for_keypoints_and_mean_for_limbs():
    rng = np.random.default_rng(3)
    one = random_people(rng, 1, 160, 160)
    one[..., 2] = 2
    twice = np.concatenate([one, one])
    cfg = TargetConfig()
    np.testing.assert_allclose(render_targets(twice, 40, 40, 4, cfg, COCO),
                               render_targets(one, 40, 40, 4, cfg, COCO), atol=1e-6)


def test_flipped_people_give_mirrored_swapped_targets_and_flip_twice_is_identity():
    rng = np.random.default_rng(5)
    size = 128
    people = random_people(rng, 3, size, size)
    flipped = flip_people(people, size, COCO.flip)
    np.testing.assert_allclose(flip_people(flipped, size, COCO.flip), people, atol=1e-4)
    # left/right swap: flipped keypoint k is original KEYPOINT_FLIP[k] mirrored
    k = 2                                                               # r_shoulder
    assert flipped[0, k, 0] == pytest.approx(size - 1 - people[0, KEYPOINT_FLIP[k], 0], abs=1e-4)
    cfg = TargetConfig()
    direct = render_targets(people, size // 4, size // 4, 4, cfg, COCO)
    mirrored = render_targets(flipped, size // 4, size // 4, 4, cfg, COCO)
    np.testing.assert_allclose(mirrored, direct[list(CHANNEL_FLIP)][:, :, ::-1], atol=1e-5)


def test_person_mask_channel_is_eroded_and_no_people_give_zeros():
    mask = np.zeros((20, 20), np.float32)
    mask[5:15, 4:12] = 1
    target = render_targets(np.zeros((0, 18, 3)), 20, 20, 4, TargetConfig(), COCO, person_mask=mask)
    expected = np.zeros_like(mask)
    expected[6:14, 5:11] = 1
    np.testing.assert_array_equal(target[48], expected)
    assert not target[:48].any() and not target[49].any()
    with pytest.raises(ValueError):
        render_targets(np.zeros((0, 18, 3)), 20, 20, 4, TargetConfig(), COCO, person_mask=np.ones((10, 10)))


def test_targets_drawn_into_a_batch_array_equal_fresh_ones_and_a_wrong_array_is_refused():
    rng = np.random.default_rng(8)
    cfg, batch = TargetConfig(), np.zeros((2, NUM_CHANNELS, 30, 30), np.float32)
    people = [random_people(rng, count, 120, 120) for count in (3, 5)]
    for n, each in enumerate(people):
        assert np.shares_memory(render_targets(each, 30, 30, 4, cfg, COCO, out=batch[n]), batch[n])
        np.testing.assert_array_equal(batch[n], render_targets(each, 30, 30, 4, cfg, COCO))
    assert batch.any()
    for wrong in (np.zeros((NUM_CHANNELS, 30, 31), np.float32), np.zeros((NUM_CHANNELS, 30, 30)),
                  batch[:, :, :, 0]):
        with pytest.raises(ValueError, match="expected a contiguous float32"):
            render_targets(people[0], 30, 30, 4, cfg, COCO, out=wrong)


def test_limbs_drawn_a_few_cells_at_a_time_are_the_same(monkeypatch):
    """Limb windows computed in small chunks (as large crowds at stride 1 are) give the same maps
    bit for bit, overlapping people averaged across chunks."""
    import data.targets as targets

    rng = np.random.default_rng(11)
    base = random_people(rng, 1, 160, 160)
    base[..., 2] = 2
    crowd = np.concatenate([base + np.float32([dx, 0, 0]) for dx in (0, 4, 9)]
                           + [random_people(rng, 3, 160, 160)])
    whole = render_targets(crowd, 40, 40, 4, TargetConfig(), COCO)
    monkeypatch.setattr(targets, "_CHUNK_CELLS", 50)
    np.testing.assert_array_equal(render_targets(crowd, 40, 40, 4, TargetConfig(), COCO), whole)
    np.testing.assert_allclose(whole[:48], direct_targets(crowd, 40, 40, 4, TargetConfig()), atol=1e-6)
