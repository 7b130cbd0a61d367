"""The device feed: off CUDA a plain loop that never touches a CUDA stream; its one-ahead order
(batch n + 1 is queued before batch n is handed over, never further); and batches of either form
(compact or float32) reach the model as the same float32 tensors."""
from __future__ import annotations

import pytest
import torch

from config.schema import TargetConfig
from config.skeleton import builtin
from data.device_targets import TargetPainter
from data.transfer import expand
from engine.device_feed import DeviceFeed, one_ahead, to_model_input

PAINTER = TargetPainter(builtin("coco"), TargetConfig(), 4)


def compact_batch(seed: int):
    gen = torch.Generator().manual_seed(seed)
    image = torch.randint(0, 256, (2, 8, 8, 3), dtype=torch.uint8, generator=gen)
    people = torch.zeros(2, 3, 18, 3)
    people[0, 0] = torch.cat([torch.rand(18, 2, generator=gen) * 8, torch.ones(18, 1)], 1)
    masks = torch.randint(0, 256, (2, 2, 2, 2), dtype=torch.uint8, generator=gen)
    return image, people, masks


def test_off_cuda_the_feed_expands_each_batch_in_order_without_streams(monkeypatch):
    def no_cuda(*args, **kwargs):
        raise AssertionError("a CUDA call in a CPU run")
    monkeypatch.setattr(torch.cuda, "Stream", no_cuda)
    monkeypatch.setattr(torch.cuda, "current_stream", no_cuda)
    batches = [compact_batch(seed) for seed in range(3)]
    fed = list(DeviceFeed(batches, torch.device("cpu"), PAINTER))
    assert len(fed) == 3
    for got, batch in zip(fed, batches):
        for a, b in zip(got, expand(*batch, PAINTER)):
            assert a.dtype == torch.float32 and torch.equal(a, b)


def test_to_model_input_is_idempotent_and_takes_float_batches():
    batch = compact_batch(0)
    once = to_model_input(batch, torch.device("cpu"), PAINTER)
    twice = to_model_input(once, torch.device("cpu"), PAINTER)
    assert all(a is b for a, b in zip(once, twice))        # already model input: passed through
    assert once[0].shape == (2, 3, 8, 8) and once[1].shape == (2, 50, 2, 2) and once[2].max() <= 1
    assert once[1][0].max() > 0 and once[1][1, :48].max() == 0   # sample 1 has nobody


@pytest.mark.parametrize("count", [0, 1, 4])
def test_one_ahead_starts_the_next_item_before_handing_over_and_no_further(count):
    log = []

    def start(item):
        log.append(("start", item))
        return item

    def finish(item):
        log.append(("finish", item))
        return item * 10

    got = []
    for value in one_ahead(range(count), start, finish):
        got.append(value)
        started = [i for kind, i in log if kind == "start"]
        # handed over item n: item n + 1 (if any) is already started, item n + 2 is not
        assert started[-1] == min(value // 10 + 1, count - 1)
    assert got == [10 * i for i in range(count)]
    assert [i for kind, i in log if kind == "finish"] == list(range(count))
