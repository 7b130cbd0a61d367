"""Run a function on real gloo ranks of one machine (torch.multiprocessing, the processes forked
from the test's: `start_forked`) and collect what each rank's call returned:
`records = on_gloo_ranks(record, world, out_dir)` with `record(rank, ctx)`, its result saved by each
rank to out_dir;
`as_forked_ranks(function, world, *args)`, a whole entry point such as `train_distributed.main` on
ranks forked from the test's process (the variables torchrun sets, without its agent and without
importing torch again: a fraction of a second each), and `forked_job`, the same ranks in a session of
their own, as srun starts a job's tasks, to be signalled as one process group (or one process
without ranks, as `python train.py` runs); and the fixture `gloo_group_of_one`, a group of one rank
in the test's own process."""
from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed
import torch.multiprocessing as mp

from config.schema import DistConfig
from runtime.distributed import cleanup, init_distributed
from child_env import find_free_port


def _worker(rank: int, world: int, port: int, out_dir: str, record) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ctx = init_distributed(DistConfig(), device="cpu")
    try:   # the networks live in record's frame: gone before the process group is destroyed
        torch.save(record(rank, ctx), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        cleanup()


def on_gloo_ranks(record, world: int, out_dir: Path) -> list:
    """[record(0, ctx) of rank 0, record(1, ctx) of rank 1, ...]."""
    start_forked(_worker, world, (world, find_free_port(), str(out_dir), record))
    return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _forked_rank(rank: int, world: int, port: int, function, args: tuple) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    function(*args)


def start_forked(function, nprocs: int, args: tuple, join: bool = True, timeout_s: float = 240):
    """torch.multiprocessing's `spawn(function, args, nprocs)`, the processes forked from this one:
    no Python start and no torch import (3-5 s of CPU each). With `join`, a process's exception is
    raised here, and processes still running after `timeout_s` are killed and fail the test; else
    their torch.multiprocessing context is returned."""
    import cv2
    cv2.setNumThreads(1)     # as the loaders do before their workers fork; in a forked rank it can deadlock
    context = mp.start_processes(function, args=args, nprocs=nprocs, start_method="fork", join=False)
    if not join:
        return context
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=0.5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise AssertionError(f"{function.__name__} on {nprocs} forked processes still ran after "
                                 f"{timeout_s:.0f} s: killed")
    return None


def as_forked_ranks(function, world: int, *args, join: bool = True):
    """function(*args) on `world` ranks forked from this process (`start_forked`)."""
    return start_forked(_forked_rank, world, (world, find_free_port(), function, args), join=join)


def _job(function, world: int, args: tuple, stderr: str | None) -> None:
    os.setsid()
    if stderr:                      # fd 2, and sys.stderr (pytest's capture replaces it)
        fd = os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 2)
        os.close(fd)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
    if not world:                   # one process without ranks, as `python SCRIPT` is: the job is the run
        return function(*args)
    ranks = as_forked_ranks(function, world, *args, join=False).processes
    signal.signal(signal.SIGTERM, signal.SIG_IGN)       # the ranks' to handle: the job waits for them
    for rank in ranks:
        rank.join()
    os._exit(max(rank.exitcode for rank in ranks))


def forked_job(function, world: int, *args, stderr: Path | None = None) -> multiprocessing.Process:
    """A started process leading a session of its own (its pid is the group's), which runs
    function(*args) on `world` forked ranks and exits with their largest exit code (world 0: runs it
    itself); its standard error, and its ranks', appended to the file `stderr` if given."""
    job = multiprocessing.get_context("fork").Process(
        target=_job, args=(function, world, args, str(stderr) if stderr else None))
    job.start()
    return job


@pytest.fixture
def gloo_group_of_one():
    """A real gloo process group of one rank in this process (no process started), destroyed
    after the test: collectives and the code that branches on `is_initialized()` run as in a group."""
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()
