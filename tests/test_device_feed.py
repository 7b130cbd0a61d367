"""The device feed: off CUDA a plain loop that never touches a CUDA stream; its one-ahead order
(batch n + 1 is queued before batch n is handed over, never further); on CUDA (a recording
stand-in for the stream and event API) batch n's compute waits for batch n's copy alone, on one
side stream for every epoch; and batches of either form (compact or float32) reach the model as
the same float32 tensors."""
from __future__ import annotations

import pytest
import torch

from config.schema import TargetConfig
from data.skeleton import builtin
from data.device_targets import TargetPainter
from data.transfer import expand
from engine.loaders import DeviceFeed, one_ahead, to_model_input

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


class RecordingCuda:
    """A stand-in for torch.cuda's stream and event API that records, in order, the work queued
    on the side stream and what the compute stream waits for (no GPU needed). Side-stream work is
    the copy and expansion of a batch; a wait covers the side-stream work queued before the event
    (or, for `wait_stream`, everything queued so far), as on a real CUDA stream."""

    def __init__(self):
        self.side_work: list[int] = []            # batch numbers, in the order they were queued
        self.log: list[tuple] = []                # ("waits for", [batches]) and ("forward", n)
        self.streams_made, self.in_side_stream = 0, False
        recorder = self

        class Stream:
            def __init__(self, device=None):
                recorder.streams_made += 1

            def record_event(self, event=None):
                event = event or Event()
                event.record(self)
                return event

        class Event:
            def __init__(self, *args, **kwargs):
                self.covers = None

            def record(self, stream=None):
                self.covers = list(recorder.side_work)

        class ComputeStream:
            def wait_event(self, event):
                recorder.log.append(("waits for", event.covers))

            def wait_stream(self, stream):
                recorder.log.append(("waits for", list(recorder.side_work)))

        class StreamContext:
            def __init__(self, stream):
                pass

            def __enter__(self):
                recorder.in_side_stream = True

            def __exit__(self, *exc):
                recorder.in_side_stream = False

        self.Stream, self.Event, self.stream, self.compute = Stream, Event, StreamContext, ComputeStream()

    def queued_copy(self, batch, device, painter, non_blocking):
        assert self.in_side_stream, "a batch's copy was not queued on the side stream"
        self.side_work.append(int(batch[0][0]))
        return tuple(batch)

    def install(self, monkeypatch) -> None:
        import engine.loaders as feed
        monkeypatch.setattr(torch.cuda, "Stream", self.Stream)
        monkeypatch.setattr(torch.cuda, "Event", self.Event)
        monkeypatch.setattr(torch.cuda, "stream", self.stream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.compute)
        monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)
        monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
        monkeypatch.setattr(feed, "_moved_and_expanded", self.queued_copy)
        monkeypatch.setattr(feed, "_SIDE_STREAMS", {}, raising=False)


def test_on_cuda_batch_n_waits_for_its_own_copy_only_and_one_side_stream_serves_every_epoch(monkeypatch):
    cuda = RecordingCuda()
    cuda.install(monkeypatch)
    batches = [tuple(torch.full((1,), float(n)) for _ in range(3)) for n in range(4)]
    feed = DeviceFeed(batches, torch.device("cuda", 0), PAINTER)
    for epoch in range(2):
        cuda.side_work.clear()
        cuda.log.clear()
        for batch in feed:
            cuda.log.append(("forward", (int(batch[0][0]), list(cuda.side_work))))
        forwards = [i for i, (kind, _) in enumerate(cuda.log) if kind == "forward"]
        assert [cuda.log[i][1][0] for i in forwards] == [0, 1, 2, 3]
        for n, at in enumerate(forwards):
            assert cuda.log[at][1][1] == list(range(min(n + 2, 4)))   # batch n + 1 already queued
            kind, covered = cuda.log[at - 1]               # the wait right before batch n's compute
            assert kind == "waits for" and covered == list(range(n + 1)), (n, cuda.log)
    assert cuda.streams_made == 1
