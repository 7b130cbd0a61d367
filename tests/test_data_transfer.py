"""What crosses from the loader's workers to the device: compact samples (uint8 image, the
augmented keypoints, uint8 masks), under 0.85 MB at 512, expanded on the device (targets drawn
there) into exactly what `KeypointDataset[i]` gives; and loader workers that persist across
epochs yet draw each epoch's augmentation, and do not keep Python from exiting."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from config.loader import build_config
from config.views import SampleSettings
from data.dataset import KeypointDataset
from data.transfer import batch_bytes, expand, pack_people
from engine.loaders import train_loader, val_loader

ROOT = Path(__file__).resolve().parents[1]


def dataset_at(h5, size: int, **train) -> KeypointDataset:
    cfg = build_config(None, {"data": {"input_size": size}, "train": dict({"seed": 3}, **train)})
    return KeypointDataset(h5, SampleSettings.of(cfg), train=True)


def test_a_512_sample_sends_under_0_85_megabytes(synthetic_h5):
    ds = dataset_at(synthetic_h5[0], 512)
    compact = ds.compact_item(0)
    assert [t.dtype for t in compact] == [torch.uint8, torch.float32, torch.uint8]
    assert batch_bytes(compact) <= 0.85e6              # float32: 6.6 MB; float16 targets: 2.45 MB
    slots = ds.h5.max_people
    assert batch_bytes(compact) == 512 * 512 * 3 + slots * 18 * 3 * 4 + 2 * 128 * 128


def test_a_sample_with_more_people_than_its_slots_is_refused():
    people = np.ones((3, 18, 3), np.float32)
    assert pack_people(people, 3).shape == (3, 18, 3)
    with pytest.raises(ValueError, match="3 labelled people in a sample, more than the 2"):
        pack_people(people, 2)


def test_the_expanded_batch_is_the_stacked_dataset_items(synthetic_h5):
    ds = dataset_at(synthetic_h5[0], 128)
    keys = [(1, 0), (1, 5), (2, 5)]
    expanded = expand(*default_collate([ds.compact_item(k) for k in keys]),
                      ds.painter_for(torch.device("cpu")))
    stacked = [torch.stack(t) for t in zip(*(ds[k] for k in keys))]
    for got, want in zip(expanded, stacked):
        assert got.dtype == torch.float32 and got.is_contiguous()
        assert torch.equal(got, want)


def test_the_device_drawing_keeps_the_float32_cpu_drawing_to_5e_4(synthetic_h5):
    ds = dataset_at(synthetic_h5[0], 128)
    for key in range(4):
        drawn = ds.sample_arrays(key)
        image, target, mask = ds[key]
        sent = target.numpy()
        np.testing.assert_allclose(sent, drawn["target"], rtol=2 ** -11, atol=0)
        assert (sent > 0).sum() == (drawn["target"] > 0).sum() > 0       # no value flushed to 0
        np.testing.assert_array_equal(mask[0].numpy(), drawn["mask"])
        np.testing.assert_allclose(image.numpy(), drawn["image"].transpose(2, 0, 1)[::-1] / 255,
                                   atol=1e-6)


def loader_epochs(h5, epochs, workers: int = 2):
    """{epoch: ({index: image}, worker pids)} of the engine's training loader of `h5`."""
    cfg = build_config(None, {"data": {"input_size": 64, "workers": workers},
                              "train": {"batch_size": 4, "seed": 3}})
    ctx = SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"))
    dataset = PidDataset(KeypointDataset(h5, SampleSettings.of(cfg), train=True))
    loader, sampler = train_loader(dataset, cfg.data, cfg.train, ctx)
    seen = {}
    for epoch in epochs:
        sampler.set_epoch(epoch)
        images, pids = {}, set()
        for pid, index, image, _, _ in loader:
            pids.update(pid.tolist())
            images.update(zip(index.tolist(), image))
        seen[epoch] = images, pids
    return seen


class PidDataset:
    """A KeypointDataset whose compact items start with the worker's pid and the sample index."""

    def __init__(self, dataset: KeypointDataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def compact_item(self, key):
        index = key[1] if isinstance(key, tuple) else key      # training keys carry their epoch
        return (os.getpid(), index, *self.dataset.compact_item(key))


@pytest.mark.slow          # DataLoader workers: processes the code does not name
def test_workers_persist_across_epochs_and_draw_each_epochs_augmentation(synthetic_h5):
    persistent = loader_epochs(synthetic_h5[0], (0, 1))
    fresh = loader_epochs(synthetic_h5[0], (1,))
    (first, pids_first), (second, pids_second) = persistent[0], persistent[1]
    assert len(pids_first) == 2 and pids_second == pids_first          # the same two processes
    common = sorted(set(first) & set(second))
    assert common and all(not torch.equal(first[i], second[i]) for i in common)
    assert second.keys() == fresh[1][0].keys()
    assert all(torch.equal(second[i], fresh[1][0][i]) for i in second)


@pytest.mark.slow          # DataLoader workers: processes the code does not name
def test_validation_workers_persist_from_one_validation_to_the_next(synthetic_h5):
    cfg = build_config(None, {"data": {"input_size": 64, "workers": 2}, "train": {"batch_size": 4}})
    ctx = SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"))
    dataset = PidDataset(KeypointDataset(synthetic_h5[1], SampleSettings.of(cfg), train=False))
    loader = val_loader(dataset, cfg.data, cfg.train.batch_size, ctx)
    passes = []
    for _ in range(2):
        pids, images = set(), {}
        for pid, index, image, _, _ in loader:
            pids.update(pid.tolist())
            images.update(zip(index.tolist(), image))
        passes.append((pids, images))
    (pids_first, first), (pids_second, second) = passes
    assert len(pids_first) == 2 and pids_second == pids_first and os.getpid() not in pids_first
    assert sorted(first) == list(range(len(dataset)))          # every sample, once, both times
    assert first.keys() == second.keys() and all(torch.equal(first[i], second[i]) for i in first)


EXIT_SCRIPT = """
import sys, torch
from types import SimpleNamespace
from config.loader import build_config
from config.views import SampleSettings
from data.dataset import KeypointDataset
from engine.loaders import train_loader
cfg = build_config(None, {"data": {"input_size": 64, "workers": 2}, "train": {"batch_size": 4}})
ctx = SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"))
dataset = KeypointDataset(sys.argv[1], SampleSettings.of(cfg), train=True)
loader, sampler = train_loader(dataset, cfg.data, cfg.train, ctx)
held = iter(loader)
held.cycle = held                     # alive until Python exits, as a trainer's loader may be
next(held)
print("one batch")
"""


@pytest.mark.slow
def test_python_exits_while_persistent_workers_that_ignore_sigterm_are_alive(synthetic_h5):
    proc = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(synthetic_h5[0])], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout == "one batch\n", proc.stderr
