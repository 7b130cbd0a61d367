"""The targets drawn in torch (`data.device_targets`, what the device draws from the keypoints)
equal the CPU drawing of `data.targets.render_targets` in every channel, to 1e-5 absolute and
with the same cells set: real coco4 samples (augmented, flipped, several people) and synthetic
people (keypoints on and past the border, unlabelled ones, degenerate limbs, crowds, nobody)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from config.loader import build_config
from config.schema import TargetConfig
from data.skeleton import builtin
from config.views import SampleSettings
from data.augment import mask_fraction
from data.dataset import KeypointDataset
from data.device_targets import TargetPainter
from data.make_hdf5 import ConvertSettings, convert
from data.targets import render_targets
from data.transfer import pack_people
from test_data_targets import flip_people

TOLERANCE = 1e-5


def assert_same_drawing(drawn: np.ndarray, expected: np.ndarray) -> None:
    assert drawn.shape == expected.shape and drawn.dtype == np.float32
    for channel, (got, want) in enumerate(zip(drawn, expected)):
        assert np.abs(got - want).max() <= TOLERANCE, f"channel {channel}"
        np.testing.assert_array_equal(got > 0, want > 0, err_msg=f"channel {channel}")


def draw_batch(samples, height, width, stride, cfg, skeleton, slots=None):
    """The torch drawing of [(people, uint8 person mask)] as one padded batch (numpy)."""
    slots = slots or max(1, max(len(p) for p, _ in samples))
    people = torch.from_numpy(np.stack([pack_people(p, slots) for p, _ in samples]))
    masks = torch.from_numpy(np.stack([m for _, m in samples])[:, None])
    return TargetPainter(skeleton, cfg, stride)(people, masks).numpy()


def random_people(rng, count, width, height, keypoints=18):
    people = np.zeros((count, keypoints, 3), np.float32)
    people[..., 0] = rng.uniform(-20, width + 20, (count, keypoints))
    people[..., 1] = rng.uniform(-20, height + 20, (count, keypoints))
    people[..., 2] = rng.integers(0, 3, (count, keypoints))
    return people


@pytest.mark.parametrize("stride,height,width,skeleton", [(4, 32, 40, "coco"), (1, 45, 60, "coco"),
                                                          (2, 30, 30, "crowdpose")])
def test_synthetic_people_draw_the_same_on_the_device(stride, height, width, skeleton):
    rng = np.random.default_rng(stride)
    skeleton, cfg = builtin(skeleton), TargetConfig(keypoint_sigma=6.0, limb_sigma=5.0, limb_margin=3.0)
    k = skeleton.num_keypoints
    samples = []
    for count in (0, 1, 3, 6):
        people = random_people(rng, count, width * stride, height * stride, k)
        if count:
            a, b = skeleton.limbs[0]
            people[0, b] = people[0, a]                       # a degenerate limb (a point)
            people[-1, :, 2] = 0                              # a person with nothing labelled
            people[0, 1, :2] = (-0.5, height * stride - 0.5)  # on the border of the grid
        mask = rng.integers(0, 256, (height, width)).astype(np.uint8)
        samples.append((people, mask))
    samples.append((flip_people(samples[2][0], width * stride, skeleton.flip), samples[2][1]))
    drawn = draw_batch(samples, height, width, stride, cfg, skeleton, slots=8)
    for got, (people, mask) in zip(drawn, samples):
        expected = render_targets(people, height, width, stride, cfg, skeleton, mask_fraction(mask))
        assert_same_drawing(got, expected)
    assert drawn[2].max() > 0.99 and drawn[0][:skeleton.person_mask_channel].max() == 0


def test_overlapping_limbs_of_many_people_are_averaged_the_same():
    rng = np.random.default_rng(0)
    base = random_people(rng, 1, 120, 120)
    base[..., 2] = 2
    crowd = np.concatenate([base + np.float32([dx, dy, 0]) for dx in (0, 3, 7) for dy in (0, 5)])
    mask = np.full((30, 30), 255, np.uint8)
    drawn = draw_batch([(crowd, mask)], 30, 30, 4, TargetConfig(), builtin("coco"))[0]
    assert_same_drawing(drawn, render_targets(crowd, 30, 30, 4, TargetConfig(), builtin("coco"),
                                              mask_fraction(mask)))


@pytest.fixture(scope="module")
def coco4_dataset(coco4_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("coco4dev") / "train.h5"
    convert(coco4_dir / "test_coco.json", coco4_dir, out, ConvertSettings(split="train", progress=False))
    cfg = build_config(None, {"data": {"input_size": 256},
                              "train": {"seed": 5}, "augment": {"flip_prob": 0.5}})
    return KeypointDataset(out, SampleSettings.of(cfg), train=True)


def test_coco4_samples_draw_the_same_on_the_device_as_in_the_workers_before(coco4_dataset):
    ds = coco4_dataset
    keys = [(epoch, i) for epoch in range(3) for i in range(len(ds))]
    arrays = [ds.sample_arrays(key) for key in keys]
    assert any(a["params"].flip for a in arrays) and not all(a["params"].flip for a in arrays)
    assert max(len(a["people"]) for a in arrays) >= 3
    compact = [ds.compact_item(key) for key in keys]
    drawn = ds.painter(torch.stack([people for _, people, _ in compact]),
                       torch.stack([masks[1:] for _, _, masks in compact])).numpy()
    for got, sample in zip(drawn, arrays):
        assert_same_drawing(got, sample["target"])
    # a CPU device draws sample by sample (`painter_for`): the maps of sample_arrays, bit for bit,
    # and dataset[i] is what it trains on
    host = ds.painter_for(torch.device("cpu"))(torch.stack([people for _, people, _ in compact]),
                                               torch.stack([masks[1:] for _, _, masks in compact]))
    assert all(np.array_equal(got, sample["target"]) for got, sample in zip(host.numpy(), arrays))
    single = [ds[key][1].numpy() for key in keys[:3]]
    assert all(np.array_equal(a, b) for a, b in zip(single, host.numpy()))
    assert ds.painter_for(torch.device("cuda")) is ds.painter           # the whole-grid drawing
