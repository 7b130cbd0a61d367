"""The training/validation dataset: one sample per main person of a keypoint HDF5 file.

`KeypointDataset(h5_path, cfg, train, rank)[i]` returns
    image  float32 [3, S, S]     RGB network input (`data.preprocess`), S = cfg.data.input_size
    target float32 [C, S/4, S/4] the maps of `data.targets.render_targets` (C: the file's
                                 skeleton's channels, 50 for COCO)
    mask   float32 [1, S/4, S/4]  1 = supervise, 0 = ignore (crowds, people without keypoints)
With train=True (and cfg.augment.enabled) each sample gets the random affine and colour tint of
`data.augment`, drawn from a generator seeded by (cfg.train.seed, epoch, rank, index): the same
tuple redraws the same sample, and every worker, rank and index draws its own. With train=False
the main person is centred and scaled to cfg.augment.person_height of the input, no randomness.

The HDF5 handle opens lazily in each worker; call `set_epoch` before creating the DataLoader
iterator (non-persistent workers copy the dataset, epoch included, when the iterator starts).
The engine calls `check_split(dataset.h5, "train")` to refuse a val file for training.
"""
from __future__ import annotations

import ctypes
import os
import time

import numpy as np
import torch
from torch.utils.data import Dataset

from config.schema import Config
from data.augment import (AugmentParams, affine_matrix, draw_params, from_reduced, matrix_zoom,
                          tint, to_grid, transform_people, warp_image, warp_masks)
from data.h5format import KeypointH5, check_split
from data.preprocess import picture_to_input
from data.targets import render_targets

__all__ = ["KeypointDataset", "check_split"]
_REDUCTIONS = (8, 4, 2)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3          # glibc mallopt parameters
_KEEP_FREED_BYTES = 64 << 20


def keep_freed_memory() -> None:
    """Let glibc keep up to 64 MB of freed memory for reuse instead of returning it to the OS.

    Every sample allocates and frees the same few large buffers (decoded image, warps, the 3.2 MB
    target at 512 px). By default glibc maps such buffers fresh from the OS and unmaps them on
    free, so each sample page-faults ~500 new pages (~2-3 ms, a third of its cost); from the heap
    they are reused. Process-wide and harmless elsewhere; nothing happens without glibc.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt(_M_MMAP_THRESHOLD, _KEEP_FREED_BYTES // 2)   # 32 MB: the largest glibc accepts
    mallopt(_M_TRIM_THRESHOLD, _KEEP_FREED_BYTES)


class _StageClock:
    """Adds the CPU time since the previous lap to `timings[stage]` (nothing without a dict)."""

    def __init__(self, timings: dict | None):
        self.timings = timings
        self.last = time.process_time() if timings is not None else 0.0

    def lap(self, stage: str) -> None:
        if self.timings is not None:
            now = time.process_time()
            self.timings[stage] = self.timings.get(stage, 0.0) + now - self.last
            self.last = now


class KeypointDataset(Dataset):
    """Samples of one keypoint HDF5 file, augmented (train) or centred (validation)."""

    def __init__(self, h5_path, cfg: Config, train: bool, rank: int = 0):
        self.h5 = KeypointH5(h5_path).open()
        self.skeleton = self.h5.skeleton
        self.cfg = cfg
        self.train = train
        self.rank = int(rank)
        self.epoch = 0
        self.size = cfg.data.input_size
        self.stride = cfg.data.stride
        self.out_size = self.size // self.stride
        self._process = None          # pid `keep_freed_memory` ran in

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.h5.num_samples

    # -- randomness -----------------------------------------------------------------------------
    def rng(self, index: int) -> np.random.Generator:
        """The generator of sample `index` in this epoch and rank."""
        return np.random.default_rng([int(self.cfg.train.seed), self.epoch, self.rank, int(index)])

    def draw(self, index: int) -> AugmentParams:
        """The augmentation of sample `index` (the identity in validation mode)."""
        if not (self.train and self.cfg.augment.enabled):
            return AugmentParams()
        return draw_params(self.rng(index), self.cfg.augment, self.size)

    # -- samples --------------------------------------------------------------------------------
    def sample_arrays(self, index: int, timings: dict | None = None) -> dict:
        """numpy view of sample `index`: image (uint8 SxSx3 BGR), people (input px), target,
        mask (S/4 x S/4, 1 = supervise), params, matrix (image px -> input px).

        `timings`, if given, accumulates CPU seconds per stage: read (HDF5 + decode), augment, targets.
        """
        if self._process != os.getpid():
            keep_freed_memory()
            self._process = os.getpid()
        clock = _StageClock(timings)
        if index < 0:
            index += len(self)
        img, person = self.h5.sample_ref(index)
        params = self.draw(index)
        people = self.h5.people(img)
        x, y, w, h = self.h5.person_boxes(img)[person]
        matrix = affine_matrix((x + w / 2, y + h / 2), h, self.size,
                               self.cfg.augment.person_height, params)
        reduce = next((r for r in _REDUCTIONS if matrix_zoom(matrix) * r <= 1.0), 1)
        image = self.h5.decode_image(img, reduce)
        mask_planes = self.h5.mask_planes(img)
        clock.lap("read")
        image = warp_image(image, from_reduced(matrix, reduce), self.size)
        if params.color:
            image = tint(image, params)
        grid = to_grid(matrix, self.stride)
        ignore, person_mask = warp_masks(mask_planes, grid, self.out_size)
        people = transform_people(people, matrix, self.skeleton.flip if params.flip else None)
        clock.lap("augment")
        target = render_targets(people, self.out_size, self.out_size, self.stride,
                                self.cfg.targets, self.skeleton, person_mask)
        clock.lap("targets")
        return {"image": image, "people": people, "target": target, "mask": 1.0 - ignore,
                "params": params, "matrix": matrix, "image_index": img, "person_index": person}

    def __getitem__(self, index: int):
        sample = self.sample_arrays(index)
        return (picture_to_input(sample["image"]), torch.from_numpy(sample["target"]),
                torch.from_numpy(sample["mask"][None]))
