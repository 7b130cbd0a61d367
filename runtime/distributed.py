"""The process group: rank and device, collectives, per-rank seeding; ranks fail together (a failing
rank leaves its error in the store), and once the group is lost every collective raises why."""
from __future__ import annotations

import contextlib
import functools
import gc
import os
import random
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from common.errors import ConfigError, UserError
from config.schema import DistConfig
from runtime.launch_env import check_port_free, read_launch, resolve_device
from runtime.rank_watch import (BEAT_KEY, ERROR_KEY, WHO_KEY, RankWatch, WatchSettings, fate, post_error,
                                read_key)

BACKENDS = ("auto", "nccl", "gloo")


@dataclass
class DistContext:
    """Where this process stands in the job; `distributed` is True when a process group exists."""
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str = ""
    distributed: bool = False
    is_main: bool = True
    launcher: str = "none"        # none | torchrun | env | slurm
    local_world_size: int = 1


_CONTEXT: DistContext | None = None


def init_distributed(dist_cfg: DistConfig, device: str = "auto",
                     local_rank_arg: int | None = None) -> DistContext:
    """Read the launcher's environment, set the device, meet the other ranks, join the group."""
    launch = read_launch(os.environ, local_rank_arg)
    if launch.world_size <= 1 or dist.is_initialized():
        return _set_context(launch, resolve_device(device, launch), dist_cfg,
                            distributed=launch.world_size > 1)
    os.environ.update(MASTER_ADDR=launch.master_addr, MASTER_PORT=str(launch.master_port))
    if launch.rank == 0 and not launch.agent_store:
        check_port_free(launch.master_port)
    try:
        ctx = _set_context(launch, resolve_device(device, launch), dist_cfg, distributed=True)
    except UserError as err:
        _leave_error_before_group(launch, err, dist_cfg.rendezvous_timeout_s, dist_cfg.rendezvous_timeout_s)
        raise
    rendezvous = timedelta(seconds=dist_cfg.rendezvous_timeout_s)
    store = _rendezvous_store(launch, rendezvous)
    _meet(store, launch, dist_cfg.rendezvous_timeout_s)
    timeout = timedelta(seconds=dist_cfg.timeout_s)
    store.set_timeout(timeout)
    global _STORE, _WATCH, _GROUP, _LOST, _SERVES
    _STORE, _GROUP, _LOST = store, (launch.rank, launch.world_size), None
    _SERVES = launch.rank == 0 and not launch.agent_store
    if ctx.backend == "nccl" and not any(os.environ.get(name) for name in _NCCL_ERROR_HANDLING):
        os.environ[_NCCL_ERROR_HANDLING[0]] = "2"      # a lost rank raises, not SIGABRT
    dist.init_process_group(ctx.backend, store=dist.PrefixStore("group", store), rank=launch.rank,
                            world_size=launch.world_size, timeout=timeout,
                            device_id=ctx.device if ctx.backend == "nccl" else None)
    host = "the torchrun agent" if launch.agent_store else "rank 0"
    settings = WatchSettings(host, f"{launch.master_addr}:{launch.master_port}", dist_cfg.heartbeat_timeout_s)
    _WATCH = RankWatch(_rendezvous_store(launch, rendezvous, serve=False), launch.rank, launch.world_size,
                       settings, _abort, _leave)
    return ctx


def _set_context(launch, dev: torch.device, dist_cfg: DistConfig, distributed: bool) -> DistContext:
    global _CONTEXT
    if dev.type == "cuda":
        torch.cuda.set_device(dev)   # before any CUDA context or NCCL communicator exists
    backend = dist_cfg.backend if distributed else ""
    if backend not in ("", *BACKENDS):
        raise ConfigError(f"dist.backend {backend!r} is unknown; use one of {', '.join(BACKENDS)}")
    if backend == "nccl" and dev.type != "cuda":
        raise ConfigError("dist.backend nccl needs CUDA devices; use gloo (or auto) with --device cpu")
    if backend == "auto":
        backend = "nccl" if dev.type == "cuda" else "gloo"
    _CONTEXT = DistContext(launch.rank, launch.local_rank, max(launch.world_size, 1), dev, backend,
                           distributed, launch.rank == 0, launch.launcher, launch.local_world_size or 1)
    return _CONTEXT


_JOINED_KEY, _ENDED_KEY = "joined", "ended"
_NCCL_ERROR_HANDLING = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING")
_STORE = None                       # the group's rendezvous store
_WATCH: RankWatch | None = None
_GROUP: tuple[int, int] | None = None   # (rank, world) joined, until cleanup()
_LOST: UserError | None = None      # why that group is gone, once known
_SERVES = False                     # rank 0 without torchrun serves the store
_GONE: set[int] = set()             # ranks found dead or frozen
_READ_WAIT_S = 10.0                 # how long rank 0 keeps serving the store for the others
_SAY_WAITING_S = 10.0               # how long rank 0 waits for the others before it says so
_EVIDENCE_S = 10.0                  # how long a failed rank looks for a dead one


def _stop_watch(hold_signals: bool = False) -> None:
    """End the watch; `hold_signals`: ignore SIGTERM / SIGUSR1 (torchrun's) until this rank says why."""
    global _WATCH
    watch, _WATCH = _WATCH, None
    if watch is not None:
        watch.stop()
        _GONE.update(watch.gone)
    with contextlib.suppress(ValueError):  # not the main thread
        for sig in (signal.SIGTERM, signal.SIGUSR1) if hold_signals else ():
            signal.signal(sig, signal.SIG_IGN)


def watch_workers(processes, what: str = "DataLoader worker") -> None:
    """This rank's watch ends the job when one of `processes` stays stopped (WHAT N, pid P)."""
    if _WATCH is not None:
        _WATCH.workers.update((process.pid, f"{what} {n}") for n, process in enumerate(processes))


def _abort() -> None:
    """Abort the process group, if any: pending and later collectives fail at once."""
    if dist.is_initialized():
        dist.distributed_c10d._abort_process_group()


def _bounded(work, seconds: float) -> None:
    """`work()` in a thread, waited for at most `seconds` (a dead store host never answers)."""
    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    thread.join(timeout=seconds)


def _leave() -> None:
    """Say in the store that this rank left; the serving rank waits up to `_READ_WAIT_S` for the rest."""
    global _STORE
    store, world, _STORE = _STORE, _GROUP[1] if _GROUP else 1, None
    if store is None:
        return
    world -= len(_GONE | (_WATCH.gone if _WATCH is not None else set()))

    def leave():
        with contextlib.suppress(RuntimeError, dist.DistError):  # the store is gone: nothing left to tell
            count = store.add(_ENDED_KEY, 1)
            deadline = time.monotonic() + _READ_WAIT_S
            while _SERVES and count < world and time.monotonic() < deadline:
                time.sleep(0.05)
                count = store.add(_ENDED_KEY, 0)
    _bounded(leave, _READ_WAIT_S + 2 if _SERVES else 2)


def end_with_error(err: UserError) -> None:
    """Leave `err` in the store (the first error wins) and leave the group, failing the others."""
    lost = _lost()
    _stop_watch(hold_signals=True)      # this rank's own error is no reason to abort under it
    store, group = _STORE, _GROUP
    if store is not None and group is not None and lost is None:
        _bounded(lambda: post_error(store, f"rank {group[0]}: {err}"), 5)
    cleanup()


def error_of_another_rank() -> UserError | None:
    """Why a collective failed when another rank is the cause (its error, the watch's verdict, a
    rank silent for `_EVIDENCE_S` s, the group aborted), aborting the group; None if this rank's own."""
    global _LOST
    if _GROUP is None:
        return None
    cause = _lost() or _another_rank_failed()
    if cause is None and not dist.is_initialized():
        cause = _group_lost()
    if cause is None:
        return None
    _LOST = cause
    _stop_watch(hold_signals=True)
    _abort()
    return UserError(str(cause))


def _another_rank_failed() -> UserError | None:
    """The error a rank left, a rank silent for `_EVIDENCE_S` s, or the store gone; else None."""
    store, (rank, world) = _STORE, _GROUP
    if store is None:
        return None
    try:
        beats = {r: store.add(BEAT_KEY.format(r), 0) for r in range(world) if r != rank}
        deadline = time.monotonic() + _EVIDENCE_S
        while not store.check([ERROR_KEY]):
            if _lost() is not None:
                return _lost()
            if not beats:
                return None
            if time.monotonic() > deadline:
                silent = min(beats)
                _GONE.add(silent)
                who = read_key(store, WHO_KEY.format(silent))
                return UserError(post_error(store, f"{fate(silent, who)}: no sign of life for "
                                            f"{_EVIDENCE_S:g} s after its connection closed; the other "
                                            "ranks end"))
            time.sleep(0.2)
            beats = {r: count for r, count in beats.items() if store.add(BEAT_KEY.format(r), 0) == count}
        return UserError(store.get(ERROR_KEY).decode())
    except (RuntimeError, dist.DistError):     # the store went with its host
        watch = _WATCH
        return _lost() or (watch.store_lost("is gone") if watch is not None else None)


def _lost() -> UserError | None:
    """Why the group is lost, when this rank knows already (its watch's verdict)."""
    watch = _WATCH
    return _LOST or (watch.verdict if watch is not None else None)


def _group_lost() -> UserError:
    """Why the joined group is gone: the watch's verdict, a rank's error, or aborted unsaid."""
    global _LOST
    _LOST = _lost()
    if _LOST is None and _STORE is not None:
        store = _STORE
        with contextlib.suppress(RuntimeError, dist.DistError):
            _LOST = UserError(store.get(ERROR_KEY).decode()) if store.check([ERROR_KEY]) else None
    if _LOST is None:
        rank, world = _GROUP
        _LOST = UserError(f"rank {rank}: the process group of {world} processes was aborted or "
                          "destroyed (torch.distributed's _abort_process_group or "
                          "destroy_process_group) while the run still needed it; this rank stops "
                          "before any further step or save")
        if _STORE is not None:          # for the others
            store, message = _STORE, str(_LOST)
            _bounded(lambda: post_error(store, message), 5)
    return _LOST


def _rendezvous_store(launch, timeout: timedelta, serve: bool = True):
    """torchrun's agent store (per restart attempt), else rank 0's on MASTER_ADDR:MASTER_PORT."""
    where = f"{launch.master_addr}:{launch.master_port}"
    agent = launch.agent_store and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefix = f"simplepose/attempt_{attempt}" if agent else "simplepose"
    serving = serve and launch.rank == 0 and not agent
    try:
        if not serving and not _reachable(launch, timeout.total_seconds()):
            raise dist.DistNetworkError(where)
        return dist.PrefixStore(prefix, dist.TCPStore(    # a client of the agent's store counts itself in
            launch.master_addr, launch.master_port, launch.world_size, is_master=serving, timeout=timeout,
            wait_for_workers=agent))
    except dist.DistNetworkError as err:
        if "in use" in str(err):
            raise ConfigError(f"MASTER_PORT {launch.master_port} is already in use; pick a free port "
                              "with --master_port or MASTER_PORT") from None
        raise ConfigError(f"rank {launch.rank} could not reach rank 0 at {where} within "
                          f"{timeout.total_seconds():g} s (dist.rendezvous_timeout_s): is rank 0 "
                          "running there, and MASTER_ADDR / MASTER_PORT the same on every rank?") from None


def fail_before_group(err: UserError, local_rank_arg: int | None = None) -> None:
    """Leave an error raised before `init_distributed` where the other ranks meet."""
    try:
        launch = read_launch(os.environ, local_rank_arg)
    except UserError:
        return
    if launch.world_size > 1 and not dist.is_initialized():
        _leave_error_before_group(launch, err, DistConfig().rendezvous_timeout_s, _READ_WAIT_S)


def _leave_error_before_group(launch, err: UserError, timeout_s: float, serve_s: float) -> None:
    """Best effort: put this rank's set-up error where the others meet (rank 0 serves `serve_s`)."""
    if launch.rank != 0 and not _reachable(launch, min(timeout_s, 30.0)):
        return
    with contextlib.suppress(UserError, RuntimeError, dist.DistError):
        store = _rendezvous_store(launch, timedelta(seconds=timeout_s if launch.rank == 0 else 5))
        store.compare_set(ERROR_KEY, "", f"rank {launch.rank}: {err}")
        if launch.rank != 0:
            store.add(_ENDED_KEY, 1)
        deadline = time.monotonic() + serve_s
        while launch.rank == 0 and store.add(_ENDED_KEY, 0) < launch.world_size - 1 \
                and time.monotonic() < deadline:
            time.sleep(0.05)


def _reachable(launch, timeout_s: float) -> bool:
    """Whether MASTER_ADDR:MASTER_PORT takes a connection within `timeout_s`, tried in Python: a signal
    ends this wait, where TCPStore's own connecting holds on for all its timeout, then logs a C++ trace."""
    deadline, address = time.monotonic() + timeout_s, (launch.master_addr, launch.master_port)
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(address, timeout=2.0):
            return True
        time.sleep(0.2)
    return False


def _meet(store, launch, timeout_s: float) -> None:
    """Wait until every rank has joined; raise a rank's error, or say how many are missing."""
    store.add(_JOINED_KEY, 1)
    started, said = time.monotonic(), launch.rank != 0
    while True:
        if not said and time.monotonic() - started > _SAY_WAITING_S:
            joined = store.add(_JOINED_KEY, 0)
            print(f"rank 0: {joined} of {launch.world_size} processes have joined at "
                  f"{launch.master_addr}:{launch.master_port}; waiting for the others at most "
                  f"{timeout_s - _SAY_WAITING_S:g} s more (dist.rendezvous_timeout_s {timeout_s:g} s)",
                  flush=True)
            said = True
        if (error := read_key(store, ERROR_KEY)) is not None:
            store.add(_ENDED_KEY, 1)
            raise ConfigError(error)
        joined = store.add(_JOINED_KEY, 0)
        if joined >= launch.world_size:
            return
        if time.monotonic() > started + timeout_s:
            raise ConfigError(f"only {joined} of {launch.world_size} processes joined within {timeout_s:g} s "
                              f"(dist.rendezvous_timeout_s) at {launch.master_addr}:{launch.master_port}; "
                              "the others failed before (see their errors) or were not started")
        time.sleep(0.05)


def cleanup() -> None:
    """Leave the process group (if any) and the store (`_leave`); safe to call twice."""
    global _CONTEXT, _GROUP, _LOST
    _stop_watch()
    if is_initialized():
        gc.collect()     # wrappers of a finished run (DDP's reducer) let go of the group first
        dist.destroy_process_group()
    _leave()
    _CONTEXT, _GROUP, _LOST = None, None, None
    _GONE.clear()


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if _active() else 0


def get_world_size() -> int:
    return dist.get_world_size() if _active() else 1


def _active() -> bool:
    """Whether collectives go to other processes; raises why once the joined group is lost."""
    global _GROUP
    if _lost() is not None:
        raise UserError(str(_lost()))
    if is_initialized() and dist.get_world_size() > 1:
        if _GROUP is None:              # a group made without init_distributed
            _GROUP = (dist.get_rank(), dist.get_world_size())
        return True
    if _GROUP is not None:
        raise UserError(str(_group_lost()))
    return False


check_group = _active           # raises why once this process's group is lost: called before a save


def _comm_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier() -> None:
    """Wait for every rank (no-op in a single process)."""
    if _active():
        dist.barrier(device_ids=[torch.cuda.current_device()] if dist.get_backend() == "nccl" else None)


def _all_reduce(value, op, divide: bool):
    """The reduction over ranks of a tensor (into a new one) or a number; the input if not distributed."""
    if not _active():
        return value
    is_tensor = torch.is_tensor(value)
    tensor = value.detach() if is_tensor else torch.tensor(float(value), dtype=torch.float64)
    as_float = divide and not tensor.is_floating_point()
    work = tensor.to(_comm_device(), dtype=torch.float64 if as_float else None, copy=True)
    dist.all_reduce(work, op=op)
    if divide:
        work /= dist.get_world_size()
    return work.to(tensor.device) if is_tensor else work.item()


all_reduce_sum = functools.partial(_all_reduce, op=dist.ReduceOp.SUM, divide=False)
all_reduce_mean = functools.partial(_all_reduce, op=dist.ReduceOp.SUM, divide=True)
all_reduce_max = functools.partial(_all_reduce, op=dist.ReduceOp.MAX, divide=False)


def any_rank(flag: bool) -> bool:
    """True on every rank when at least one rank passes True (to skip a step or stop together)."""
    return any_ranks([flag])[0]


def any_ranks(flags) -> list[bool]:
    """`any_rank` for several flags in one all-reduce."""
    if not _active():
        return [bool(f) for f in flags]
    vote = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32, device=_comm_device())
    dist.all_reduce(vote, op=dist.ReduceOp.MAX)
    return [bool(v) for v in vote.tolist()]


def broadcast_object(obj, src: int = 0):
    """`obj` of rank `src` on every rank (picklable objects)."""
    if not _active():
        return obj
    box = [obj if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src, device=_comm_device())
    return box[0]


def decided_on_main(decide):
    """`decide()` run on rank 0, its result (or exception) on every rank."""
    if not _active():
        return decide()
    outcome = None
    if dist.get_rank() == 0:
        try:
            outcome = (True, decide())
        except Exception as exc:         # noqa: BLE001 - handed to every rank, raised there
            outcome = (False, exc)
    ok, value = broadcast_object(outcome)
    if not ok:
        raise value
    return value


def all_gather_object(obj) -> list:
    """[obj of rank 0, obj of rank 1, ...] on every rank."""
    if not _active():
        return [obj]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def seed_everything(seed: int, rank: int = 0) -> int:
    """Seed python, numpy and torch from (seed, rank): each rank draws its own augmentations."""
    state = np.random.SeedSequence([int(seed), int(rank)]).generate_state(2, dtype=np.uint32)
    derived = (int(state[0]) << 32) | int(state[1])
    random.seed(derived)
    np.random.seed(int(state[0]))
    torch.manual_seed(derived)   # also seeds every CUDA device
    return derived


def current_context() -> DistContext | None:
    """The context returned by the last init_distributed (None before it or after cleanup)."""
    return _CONTEXT
