"""The dataset: joints land where the JSON says, masks, flips, value ranges, reproducible and
distinct random streams per (seed, epoch, rank, index), and lazy opening in DataLoader workers."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from config.loader import build_config
from data.skeleton import builtin
from config.views import SampleSettings
from data.augment import AugmentParams
from data.dataset import KeypointDataset
from data.make_hdf5 import ConvertSettings, convert

COCO = builtin("coco")
CHANNEL_FLIP = COCO.channel_flip
COCO_TO_OURS = COCO.dataset_index
KEYPOINT_CHANNELS = COCO.keypoint_channels

SIZE = 256


@pytest.fixture(scope="module")
def coco4_train(coco4_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("coco4ds") / "train.h5"
    convert(coco4_dir / "test_coco.json", coco4_dir, out, ConvertSettings(split="train", progress=False))
    return out


def settings(**train) -> SampleSettings:
    cfg = build_config(None, {"data": {"input_size": SIZE}, "train": dict({"seed": 7}, **train)})
    return SampleSettings.of(cfg)


def to_cell(matrix, x, y):
    ix, iy = matrix[:, :2] @ (x, y) + matrix[:, 2]
    return (ix + 0.5) / 4 - 0.5, (iy + 0.5) / 4 - 0.5


def test_every_labelled_joint_peaks_where_the_json_says(coco4_train, coco4_dir):
    coco = json.loads((coco4_dir / "test_coco.json").read_text())
    ds = KeypointDataset(coco4_train, settings(), train=False)
    checked = 0
    for index in range(len(ds)):
        sample = ds.sample_arrays(index)
        target, matrix = sample["target"], sample["matrix"]
        image_id = ds.h5.image_info(sample["image_index"])["id"]
        for ann in coco["annotations"]:
            if ann["image_id"] != image_id or ann["num_keypoints"] == 0:
                continue
            kp = np.array(ann["keypoints"], float).reshape(17, 3)
            for c, (x, y, v) in enumerate(kp):
                if v == 0:
                    continue
                cx, cy = to_cell(matrix, x, y)
                i, j = int(round(cy)), int(round(cx))
                if not (2 <= i < SIZE // 4 - 2 and 2 <= j < SIZE // 4 - 2):
                    continue
                channel = target[KEYPOINT_CHANNELS][COCO_TO_OURS[c]]
                window = channel[i - 2:i + 3, j - 2:j + 3]
                pi, pj = np.unravel_index(window.argmax(), window.shape)
                assert abs(pi - 2) <= 1 and abs(pj - 2) <= 1, (index, ann["id"], c)
                assert window.max() > 0.5
                checked += 1
    assert checked > 50


def test_validation_mode_centres_and_scales_the_main_person(coco4_train):
    ds = KeypointDataset(coco4_train, settings(), train=False)
    for index in range(len(ds)):
        sample = ds.sample_arrays(index)
        x, y, w, h = ds.h5.person_boxes(sample["image_index"])[sample["person_index"]]
        cx, cy = sample["matrix"][:, :2] @ (x + w / 2, y + h / 2) + sample["matrix"][:, 2]
        assert (cx, cy) == pytest.approx(((SIZE - 1) / 2, (SIZE - 1) / 2))
        assert abs(np.linalg.det(sample["matrix"][:, :2])) ** 0.5 * h == pytest.approx(0.6 * SIZE)


def test_tensors_shapes_and_ranges(coco4_train):
    ds = KeypointDataset(coco4_train, settings(), train=True)
    for index in range(4):
        image, target, mask = ds[index]
        assert image.shape == (3, SIZE, SIZE) and target.shape == (50, SIZE // 4, SIZE // 4)
        assert mask.shape == (1, SIZE // 4, SIZE // 4)
        for t in (target, mask):
            assert t.dtype == torch.float32 and t.min() >= 0 and t.max() <= 1
        assert image.dtype == torch.float32 and image.min() >= 0 and image.max() <= 1
    image, _, _ = KeypointDataset(coco4_train, settings(), train=False)[0]
    sample = ds.sample_arrays(0)
    assert image.shape[0] == 3                                 # RGB from BGR
    np.testing.assert_allclose(ds[0][0][0].numpy(), sample["image"][:, :, 2] / 255, atol=1e-6)


def test_ignore_mask_covers_people_without_keypoints(coco4_train):
    ds = KeypointDataset(coco4_train, settings(), train=False)
    found = 0
    for index in range(len(ds)):
        sample = ds.sample_arrays(index)
        ignore, _ = ds.h5.masks(sample["image_index"])
        if not ignore.any():
            continue
        ys, xs = np.nonzero(ignore)
        cx, cy = to_cell(sample["matrix"], xs.mean(), ys.mean())
        i, j = int(round(cy)), int(round(cx))
        if 0 <= i < SIZE // 4 and 0 <= j < SIZE // 4:
            assert sample["mask"][i, j] < 0.5
            found += 1
        assert sample["mask"].mean() > 0.9
    assert found > 0


def test_crowd_regions_are_not_supervised(synthetic_h5):
    ds = KeypointDataset(synthetic_h5[0], SampleSettings.of(build_config("tiny")), train=False)
    found = 0
    for index in range(len(ds)):
        img, _ = ds.h5.sample_ref(index)
        if not any(a["iscrowd"] for a in ds.h5.annotations(img)):
            continue
        sample = ds.sample_arrays(index)
        ignore = np.zeros(ds.h5.image_size(img), np.uint8)
        for a in ds.h5.annotations(img):
            if a["iscrowd"]:
                x, y, w, h = (int(v) for v in a["bbox"])
                ignore[y + 2:y + h - 2, x + 2:x + w - 2] = 1
        ys, xs = np.nonzero(ignore)
        cx, cy = to_cell(sample["matrix"], xs.mean(), ys.mean())
        i, j = int(round(cy)), int(round(cx))
        if 0 <= i < 32 and 0 <= j < 32:
            assert sample["mask"][i, j] < 0.5
            found += 1
    assert found > 0


def test_flip_mirrors_image_and_swaps_left_right_targets(coco4_train):
    ds = KeypointDataset(coco4_train, settings(), train=True)
    plain, flipped = AugmentParams(), AugmentParams(flip=True)
    ds.draw = lambda index: plain
    a = ds.sample_arrays(3)
    ds.draw = lambda index: flipped
    b = ds.sample_arrays(3)
    np.testing.assert_allclose(b["image"].astype(float), a["image"][:, ::-1].astype(float), atol=1)
    np.testing.assert_allclose(b["target"], a["target"][list(CHANNEL_FLIP)][:, :, ::-1], atol=1e-4)
    np.testing.assert_allclose(b["mask"], a["mask"][:, ::-1], atol=1e-2)


def test_random_streams_reproducible_and_distinct(coco4_train):
    same = settings()
    ds = KeypointDataset(coco4_train, same, train=True, rank=0)
    again = KeypointDataset(coco4_train, same, train=True, rank=0)
    other_rank = KeypointDataset(coco4_train, same, train=True, rank=1)
    for t1, t2 in zip(ds[2], again[2]):
        assert torch.equal(t1, t2)
    assert not torch.equal(ds[2][0], other_rank[2][0])
    assert ds.draw(2) != other_rank.draw(2)
    assert ds.draw(2) != ds.draw(3)
    before = ds.draw(2)
    ds.set_epoch(1)
    assert ds.draw(2) != before
    ds.set_epoch(0)
    assert ds.draw(2) == before
    assert KeypointDataset(coco4_train, settings(seed=8), train=True).draw(2) != before


@pytest.mark.slow          # DataLoader workers: processes the code does not name
def test_dataloader_workers_open_lazily_and_match_the_main_process(coco4_train):
    ds = KeypointDataset(coco4_train, settings(), train=True, rank=1)
    ds.set_epoch(4)
    ds[0]                                                     # handle opened in the parent
    loader = DataLoader(ds, batch_size=1, num_workers=2, shuffle=False)
    batches = list(loader)
    assert len(batches) == len(ds)
    for index in (0, 5):
        for got, want in zip(batches[index], ds[index]):
            assert torch.equal(got[0], want)
    assert not torch.equal(batches[0][0], batches[1][0])


def test_colour_tint_shifts_hue_and_scales_saturation_and_value_of_every_pixel():
    """`data.augment.tint` against its definition, pixel by pixel in OpenCV's uint8 HSV: hue + shift
    modulo 180, saturation and value scaled and clipped to 255 (truncated to integers)."""
    import cv2
    from data.augment import tint

    image = np.random.default_rng(4).integers(0, 256, (40, 50, 3), dtype=np.uint8)
    params = AugmentParams(color=True, hue=-7.5, saturation=1.3, value=0.8)
    h, s, v = (c.astype(np.float32) for c in cv2.split(cv2.cvtColor(image, cv2.COLOR_BGR2HSV)))
    hsv = np.stack([np.mod(h + params.hue, 180), np.clip(s * params.saturation, 0, 255),
                    np.clip(v * params.value, 0, 255)], axis=-1).astype(np.uint8)
    np.testing.assert_array_equal(tint(image, params), cv2.cvtColor(hsv, cv2.COLOR_HSV2BGR))
    assert not np.array_equal(tint(image, params), image)
