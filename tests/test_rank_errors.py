"""Ranks decide together. An error on one rank ends every rank within seconds with the same
one-line error: two real `train_distributed.py` processes on gloo, launched with hand-set RANK /
WORLD_SIZE / MASTER_* as SLURM without torchrun (or mpirun) sets them. Rank 0 decides what only it
checks (the run directory, the checkpoint `--resume auto` takes) and hands its answer or its error
to every rank; a rank that fails before the process group exists leaves its error in the
rendezvous store."""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import pytest

import train
from child_env import child_env, find_free_port
from multiprocess_runs import BAD_DATA_MESSAGE, CRASH_MESSAGE, dumps, forked_launch, ranks_identical
from test_preemption import REPO, catches, message_lines, wait_until, write_micro_preset

pytestmark = pytest.mark.slow          # every test here starts processes


def hand_set_ranks(args_of_rank, timeout: float = 120.0, script: str = "train_distributed.py",
                   **env) -> tuple[list, float]:
    """Both ranks of `script` as SLURM sets them; (return code, stderr) per rank and the seconds
    between the first rank's end and the last one's."""
    port = str(find_free_port())
    processes = [subprocess.Popen(
        [sys.executable, script, *args_of_rank(rank)], cwd=REPO, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=child_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=port, **env)) for rank in (0, 1)]
    ended = {}
    deadline = time.monotonic() + timeout
    while len(ended) < 2 and time.monotonic() < deadline:
        for rank, process in enumerate(processes):
            if rank not in ended and process.poll() is not None:
                ended[rank] = time.monotonic()
        time.sleep(0.05)
    results = []
    for process in processes:
        if process.poll() is None:
            process.kill()
        _, err = process.communicate()
        results.append((process.returncode, err))
    assert len(ended) == 2, f"a rank still ran {timeout} s later: {[err[-1500:] for _, err in results]}"
    return results, max(ended.values()) - min(ended.values())


def common_args(tmp_path, synthetic_h5) -> list[str]:
    return ["--config", str(write_micro_preset(tmp_path)), "--train-h5", str(synthetic_h5[0]),
            "--out-dir", str(tmp_path), "--run-name", "run", "--batch-size", "4", "--epochs", "1",
            "--set", "train.max_steps_per_epoch=1", "--set", "dist.timeout_s=60"]


def a_run_in_the_way(tmp_path) -> str:
    """The error line of a run started where another one is."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    return (f"error: {tmp_path / 'run'} already holds a run: pass --resume auto to continue it, "
            "--overwrite to replace it, or choose another --run-name")


def test_a_run_directory_that_holds_a_run_is_the_same_error_on_every_rank(tmp_path, synthetic_h5):
    expected = [a_run_in_the_way(tmp_path)]
    args = common_args(tmp_path, synthetic_h5) + ["--device", "cpu"]
    results, spread = hand_set_ranks(lambda rank: args)
    for rc, err in results:
        assert rc == 2 and "Traceback" not in err and message_lines(err) == expected, err[-2000:]
    assert spread < 10


def test_the_projects_launcher_ends_with_a_ranks_error_line_and_code_not_torchs_traceback(
        tmp_path, synthetic_h5):
    expected = a_run_in_the_way(tmp_path)       # plain torchrun: exit 1 and a ChildFailedError traceback
    proc = subprocess.run([sys.executable, "-m", "runtime.launch", "--standalone", "--nproc_per_node", "2",
                           "train_distributed.py", *common_args(tmp_path, synthetic_h5), "--device", "cpu"],
                          cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert message_lines(proc.stderr)[-1] == expected


@pytest.mark.parametrize("failing", [1, 0])
def test_a_rank_that_fails_before_the_group_exists_ends_every_rank_with_its_error(tmp_path, synthetic_h5,
                                                                                 failing):
    # that rank's node has no GPU for its --device cuda: the other would wait dist.timeout_s
    args = common_args(tmp_path, synthetic_h5)
    results, spread = hand_set_ranks(lambda rank: args + ["--device", "cuda" if rank == failing else "cpu"])
    error = "--device cuda: no CUDA GPU is visible here; use --device cpu"
    for rank, (rc, err) in enumerate(results):
        assert rc == 2 and "Traceback" not in err, err[-2000:]
        assert message_lines(err) == [f"error: {'' if rank == failing else f'rank {failing}: '}{error}"]
    assert spread < 10


def test_bad_data_met_by_one_rank_mid_training_ends_every_rank_with_its_error(tmp_path, synthetic_h5):
    args = common_args(tmp_path, synthetic_h5)[:-4] + ["--set", "train.max_steps_per_epoch=4",
                                                        "--device", "cpu"]
    results, spread = hand_set_ranks(lambda rank: args, script="tests/multiprocess_runs.py",
                                     TEST_BAD_DATA="1:2")
    for rank, (rc, err) in enumerate(results):
        assert rc == 2 and "Traceback" not in err, err[-2000:]
        assert message_lines(err)[-1] == f"error: {'rank 1: ' if rank == 0 else ''}{BAD_DATA_MESSAGE}"
    assert spread < 10


def test_a_damaged_picture_read_by_dataloader_workers_is_one_line_on_every_rank(tmp_path, synthetic_h5):
    from test_bad_data_files import damaged_pictures
    damaged = damaged_pictures({"train_h5": synthetic_h5[0]}, tmp_path)
    args = common_args(tmp_path, synthetic_h5)[:-4] + ["--device", "cpu", "--workers", "2"]
    args[args.index(str(synthetic_h5[0]))] = str(damaged)
    results, spread = hand_set_ranks(lambda rank: args)
    for rc, err in results:
        assert rc == 2 and "Traceback" not in err and "Caught" not in err, err[-2000:]
        said = rf"error: (rank \d: )?{re.escape(str(damaged))}: image \d+ \(\S+\) cannot be decoded"
        assert re.fullmatch(said, message_lines(err)[-1]), err[-2000:]
    assert spread < 10


def test_a_failure_of_one_ranks_own_mid_training_ends_the_other_with_its_line(tmp_path, synthetic_h5):
    # not bad input but a bug: that rank shows its traceback, the other one line naming it
    args = common_args(tmp_path, synthetic_h5)[:-4] + ["--set", "train.max_steps_per_epoch=4",
                                                        "--device", "cpu"]
    results, spread = hand_set_ranks(lambda rank: args, script="tests/multiprocess_runs.py",
                                     TEST_CRASH="1:2")
    (rc0, err0), (rc1, err1) = results
    assert rc1 == 1 and f"RuntimeError: {CRASH_MESSAGE}" in err1, err1[-2000:]
    assert rc0 == 2 and "Traceback" not in err0, err0[-2000:]
    assert message_lines(err0)[-1] == f"error: rank 1: RuntimeError: {CRASH_MESSAGE}"
    assert spread < 10


def test_resume_auto_takes_rank_0s_checkpoint_on_every_rank_memory_mapped(tmp_path, synthetic_h5):
    args = common_args(tmp_path, synthetic_h5)[:-4] + ["--set", "train.max_steps_per_epoch=2",
                                                        "--set", "dist.timeout_s=30"]
    train.main([*args, "--epochs", "2", "--save-every", "1", "--device", "cpu"])   # steps 2 and 4
    # rank 1 sees epoch_1.pth as the newest file (a shared filesystem showing it an older state)
    forked_launch([*args, "--epochs", "3", "--resume", "auto"], TEST_STALE_VIEW="epoch_1.pth")
    rank0, rank1 = dumps(tmp_path / "run")
    assert len(rank0["steps"]) == len(rank1["steps"]) == 2          # both resumed at step 4
    assert ranks_identical(rank0, rank1, bn_statistics=False)
    for dump in (rank0, rank1):
        checkpoints = [(name, mmap) for name, mmap in dump["loads"] if name.endswith(".pth")]
        assert checkpoints and all(mmap for _, mmap in checkpoints), checkpoints


def test_rank_0_says_that_it_waits_and_ends_with_the_error_of_a_late_rank_refused_on_its_options(
        tmp_path, synthetic_h5):
    port = str(find_free_port())
    args = common_args(tmp_path, synthetic_h5) + ["--device", "cpu"]

    def start(rank: int, *extra: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "train_distributed.py", *args, *extra], cwd=REPO,
                                text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=child_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                                              MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
    rank0 = start(0)
    said = rank0.stdout.readline()             # the first line it writes, once it waits 10 s
    rank1 = start(1, "--no-such-option")
    try:
        out1, err1 = rank1.communicate(timeout=120)
        out0, err0 = rank0.communicate(timeout=60)   # within seconds of rank 1's end
    finally:
        for process in (rank0, rank1):
            if process.poll() is None:
                process.kill()
                process.communicate()
    assert said.strip() == (f"rank 0: 1 of 2 processes have joined at 127.0.0.1:{port}; waiting for "
                            "the others at most 110 s more (dist.rendezvous_timeout_s 120 s)")
    refused = "unrecognized arguments: --no-such-option (see train_distributed.py --help)"
    assert rank1.returncode == 2 and message_lines(err1) == [f"error: {refused}"], err1[-2000:]
    assert rank0.returncode == 2 and message_lines(err0) == [f"error: rank 1: {refused}"], err0[-2000:]


@pytest.mark.parametrize("ending", ["its rendezvous timeout", "SIGTERM"])
def test_a_rank_that_cannot_reach_rank_0_ends_with_one_line_at_its_timeout_or_at_once_on_sigterm(
        tmp_path, synthetic_h5, ending):
    """Rank 1 started where no rank 0 serves (not yet started, or MASTER_ADDR mistyped): it waits
    up to dist.rendezvous_timeout_s, then says so in one line; torch's own connecting held it the
    whole timeout whatever signal came, then printed a C++ trace above that line."""
    port = str(find_free_port())
    rank1 = subprocess.Popen(
        [sys.executable, "train_distributed.py", *common_args(tmp_path, synthetic_h5), "--device", "cpu",
         "--set", "dist.rendezvous_timeout_s=8"], cwd=REPO, text=True, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, env=child_env(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2",
                                              MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
    if ending == "SIGTERM":               # once its handler is in place, and torch imported (about 2 s)
        wait_until(lambda: catches(rank1.pid, signal.SIGTERM), rank1, "a SIGTERM handler")
        time.sleep(4)
        rank1.terminate()
    signalled = time.monotonic()
    _, err = rank1.communicate(timeout=120)
    said = message_lines(err)
    if ending == "SIGTERM":
        assert rank1.returncode == 143 and time.monotonic() - signalled < 3, err[-2000:]
        assert said == ["stopped by SIGTERM; the last completed checkpoint is kept"], err[-2000:]
    else:
        assert rank1.returncode == 2 and said == [
            f"error: rank 1 could not reach rank 0 at 127.0.0.1:{port} within 8 s "
            "(dist.rendezvous_timeout_s): is rank 0 running there, and MASTER_ADDR / MASTER_PORT the same "
            "on every rank?"], err[-2000:]
