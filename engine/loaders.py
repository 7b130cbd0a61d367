"""The run's DataLoaders and their samplers, the same global batch whatever the number of processes.

`GlobalBatchSampler` is the engine's DistributedSampler: each epoch draws one permutation from
(seed, epoch) (call `set_epoch` every epoch), cuts it into global batches of `batch_size` and gives
rank r the r-th slice of each global batch. Training with 2 processes of batch 2 therefore sees
exactly the samples that 1 process of batch 4 sees, and a run resumed mid-epoch (`start_batch`),
even with another number of processes, continues with the very next global batch. Its batches
hold (epoch, index) pairs (`data.dataset.KeypointDataset` keys): the epoch travels with the
indices, so DataLoader workers that persist across epochs draw each epoch's augmentation.

`ShardSampler` splits an evaluation set into contiguous, disjoint shards (no padding, so no sample
is counted twice).

`train_loader` and `val_loader` load through `PersistentWorkersLoader`: worker processes that
persist from epoch to epoch, safe from the stop signals sent to the process group.
"""
from __future__ import annotations

import atexit
import signal
import weakref

import torch
from torch.utils.data import DataLoader, Sampler

from common.errors import ConfigError, UserError
from config.schema import DataConfig, TrainConfig


class GlobalBatchSampler(Sampler):
    """Yields this rank's per-process batches (lists of (epoch, index) pairs); drops an incomplete
    last batch."""

    def __init__(self, dataset_len: int, batch_size: int, rank: int = 0, world_size: int = 1,
                 seed: int = 0, shuffle: bool = True):
        if batch_size % world_size:
            raise ValueError(f"batch {batch_size} does not divide over {world_size} processes")
        self.dataset_len = dataset_len
        self.batch_size = batch_size
        self.per_rank = batch_size // world_size
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.start_batch = 0

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.epoch = epoch
        self.start_batch = start_batch

    @property
    def batches_per_epoch(self) -> int:
        return self.dataset_len // self.batch_size

    def __len__(self) -> int:
        return max(0, self.batches_per_epoch - self.start_batch)

    def __iter__(self):
        if self.shuffle:
            gen = torch.Generator().manual_seed(self.seed * 100003 + self.epoch)
            order = torch.randperm(self.dataset_len, generator=gen).tolist()
        else:
            order = list(range(self.dataset_len))
        for b in range(self.start_batch, self.batches_per_epoch):
            first = b * self.batch_size + self.rank * self.per_rank
            yield [(self.epoch, index) for index in order[first:first + self.per_rank]]


class ShardSampler(Sampler):
    """Indices [rank * n / world, (rank + 1) * n / world): every sample exactly once over all ranks."""

    def __init__(self, dataset_len: int, rank: int = 0, world_size: int = 1):
        self.begin = dataset_len * rank // world_size
        self.end = dataset_len * (rank + 1) // world_size

    def __len__(self) -> int:
        return self.end - self.begin

    def __iter__(self):
        return iter(range(self.begin, self.end))


STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGUSR1") if hasattr(signal, name))


def ignore_stop_signals(worker_id: int) -> None:
    """DataLoader workers ignore SIGTERM / SIGUSR1: torchrun and SLURM signal the whole process
    group, and a worker that died of it would make the main process fail at whatever line it is on
    (even mid-save). The main process decides: it finishes the step, saves and stops; the workers
    end with it (they watch their parent)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    # forked with them blocked (`PersistentWorkersLoader`): one that came since is dropped now
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def _stop_workers(iterator, workers) -> None:
    """Shut down a loader iterator's worker processes (`iterator` None: it is gone) and kill any
    that outlive torch's own shut-down: they ignore SIGTERM, which is all that shut-down and
    Python's exit send a worker that did not leave when asked."""
    if iterator is not None:
        iterator._shutdown_workers()
    for worker in workers:
        if worker.is_alive():
            worker.kill()
            worker.join(timeout=5)


def _stop_workers_at_exit(iterator_ref, workers) -> None:
    """Shut down the workers of a loader iterator still alive when Python exits."""
    _stop_workers(iterator_ref(), workers)


class PersistentWorkersLoader(DataLoader):
    """A DataLoader whose worker processes start safe from stop signals (see `_get_iterator`),
    end with `close()`, and are shut down when Python exits, wherever its iterator is held; an
    error of the user's that a worker meets is the same one line as without workers.
    Python's exit would stop them with SIGTERM, which they ignore (`ignore_stop_signals`), then
    wait for them forever, and torch's own shut-down does nothing once the interpreter exits. The
    exit function is registered after torch's and multiprocessing's, so it runs before them.

    A run calls `close()` when it ends: left to the garbage collector, the iterator's queues can
    be finalised before the iterator itself (they are in the same garbage cycle), so its shut-down
    cannot send the workers their stop message, waits 10 s per worker in vain, and the workers
    live on until the exit function kills them."""

    def _get_iterator(self):
        if self.num_workers == 0:
            return super()._get_iterator()
        # A worker installs torch's SIGTERM handler (which kills it when anyone but its parent
        # signals) before it runs `worker_init_fn`. The workers are forked with the stop signals
        # blocked, so one sent to the process group in between waits, then is ignored; this
        # process takes its own copy when they are unblocked here.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            iterator = super()._get_iterator()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        atexit.register(_stop_workers_at_exit, weakref.ref(iterator), list(iterator._workers))
        return _AsRaisedInWorker(iterator)

    def close(self) -> None:
        """End the worker processes now; iterating again starts new ones."""
        iterator, self._iterator = getattr(self, "_iterator", None), None
        if iterator is not None and self.num_workers > 0:
            _stop_workers(iterator, iterator._workers)


class _AsRaisedInWorker:
    """A loader iterator whose `UserError` that a worker raised (a damaged picture) comes as the
    worker raised it, one line: torch hands it over as the same type made anew from the message
    "Caught DataError in DataLoader worker process N. Original Traceback ...", whose end is the
    original error's line. Everything else is the iterator's."""

    def __init__(self, iterator):
        self.iterator = iterator

    def __getattr__(self, name):
        return getattr(self.iterator, name)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.iterator)
        except UserError as exc:
            text, origin = str(exc), f"{type(exc).__module__}.{type(exc).__qualname__}: "
            if not text.startswith("Caught ") or origin not in text:
                raise
            raise type(exc)(text[text.rindex(origin) + len(origin):].strip()) from None


def close_loaders(*loaders) -> None:
    """End the worker processes of the run's loaders (those that have them), once it is over."""
    for loader in loaders:
        if isinstance(loader, PersistentWorkersLoader):
            loader.close()


def train_loader(dataset, data: DataConfig, train: TrainConfig, ctx
                 ) -> tuple[DataLoader, GlobalBatchSampler]:
    """The training loader of a `KeypointDataset` and its sampler: compact batches
    (`data.transfer`; `engine.device_feed` expands them on the device), `train.batch_size` in
    total over the processes, in `data.workers` worker processes."""
    from data.dataset import CompactSamples
    if train.batch_size % ctx.world_size:
        raise ConfigError(f"option train.batch_size: {train.batch_size} does not divide over "
                          f"{ctx.world_size} processes (it is the total batch)")
    sampler = GlobalBatchSampler(len(dataset), train.batch_size, ctx.rank, ctx.world_size,
                                 seed=train.seed)
    if sampler.batches_per_epoch == 0:
        raise ConfigError(f"option train.batch_size: {train.batch_size} is larger than the "
                          f"{len(dataset)} training samples")
    if sampler.batches_per_epoch < train.accumulate:
        raise ConfigError(f"option train.accumulate: {train.accumulate} batches per step, but an "
                          f"epoch has only {sampler.batches_per_epoch} batches of {train.batch_size}")
    # Workers persist across epochs (and keep their HDF5 handle): the epoch travels with the
    # sampler's (epoch, index) keys. They send compact samples, expanded on the device.
    loader = PersistentWorkersLoader(CompactSamples(dataset), batch_sampler=sampler,
                                     **_worker_options(data, ctx))
    return loader, sampler


def val_loader(dataset, data: DataConfig, batch_size: int, ctx) -> DataLoader:
    """This rank's shard of a validation `KeypointDataset`, in compact batches of its share of
    the total `batch_size`. Built once per run: its workers persist from one validation to the
    next (and keep their HDF5 handle), as the training loader's do."""
    from data.dataset import CompactSamples
    per_process = max(1, batch_size // ctx.world_size)
    return PersistentWorkersLoader(CompactSamples(dataset), batch_size=per_process,
                                   sampler=ShardSampler(len(dataset), ctx.rank, ctx.world_size),
                                   **_worker_options(data, ctx))


def _worker_options(data: DataConfig, ctx) -> dict:
    """The DataLoader options of both loaders: `data.workers` persistent worker processes that
    ignore stop signals, pinned batches for CUDA."""
    if data.workers > 0:
        # Workers are the parallelism. OpenCV threads in them would oversubscribe the cores, and
        # changing OpenCV's thread count inside a forked worker can deadlock on the pool the
        # parent used: so the parent sets it once, before any worker is forked.
        import cv2
        cv2.setNumThreads(1)
    return {"num_workers": data.workers, "persistent_workers": data.workers > 0,
            "worker_init_fn": ignore_stop_signals,
            "pin_memory": data.pin_memory and ctx.device.type == "cuda"}
