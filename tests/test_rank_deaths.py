"""A rank that dies, freezes or loses its process group ends every rank within a bounded time,
with one `error:` line naming the rank and what happened, and never trains on alone.

- Every rank's watch (`runtime.rank_watch.RankWatch`) sees a rank's error or a silent rank, and
  aborts the group then; after an abort (by the watch or any other caller of torch's
  `_abort_process_group`), every collective of `runtime.distributed` and `decided_on_main` raise,
  and no checkpoint is written.
- Two real `train_distributed.py` ranks with two DataLoader workers each, started by hand (RANK /
  WORLD_SIZE / MASTER_* as SLURM sets them) or by torchrun, one of them stopped (SIGSTOP to its
  process group), killed (SIGKILL, as the out-of-memory killer does), or one of its workers killed
  or stopped: the other ends within 60 s with its line.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as torch_dist

from child_env import child_env, find_free_port
from common.errors import UserError
from gloo_ranks import on_gloo_ranks
from runtime import distributed as D
from runtime.rank_watch import RankWatch, WatchSettings, fate
from test_preemption import (REPO, logged_steps, message_lines, torchrun, worker_log, worker_pids,
                             write_micro_preset)
from test_runs_end import descendants, still_running

ENDS_WITHIN_S = 60.0          # after the signal: what the docs promise
STARTS_WITHIN_S = 240.0       # three torch processes on a loaded machine


# -- the watch, in this process -------------------------------------------------------------------
def test_the_rank_watch_judges_an_error_or_a_silent_rank_once_and_never_after_stop():
    store = torch_dist.TCPStore("127.0.0.1", find_free_port(), 1, is_master=True,
                                timeout=timedelta(seconds=10))
    aborted = []

    def watch():    # rank 0 of 2 watches rank 1; it never ends this process (grace of an hour)
        settings = WatchSettings("rank 0", "here", silent_s=0.6, every_s=0.05, grace_s=3600)
        return RankWatch(store, 0, 2, settings, lambda: aborted.append(time.monotonic()), lambda: None)

    beating = watch()
    for _ in range(20):                          # rank 1 beats: no verdict
        store.add("beat/1", 1)
        time.sleep(0.05)
    assert beating.verdict is None and not aborted
    silent_since = time.monotonic()              # rank 1 falls silent
    while beating.verdict is None and time.monotonic() - silent_since < 10:
        time.sleep(0.02)
    beating.stop()
    assert len(aborted) == 1 and 0.5 <= aborted[0] - silent_since < 2.5
    said = ("rank 1 was killed, stopped or froze (SIGKILL, out of memory, SIGSTOP?): no sign of "
            "life for 1 s (dist.heartbeat_timeout_s 0.6 s); the other ranks end")
    assert str(beating.verdict) == said and store.get("error").decode() == said   # for the others
    store.set("error", "rank 1: its own error")
    reading = watch()
    while reading.verdict is None and time.monotonic() - silent_since < 20:
        time.sleep(0.02)
    reading.stop()
    assert str(reading.verdict) == "rank 1: its own error" and len(aborted) == 2
    quiet = watch()
    quiet.stop()                                 # stopped first: the error is no reason
    time.sleep(0.3)
    assert quiet.verdict is None and len(aborted) == 2


def test_what_became_of_a_process_on_this_machine():
    import socket
    assert fate(3, f"{socket.gethostname()} {os.getpid()}") == f"rank 3 (pid {os.getpid()}) froze"
    assert fate(1, f"{socket.gethostname()} 999999999") == \
        "rank 1 (pid 999999999) was killed (SIGKILL, or out of memory)"
    assert fate(2, "elsewhere 12") == "rank 2 was killed, stopped or froze (SIGKILL, out of memory, SIGSTOP?)"


PAUSED_RANK = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
from runtime.rank_watch import RankWatch, WatchSettings
rank, port = int(sys.argv[1]), int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=60))
settings = WatchSettings("rank 0", f"127.0.0.1:{port}", silent_s=2.0, every_s=0.2, grace_s=0.2)
RankWatch(store, rank, 2, settings, abort=lambda: None, leave=lambda: None)
while True:
    time.sleep(1)
"""


@pytest.mark.slow
def test_a_job_paused_as_a_whole_and_continued_ranks_seconds_apart_runs_on():
    """SLURM's `scontrol suspend` / `resume`, a paused container: every rank stopped longer than the
    heartbeat timeout, then continued one after the other, either first; no rank accuses another."""
    port = find_free_port()
    store = torch_dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=60),
                                wait_for_workers=False)
    ranks = [subprocess.Popen([sys.executable, "-c", PAUSED_RANK, str(rank), str(port)], cwd=REPO,
                              env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in (0, 1)]
    try:
        deadline = time.monotonic() + STARTS_WITHIN_S
        while not store.check(["beat/0", "beat/1"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        for first in (0, 1):
            for rank in ranks:
                os.kill(rank.pid, signal.SIGSTOP)
            time.sleep(3.0)                          # longer than the heartbeat timeout (2 s)
            for rank in (first, 1 - first):
                os.kill(ranks[rank].pid, signal.SIGCONT)
                time.sleep(1.0)
            time.sleep(2.5)                          # a wrong verdict would be out by now
        running = [rank.poll() is None for rank in ranks]
        error = store.get("error").decode() if store.check(["error"]) else None
    finally:
        for rank in ranks:
            rank.kill()
    said = [rank.communicate()[0][-2000:] for rank in ranks]
    assert running == [True, True] and error is None, (error, said)

# -- an aborted group: two gloo ranks ---------------------------------------------------------------
def _collectives_after_abort(rank, ctx) -> dict:
    D.barrier()
    if rank == 0:
        return {}
    torch_dist.distributed_c10d._abort_process_group()     # what the NCCL error watch called
    calls = {"all_reduce_sum": lambda: D.all_reduce_sum(torch.ones(2)),
             "all_reduce_mean": lambda: D.all_reduce_mean(3.0),
             "all_reduce_max": lambda: D.all_reduce_max(torch.ones(1)),
             "any_rank": lambda: D.any_rank(True), "any_ranks": lambda: D.any_ranks([False]),
             "broadcast_object": lambda: D.broadcast_object("mine"),
             "decided_on_main": lambda: D.decided_on_main(lambda: "decided alone"),
             "all_gather_object": lambda: D.all_gather_object(1), "barrier": D.barrier,
             "get_world_size": D.get_world_size, "check_group": D.check_group}
    outcome = {}
    for name, call in calls.items():
        try:
            outcome[name] = f"returned {call()!r}"
        except UserError as err:
            outcome[name] = str(err)
    return outcome


@pytest.mark.slow
def test_every_collective_and_decided_on_main_raise_once_the_group_is_aborted(tmp_path):
    _, aborted = on_gloo_ranks(_collectives_after_abort, 2, tmp_path)
    said = ("rank 1: the process group of 2 processes was aborted or destroyed (torch.distributed's "
            "_abort_process_group or destroy_process_group) while the run still needed it; this rank "
            "stops before any further step or save")
    assert len(aborted) == 11 and aborted == dict.fromkeys(aborted, said)


def _hand_set_rank(rank: int, port: str, args: list, out_dir, **env) -> subprocess.Popen:
    """One rank as SLURM starts it, in a process group of its own (with its DataLoader workers);
    its stdout and stderr in OUT_DIR/rankR.out and .err."""
    return subprocess.Popen(
        [sys.executable, *args], cwd=REPO, start_new_session=True,
        stdout=open(out_dir / f"rank{rank}.out", "w"), stderr=open(out_dir / f"rank{rank}.err", "w"),
        env=child_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=port, **env))


def _train_args(tmp_path, synthetic_h5, *extra: str) -> list[str]:
    return ["--config", str(write_micro_preset(tmp_path)), "--train-h5", str(synthetic_h5[0]),
            "--out-dir", str(tmp_path), "--run-name", "run", "--batch-size", "4", "--device", "cpu",
            "--workers", "2", "--set", "train.tensorboard=false", *extra]


def _end_all(processes, pids=()) -> None:
    """Kill what is left: the ranks' process groups (SIGKILL ends a stopped process too), then the
    processes started."""
    for pid in {*pids, *(p.pid for p in processes)}:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    for process in processes:
        process.kill()
        process.wait(timeout=30)


@pytest.mark.slow
def test_a_group_aborted_as_rank_0_saves_writes_nothing_and_ends_both_ranks_with_its_line(
        tmp_path, synthetic_h5):
    args = ["tests/multiprocess_runs.py",
            *_train_args(tmp_path, synthetic_h5, "--epochs", "1", "--set", "train.max_steps_per_epoch=2")]
    port = str(find_free_port())
    ranks = [_hand_set_rank(r, port, args, tmp_path, TEST_ABORT_BEFORE_SAVE="0") for r in (0, 1)]
    ended = {}
    try:
        deadline = time.monotonic() + STARTS_WITHIN_S
        while len(ended) < 2 and time.monotonic() < deadline:
            ended.update({r: time.time() for r, p in enumerate(ranks)
                          if r not in ended and p.poll() is not None})
            time.sleep(0.05)
    finally:
        _end_all(ranks)
    aborted_at = float((tmp_path / "aborted_at").read_text())
    said = ("error: rank 0: the process group of 2 processes was aborted or destroyed (torch.distributed's "
            "_abort_process_group or destroy_process_group) while the run still needed it; this rank "
            "stops before any further step or save")
    for rank, process in enumerate(ranks):
        err = (tmp_path / f"rank{rank}.err").read_text()
        assert process.returncode == 2 and "Traceback" not in err, err[-3000:]
        assert message_lines(err)[-1] == said, err[-3000:]
        assert ended[rank] - aborted_at < 30
    assert not list((tmp_path / "run").glob("*.pth"))
    print(f"ranks ended {ended[0] - aborted_at:.1f} s and {ended[1] - aborted_at:.1f} s after the abort")


# -- a rank that dies or freezes: two real ranks with DataLoader workers ----------------------------
STOPPED = (r"rank 1 \(pid \d+\) is stopped \(SIGSTOP\): no sign of life for \d+ s "
           r"\(dist.heartbeat_timeout_s 20 s\)")
KILLED = r"rank {} \(pid \d+\) was killed \(SIGKILL, or out of memory\): "
# torch words one worker's death two ways, by which of its checks sees it first: its SIGCHLD handler
# ("is killed by signal: Killed.") or its queue's timeout ("exited unexpectedly"); the line is ours
WORKER = (r"DataLoader worker \((?:pid \d+\) is killed by signal: Killed\.|pid\(s\) \d+\) exited unexpectedly) "
          r"\(a loader process of this rank: out of memory\? try fewer --workers or a smaller --batch-size\)")
# case: (launcher, the rank signalled, the signal, sent to one of its DataLoader workers, the others' line)
DEATHS = {
    "rank 1 stopped, hand-set": ("hand", 1, signal.SIGSTOP, False, STOPPED + "; the other ranks end"),
    "rank 0 killed, hand-set": ("hand", 0, signal.SIGKILL, False,
                                KILLED.format(0) + r"the job's store it serves at 127\.0\.0\.1:\d+ is gone; "
                                                   "the other ranks end"),
    "rank 1 killed, torchrun": ("torchrun", 1, signal.SIGKILL, False,
                                KILLED.format(1) + r"no sign of life for \d+ s.*; the other ranks end"),
    "a worker of rank 1 killed, torchrun": ("torchrun", 1, signal.SIGKILL, True, "rank 1: " + WORKER),
    "a worker of rank 0 stopped, torchrun": ("torchrun", 0, signal.SIGSTOP, True, (
        r"rank 0's DataLoader worker \d \(pid \d+\) is stopped \(SIGSTOP\): stopped for \d+ s "
        r"\(dist.heartbeat_timeout_s 5 s\); the other ranks end"), "--set", "dist.heartbeat_timeout_s=5"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", DEATHS)
def test_a_rank_that_dies_or_freezes_ends_the_other_within_a_minute_with_its_line(
        tmp_path, synthetic_h5, case):
    launcher, victim, sig, in_worker, line, *extra = DEATHS[case]
    args = _train_args(tmp_path, synthetic_h5, "--epochs", "1000", *extra)
    logs, survivor, pids = tmp_path / "logs", 1 - victim, {}
    if launcher == "hand":
        port = str(find_free_port())
        processes = [_hand_set_rank(r, port, ["train_distributed.py", *args], tmp_path) for r in (0, 1)]
        pids = {r: p.pid for r, p in enumerate(processes)}
    else:
        processes = [subprocess.Popen(torchrun(logs, *args), cwd=REPO, env=child_env(),
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        deadline = time.monotonic() + STARTS_WITHIN_S
        while logged_steps(tmp_path / "run") < 2 and time.monotonic() < deadline \
                and all(p.poll() is None for p in processes):
            time.sleep(0.1)
        assert logged_steps(tmp_path / "run") >= 2, "the run did not start"
        if launcher == "torchrun":
            pids = worker_pids(processes[0].pid)
        survivors = {pids[survivor], *descendants(pids[survivor])}     # with its workers
        if in_worker:
            os.kill(min(descendants(pids[victim])), sig)     # as the out-of-memory killer does
        else:
            os.killpg(pids[victim], sig)                     # the rank and its workers
        signalled = time.monotonic()
        while still_running({pids[survivor]}) and time.monotonic() - signalled < ENDS_WITHIN_S + 30:
            time.sleep(0.1)
        took = time.monotonic() - signalled
        while still_running(survivors) and time.monotonic() - signalled < took + 10:
            time.sleep(0.1)                          # its workers notice within 5 s
        left = still_running(survivors)
        while in_worker and still_running({pids[victim]}) and time.monotonic() - signalled < ENDS_WITHIN_S:
            time.sleep(0.1)                          # it ends too, its own line said first
    finally:
        _end_all(processes, pids.values())
    err = (tmp_path / f"rank{survivor}.err").read_text() if launcher == "hand" else \
        worker_log(logs, 0, survivor, "stderr")
    assert took <= ENDS_WITHIN_S, f"rank {survivor} still ran {took:.0f} s after the signal:\n{err[-3000:]}"
    assert "Traceback" not in err and re.fullmatch("error: " + line, message_lines(err)[-1]), err[-3000:]
    if in_worker:
        own = worker_log(logs, 0, victim, "stderr")
        assert "Traceback" not in own, own[-3000:]
        own_line = WORKER if sig == signal.SIGKILL else line
        assert re.fullmatch("error: " + own_line, message_lines(own)[-1]), own[-3000:]
    assert not left, f"processes of rank {survivor} left behind: {left}"
    print(f"{case}: rank {survivor} ended {took:.1f} s after the signal")
