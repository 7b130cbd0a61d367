"""Samplers that make a global batch the same whatever the number of processes.

`GlobalBatchSampler` is the engine's DistributedSampler: each epoch draws one permutation from
(seed, epoch) (call `set_epoch` every epoch), cuts it into global batches of `batch_size` and gives
rank r the r-th slice of each global batch. Training with 2 processes of batch 2 therefore sees
exactly the samples that 1 process of batch 4 sees, and a run resumed mid-epoch (`start_batch`),
even with another number of processes, continues with the very next global batch. Its batches
hold (epoch, index) pairs (`data.dataset.KeypointDataset` keys): the epoch travels with the
indices, so DataLoader workers that persist across epochs draw each epoch's augmentation.

`ShardSampler` splits an evaluation set into contiguous, disjoint shards (no padding, so no sample
is counted twice).
"""
from __future__ import annotations

import torch
from torch.utils.data import Sampler


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
