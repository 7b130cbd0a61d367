"""The training/validation dataset: one sample per main person of a keypoint HDF5 file, augmented
with a draw seeded by (seed, epoch, rank, index) in training, centred in validation."""
from __future__ import annotations

import ctypes
import os
import time

import numpy as np
import torch
from torch.utils.data import Dataset

from config.views import SampleSettings
from data.augment import (AugmentParams, affine_matrix, draw_params, from_reduced, mask_fraction, tint,
                          to_grid, transform_people, warp_image, warp_masks)
from data.h5format import KeypointH5
from data.device_targets import TargetPainter
from data.targets import HostTargetPainter, render_targets
from data.transfer import expand, pack_people, supervised

__all__ = ["CompactSamples", "KeypointDataset"]
_REDUCTIONS = (8, 4, 2)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3          # glibc mallopt parameters
_KEEP_FREED_BYTES = 64 << 20


def keep_freed_memory() -> None:
    """Let glibc keep up to 64 MB of freed memory for reuse (page faults cost a third of a sample)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt(_M_MMAP_THRESHOLD, _KEEP_FREED_BYTES // 2)   # 32 MB: the largest glibc accepts
    mallopt(_M_TRIM_THRESHOLD, _KEEP_FREED_BYTES)


def _lap(timings: dict | None, stage: str, since: float) -> float:
    """Add the CPU time since `since` to `timings[stage]` (nothing without a dict); the time now."""
    now = time.process_time()
    if timings is not None:
        timings[stage] = timings.get(stage, 0.0) + now - since
    return now


class KeypointDataset(Dataset):
    """Samples of one keypoint HDF5 file, augmented (train) or centred (validation)."""

    def __init__(self, h5_path, settings: SampleSettings, train: bool, rank: int = 0):
        self.h5 = KeypointH5(h5_path).open()
        self.skeleton = self.h5.skeleton
        self.settings = settings
        self.train = train
        self.rank = int(rank)
        self.epoch = 0
        self.size = settings.input_size
        self.stride = settings.stride
        self.out_size = self.size // self.stride
        self.painter = TargetPainter(self.skeleton, settings.targets, self.stride)    # whole grid
        self.host_painter = HostTargetPainter(self.skeleton, settings.targets, self.stride)
        self.person_slots = max(1, self.h5.max_people)     # people per compact sample
        self._process = None          # pid `keep_freed_memory` ran in

    def painter_for(self, device: torch.device):
        """On a CPU `data.targets`' windows (40x cheaper there), else the whole-grid `TargetPainter`."""
        return self.host_painter if torch.device(device).type == "cpu" else self.painter

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.h5.num_samples

    # -- randomness -----------------------------------------------------------------------------
    def split_key(self, key) -> tuple[int, int]:
        """(epoch, index) of a key: an (epoch, index) pair, or an index in the `set_epoch` epoch."""
        epoch, index = key if isinstance(key, tuple) else (self.epoch, key)
        index = int(index)
        return int(epoch), index + len(self) if index < 0 else index

    def draw(self, key) -> AugmentParams:
        """The augmentation of sample `key` (the identity in validation mode), drawn by its own generator."""
        if not (self.train and self.settings.augment.enabled):
            return AugmentParams()
        epoch, index = self.split_key(key)
        rng = np.random.default_rng([int(self.settings.seed), epoch, self.rank, index])
        return draw_params(rng, self.settings.augment, self.size)

    # -- samples --------------------------------------------------------------------------------
    def sample_arrays(self, key, timings: dict | None = None) -> dict:
        """numpy view of sample `key`: image, people, target, mask (1 = supervise), ignore and person_mask
        (0-255), params, matrix (image px -> input px); `timings` accumulates CPU seconds per stage."""
        sample = self.augmented(key, timings)
        clock = time.process_time()
        sample["mask"] = supervised(torch.from_numpy(sample["ignore"])).numpy()
        sample["target"] = render_targets(sample["people"], self.out_size, self.out_size, self.stride,
                                          self.settings.targets, self.skeleton,
                                          mask_fraction(sample["person_mask"]))
        _lap(timings, "targets", clock)
        return sample

    def augmented(self, key, timings: dict | None = None) -> dict:
        """`sample_arrays(key, timings)` without target and mask: the host-side work of a loader worker."""
        if self._process != os.getpid():
            keep_freed_memory()
            self._process = os.getpid()
        clock = time.process_time()
        _, index = self.split_key(key)
        img, person = self.h5.sample_ref(index)
        params = self.draw(key)
        people = self.h5.people(img)
        x, y, w, h = self.h5.person_boxes(img)[person]
        matrix = affine_matrix((x + w / 2, y + h / 2), h, self.size,
                               self.settings.augment.person_height, params)
        zoom = abs(np.linalg.det(matrix[:, :2])) ** 0.5          # the affine's isotropic scale
        reduce = next((r for r in _REDUCTIONS if zoom * r <= 1.0), 1)
        clock = _lap(timings, "read: people and draw", clock)
        image = self.h5.decode_image(img, reduce)
        clock = _lap(timings, "read: picture (HDF5, JPEG decode)", clock)
        mask_planes = self.h5.mask_planes(img)
        clock = _lap(timings, "read: masks", clock)
        image = warp_image(image, from_reduced(matrix, reduce), self.size)
        clock = _lap(timings, "augment: picture warp", clock)
        if params.color:
            image = tint(image, params)
        clock = _lap(timings, "augment: colour tint", clock)
        grid = to_grid(matrix, self.stride)
        ignore, person_mask = warp_masks(mask_planes, grid, self.out_size)
        people = transform_people(people, matrix, self.skeleton.flip if params.flip else None)
        _lap(timings, "augment: masks and joints", clock)
        return {"image": image, "people": people, "ignore": ignore, "person_mask": person_mask,
                "params": params, "matrix": matrix, "image_index": img, "person_index": person}

    def compact_item(self, key, timings: dict | None = None):
        """(uint8 image [S,S,3], people [slots,K,3], uint8 masks [2,h,w]): what a worker sends."""
        sample = self.augmented(key, timings)
        people = pack_people(sample["people"], self.person_slots)
        return (torch.from_numpy(sample["image"]), torch.from_numpy(people),
                torch.from_numpy(np.stack([sample["ignore"], sample["person_mask"]])))

    def __getitem__(self, key):
        return expand(*self.compact_item(key), self.host_painter)


class CompactSamples(Dataset):
    """`KeypointDataset.compact_item` as a dataset: what the training and validation loaders load."""

    def __init__(self, dataset: KeypointDataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key):
        return self.dataset.compact_item(key)
