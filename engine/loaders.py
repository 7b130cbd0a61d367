"""The run's DataLoaders (persistent workers, safe from stop signals), the global-batch sampler, and
`DeviceFeed`: on CUDA batch n + 1's copy is queued on a side stream before batch n is handed over."""
from __future__ import annotations

import atexit
import itertools
import signal
import weakref
from time import monotonic
from typing import Callable, Iterable, Iterator

import torch
from torch.utils.data import DataLoader, Sampler

from common.errors import ConfigError, DataError, UserError, raise_if_stopped
from config.schema import DataConfig, TrainConfig
from data.transfer import expand, is_compact, trim_people
from runtime import distributed as dist


class GlobalBatchSampler(Sampler):
    """Each epoch one permutation from (seed, epoch) cut into global batches; rank r gets the r-th slice
    of each as (epoch, index) pairs: the same samples on any process count; a resume takes the next batch."""

    def __init__(self, dataset_len: int, batch_size: int, rank: int = 0, world_size: int = 1, seed: int = 0):
        self.dataset_len, self.batch_size, self.per_rank = dataset_len, batch_size, batch_size // world_size
        self.rank, self.seed = rank, seed
        self.epoch, self.start_batch = 0, 0

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.epoch, self.start_batch = epoch, start_batch

    @property
    def batches_per_epoch(self) -> int:
        return self.dataset_len // self.batch_size

    def __len__(self) -> int:
        return max(0, self.batches_per_epoch - self.start_batch)

    def __iter__(self):
        gen = torch.Generator().manual_seed(self.seed * 100003 + self.epoch)
        order = torch.randperm(self.dataset_len, generator=gen).tolist()
        for b in range(self.start_batch, self.batches_per_epoch):
            first = b * self.batch_size + self.rank * self.per_rank
            yield [(self.epoch, index) for index in order[first:first + self.per_rank]]


STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGUSR1") if hasattr(signal, name))
POLL_S = 5.0               # a wait for a batch goes in polls this long (as torch's check of its workers)


def ignore_stop_signals(worker_id: int) -> None:
    """Workers ignore SIGTERM / SIGUSR1: the main process decides when to stop, and they end with it."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    # forked with them blocked (`PersistentWorkersLoader`): one that came since is dropped now
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def _stop_workers(iterator, workers) -> None:
    """Shut down a loader iterator's workers (`iterator` None: gone) and kill any left."""
    if iterator is not None:
        iterator._shutdown_workers()
    for worker in workers:
        if worker.is_alive():
            worker.kill()
            worker.join(timeout=5)


class PersistentWorkersLoader(DataLoader):
    """A DataLoader whose workers start safe from stop signals, end with `close()` (the garbage collector
    cannot stop them cleanly) or at exit, and whose user errors read as one line; a batch its workers
    have not handed over after `batch_timeout_s` of waiting (0: no limit) ends the run."""

    def __init__(self, dataset, batch_timeout_s: float = 0, **options):
        self.batch_timeout_s = batch_timeout_s if options.get("num_workers") else 0
        super().__init__(dataset, timeout=min(POLL_S, self.batch_timeout_s), **options)

    def _get_iterator(self):
        if self.num_workers == 0:
            return super()._get_iterator()
        # forked with stop signals blocked until `worker_init_fn` ignores them
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            iterator = super()._get_iterator()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        # at exit, the workers of an iterator still alive
        atexit.register(lambda ref, workers: _stop_workers(ref(), workers), weakref.ref(iterator),
                        list(iterator._workers))
        dist.watch_workers(iterator._workers)          # one stopped would hang every rank
        return _AsRaisedInWorker(iterator, self.batch_timeout_s)

    def close(self) -> None:
        """End the worker processes now; iterating again starts new ones."""
        iterator, self._iterator = getattr(self, "_iterator", None), None
        if iterator is not None and self.num_workers > 0:
            _stop_workers(iterator, iterator._workers)


class _AsRaisedInWorker:
    """A loader iterator that re-raises a worker's `UserError` with its own line, not torch's, and
    ends a wait for a batch after `timeout_s` (0: none)."""

    def __init__(self, iterator, timeout_s: float):
        self.iterator, self.timeout_s = iterator, timeout_s

    def __getattr__(self, name):
        return getattr(self.iterator, name)

    def __iter__(self):
        return self

    def __next__(self):
        raise_if_stopped()     # a Ctrl-C whose raise a hook of the workers' fork swallowed
        waited, last = 0.0, monotonic()
        while waited < self.timeout_s or not self.timeout_s:
            try:
                return next(self.iterator)      # the loader waits at most POLL_S (its `timeout`)
            except RuntimeError as exc:         # that wait over: the loop counts it
                if not str(exc).startswith("DataLoader timed out"):
                    raise
            except UserError as exc:
                text, origin = str(exc), f"{type(exc).__module__}.{type(exc).__qualname__}: "
                if not text.startswith("Caught ") or origin not in text:
                    raise
                raise type(exc)(text[text.rindex(origin) + len(origin):].strip()) from None
            now = monotonic()               # a wait this process spent stopped itself (a paused job) is
            waited, last = waited + (now - last if now - last < 3 * POLL_S else 0), now    # not counted
        raise DataError(f"no batch came from the {len(self.iterator._workers)} DataLoader workers in "
                        f"{self.timeout_s:g} s: one is stopped or stuck (option data.batch_timeout_s "
                        "sets this wait)")


def train_loader(dataset, data: DataConfig, train: TrainConfig, ctx) -> tuple[DataLoader, GlobalBatchSampler]:
    """The training loader of a `KeypointDataset` (compact batches) and its sampler."""
    if train.batch_size % ctx.world_size:
        raise ConfigError(f"option train.batch_size: {train.batch_size} does not divide over "
                          f"{ctx.world_size} processes (it is the total batch)")
    sampler = GlobalBatchSampler(len(dataset), train.batch_size, ctx.rank, ctx.world_size, seed=train.seed)
    if sampler.batches_per_epoch == 0:
        raise ConfigError(f"option train.batch_size: {train.batch_size} is larger than the "
                          f"{len(dataset)} training samples")
    if sampler.batches_per_epoch < train.accumulate:
        raise ConfigError(f"option train.accumulate: {train.accumulate} batches per step, but an "
                          f"epoch has only {sampler.batches_per_epoch} batches of {train.batch_size}")
    return _compact_loader(dataset, data, ctx, batch_sampler=sampler), sampler


def val_loader(dataset, data: DataConfig, batch_size: int, ctx) -> DataLoader:
    """This rank's shard of a validation `KeypointDataset`, in compact batches; built once per run."""
    per_process, n = max(1, batch_size // ctx.world_size), len(dataset)
    # every sample exactly once over all ranks
    shard = range(n * ctx.rank // ctx.world_size, n * (ctx.rank + 1) // ctx.world_size)
    return _compact_loader(dataset, data, ctx, batch_size=per_process, sampler=shard)


def _compact_loader(dataset, data: DataConfig, ctx, **sampling) -> PersistentWorkersLoader:
    """A loader of `dataset`'s compact samples with `data`'s workers (`sampling`: the loader's order)."""
    from data.dataset import CompactSamples
    if data.workers > 0:
        # one OpenCV thread, set before forking (setting it in a forked worker can deadlock)
        import cv2
        cv2.setNumThreads(1)
    return PersistentWorkersLoader(CompactSamples(dataset), num_workers=data.workers,
                                   persistent_workers=data.workers > 0, worker_init_fn=ignore_stop_signals,
                                   batch_timeout_s=data.batch_timeout_s,
                                   pin_memory=data.pin_memory and ctx.device.type == "cuda", **sampling)


def to_model_input(batch, device: torch.device, painter, non_blocking: bool = True):
    """(input, target, mask) of `batch` on `device`, float32, whatever form the batch has."""
    return _moved_and_expanded(_trimmed(batch), device, painter, non_blocking)


def _moved_and_expanded(batch, device: torch.device, painter, non_blocking: bool):
    moved = tuple(t.to(device, non_blocking=non_blocking) for t in batch)
    return expand(*moved, painter) if is_compact(moved) else moved


def _trimmed(batch):
    """A compact batch without its unused person slots (`data.transfer.trim_people`); others as they are."""
    if not is_compact(batch):
        return batch
    image, people, masks = batch
    return image, trim_people(people).contiguous(), masks


def one_ahead(items: Iterable, start: Callable, finish: Callable) -> Iterator:
    """finish(start(item)) for each item in order, item n + 1 started before item n is finished."""
    # pairwise draws (lazily starts) the following item before it hands over the pending one
    for pending, _ in itertools.pairwise(itertools.chain(map(start, items), [None])):
        yield finish(pending)


_SIDE_STREAMS: dict = {}


class DeviceFeed:
    """Iterable of the model inputs of `batches` on `device` (see the module docstring)."""

    def __init__(self, batches: Iterable, device: torch.device, painter):
        self.batches, self.device, self.painter = batches, torch.device(device), painter

    def __iter__(self) -> Iterator:
        if self.device.type != "cuda":
            return (to_model_input(batch, self.device, self.painter) for batch in self.batches)
        return one_ahead(self.batches, self._start_copy, self._take)

    def _start_copy(self, batch):
        """Queue batch's copy and expansion on the side stream, then an event: (the tensors, event)."""
        if self.device not in _SIDE_STREAMS:     # one per device, shared by every feed of this process
            _SIDE_STREAMS[self.device] = torch.cuda.Stream(self.device)
        stream = _SIDE_STREAMS[self.device]
        pinned = [t if t.is_pinned() else t.pin_memory() for t in _trimmed(batch)]
        with torch.cuda.stream(stream):
            moved = _moved_and_expanded(pinned, self.device, self.painter, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(stream)
        return moved, ready

    def _take(self, started):
        """Make the compute stream wait for this batch's event, and record it on the tensors."""
        moved, ready = started
        current = torch.cuda.current_stream(self.device)
        current.wait_event(ready)
        for tensor in moved:
            tensor.record_stream(current)
        return moved


def training_feed(data, device) -> Callable[[int, int], Iterator]:
    """`batches(epoch, start)` of `data`'s training loader, through a `DeviceFeed`."""
    painter = data.train_set.painter_for(device)

    def batches(epoch: int, start: int) -> Iterator:
        data.train_set.set_epoch(epoch)
        data.sampler.set_epoch(epoch, start)
        return iter(DeviceFeed(data.loader, device, painter))
    return batches
