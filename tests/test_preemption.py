"""A stopped run loses nothing: real `train.py` processes SIGKILLed at random moments resume with
`--resume auto` to the same weights as a run never stopped; SIGTERM / SIGUSR1 (one process, or one
rank of two under torchrun) finish the step, save once, say how to resume, and the resumed run
stays on the same epoch, step and LR curve; DataLoader workers signalled while they start live on;
K consecutive bad steps (non-finite loss) stop the run with one error line and leave the last good
checkpoint untouched; fp16 scaler overflows are skipped and counted.

The helpers at the top (micro model preset, clean environment, torchrun command, stderr without
progress bars, worker pids of a torchrun agent) are shared with test_elastic_restart.py and
bad_inputs.py.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import train
from config.loader import build_config
from runtime.checkpoint import TEMP_SUFFIX, load_checkpoint
from engine.checkpoints import find_latest_checkpoint
from engine.cli import run_main
from engine.loaders import PersistentWorkersLoader, ignore_stop_signals
from engine.optim import lr_at
from child_env import child_env


REPO = Path(__file__).resolve().parents[1]
# A model of ~20k parameters on 64 px inputs: a step takes a fraction of a second on one core.
MICRO_PRESET = """\
base: tiny
model: {stacks: 1, depth: 2, channels: 12, increase: 4, head_channels: 8, stem_channels: 4, se_reduction: 4}
loss: {scale_weights: [0.1, 0.4, 1.6]}
data: {input_size: 64, workers: 0}
train: {batch_size: 2, log_every: 1, tensorboard: false, val_every: 0}
"""
PROGRESS_BAR = re.compile(r"^[^|]*: *\d+%\|")   # a tqdm bar: "DESCRIPTION:  40%|████  | 2/5 ..."


# -- helpers shared by the reliability tests -------------------------------------------------------
def write_micro_preset(directory: Path) -> Path:
    path = Path(directory) / "micro.yaml"
    path.write_text(MICRO_PRESET)
    return path


def start(command: list, env: dict | None = None, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(command, cwd=REPO, env=env or child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


def torchrun(log_dir: Path, *args: str, restarts: int = 0, launcher: str = "torch.distributed.run") -> list:
    """torchrun (or `launcher`, such as the project's runtime.launch) with 2 local CPU workers whose
    stdout/stderr go to LOG_DIR/*/attempt_N/RANK/."""
    return [sys.executable, "-m", launcher, "--standalone", "--nproc_per_node", "2",
            "--max-restarts", str(restarts), "--monitor-interval", "0.2", "--log-dir", str(log_dir),
            "--redirects", "3", "train_distributed.py", "--device", "cpu", *args]


def worker_log(log_dir: Path, attempt: int, rank: int, stream: str) -> str:
    (path,) = Path(log_dir).glob(f"*/attempt_{attempt}/{rank}/{stream}.log")
    return path.read_text()


def message_lines(stderr: str) -> list[str]:
    """The lines of `stderr` that are not progress bars (tqdm redraws them with carriage returns).

    A message glued to the end of a bar is dropped with it, so a test expecting it then fails.
    """
    pieces = re.split(r"[\r\n]", stderr)
    return [p.strip() for p in pieces if p.strip() and not PROGRESS_BAR.match(p.strip())]


def read_metrics(run_dir: Path, kind: str = "train") -> list[dict]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def wait_until(predicate, process: subprocess.Popen, what: str, timeout: float = 120.0) -> None:
    """Poll `predicate` every 20 ms; fail if `process` ends first or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if process.poll() is not None:
            out, err = process.communicate()
            raise AssertionError(f"process ended (rc {process.returncode}) before {what}:\n{err[-3000:]}")
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"no {what} within {timeout} s")
        time.sleep(0.02)


def logged_steps(run_dir: Path) -> int:
    try:
        return len(read_metrics(run_dir))
    except (FileNotFoundError, json.JSONDecodeError):   # not written yet, or a line half written
        return 0


def last_logged_step(run_dir: Path) -> int:
    """The step of the last train record (0 before the first one, or while a line is half written):
    a resumed run appends from its resume point, so this is where the run is now."""
    try:
        return ([0] + [record["step"] for record in read_metrics(run_dir)])[-1]
    except (FileNotFoundError, json.JSONDecodeError):
        return 0


def worker_pids(agent_pid: int) -> dict[int, int]:
    """{rank: pid} of the worker processes that a torchrun agent started (from /proc)."""
    children = []
    for task in Path(f"/proc/{agent_pid}/task").iterdir():
        children += (task / "children").read_text().split()
    ranks = {}
    for pid in map(int, children):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        variables = dict(item.split(b"=", 1) for item in environ if b"=" in item)
        if b"RANK" in variables:
            ranks[int(variables[b"RANK"])] = pid
    return ranks


def finish(process: subprocess.Popen, timeout: float = 120.0) -> tuple[int, str, str]:
    out, err = process.communicate(timeout=timeout)
    return process.returncode, out, err


# -- SIGKILL at random moments ----------------------------------------------------------------------
KILLS = 3
KILL_EPOCHS, KILL_STEPS = 16, 2   # a checkpoint every 2 steps: kills land in steps, saves and plots


@pytest.mark.slow
def test_sigkill_at_random_moments_resume_auto_ends_with_the_weights_of_an_unstopped_run(
        tmp_path, synthetic_h5):
    preset = write_micro_preset(tmp_path)
    common = ["train.py", "--config", str(preset), "--train-h5", str(synthetic_h5[0]),
              "--out-dir", str(tmp_path), "--epochs", str(KILL_EPOCHS),
              "--set", f"train.max_steps_per_epoch={KILL_STEPS}"]
    straight = start([sys.executable, *common, "--run-name", "straight"])
    command = [sys.executable, *common, "--run-name", "killed", "--resume", "auto"]
    last = tmp_path / "killed" / "last.pth"
    rng = random.Random(11)
    saved_steps = [0]
    for kill in range(KILLS):
        before = last.stat().st_mtime_ns if last.exists() else None
        process = start(command)
        # kill only after this process saved once, so every round makes progress
        wait_until(lambda: last.exists() and last.stat().st_mtime_ns != before, process,
                   f"a new last.pth in round {kill + 1}")
        # at a random moment, but soon enough that every later round still has two epochs left:
        # a micro run finishes 8 epochs in about 1.2 s on a quiet machine
        deadline = time.monotonic() + rng.uniform(0.0, 1.2)
        latest = (KILL_EPOCHS - 2 * (KILLS - kill)) * KILL_STEPS
        while time.monotonic() < deadline and last_logged_step(last.parent) < latest:
            time.sleep(0.01)
        process.send_signal(signal.SIGKILL)
        rc, out, _ = finish(process)
        assert rc == -signal.SIGKILL, f"round {kill + 1} ended by itself, not by the kill"
        assert ("resumed from" in out) == (kill > 0)
        assert find_latest_checkpoint(last.parent) == last
        state = load_checkpoint(last)
        assert state["iteration"] == 0 and state["step"] == state["epoch"] * KILL_STEPS
        assert state["step"] > saved_steps[-1]
        saved_steps.append(state["step"])
    rc, out, err = finish(start(command))
    assert rc == 0, err[-3000:]
    assert f"resumed from {last}: epoch {saved_steps[-1] // KILL_STEPS + 1}, batch 0" in out
    rc, _, err = finish(straight)
    assert rc == 0, err[-3000:]
    resumed, unstopped = load_checkpoint(last), load_checkpoint(tmp_path / "straight" / "last.pth")
    assert resumed["step"] == unstopped["step"] == KILL_EPOCHS * KILL_STEPS
    assert all(torch.equal(resumed["model"][k], unstopped["model"][k]) for k in unstopped["model"])
    assert not list(last.parent.glob(f"*{TEMP_SUFFIX}"))
    print(f"saved steps at the kills: {saved_steps[1:]}")


# -- SIGTERM / SIGUSR1 --------------------------------------------------------------------------------
SIGNAL_EPOCHS, SIGNAL_STEPS = 2, 10
SIGNAL_SETS = [f"train.max_steps_per_epoch={SIGNAL_STEPS}", "optim.milestones=[1]",
               "optim.decay_factor=0.5"]


def resume_hint(stderr: str, run_dir: Path) -> str:
    line = message_lines(stderr)[-1]
    assert line.endswith(f"saved {run_dir / 'last.pth'}. Resume with the same command and "
                         f"--resume auto --run-name {run_dir.name}"), line
    return line


def signal_those_past_two_steps(waiting: dict, out_dir: Path) -> dict:
    """Send each run of `waiting` ({signal: process}, run named after the signal) its signal once
    it has logged two steps, and drop it from `waiting`; returns what still waits."""
    for sig, process in list(waiting.items()):
        if process.poll() is not None:
            out, err = process.communicate()
            raise AssertionError(f"the {sig.name} run ended (rc {process.returncode}) before two "
                                 f"logged steps:\n{err[-3000:]}")
        if logged_steps(out_dir / sig.name) >= 2:
            process.send_signal(sig)
            del waiting[sig]
    return waiting


@pytest.mark.slow
def test_sigterm_and_sigusr1_finish_the_step_save_and_resume_on_the_same_lr_curve(
        tmp_path, synthetic_h5):
    preset = write_micro_preset(tmp_path)
    sets = [arg for item in SIGNAL_SETS for arg in ("--set", item)]
    commands, processes = {}, {}
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        commands[sig] = [sys.executable, "train.py", "--config", str(preset), "--train-h5",
                         str(synthetic_h5[0]), "--out-dir", str(tmp_path), "--run-name", sig.name,
                         "--epochs", str(SIGNAL_EPOCHS), *sets]
        processes[sig] = start(commands[sig])
    # each is signalled as soon as it has logged two steps: waiting on one first would let the
    # other run on into its second epoch
    waiting, deadline = dict(processes), time.monotonic() + 120
    while signal_those_past_two_steps(waiting, tmp_path):
        if time.monotonic() > deadline:
            for process in processes.values():
                process.kill()
            raise AssertionError(f"no two logged steps within 120 s: {[s.name for s in waiting]}")
        time.sleep(0.02)
    resumed = {}
    for sig, process in processes.items():
        run_dir = tmp_path / sig.name
        rc, _, err = finish(process)
        assert rc == 2 and "Traceback" not in err
        line = resume_hint(err, run_dir)
        state = load_checkpoint(run_dir / "last.pth")
        batch = state["iteration"]
        assert line.startswith(f"stopped by {sig.name} at epoch 1, batch {batch}; ")
        assert state["epoch"] == 0 and 2 <= batch < SIGNAL_STEPS and state["step"] == batch
        assert logged_steps(run_dir) == batch        # the step under way was finished and counted
        resumed[sig] = start(commands[sig] + ["--resume", "auto"])
    cfg = build_config(str(preset), sets=SIGNAL_SETS)
    for sig, process in resumed.items():
        run_dir = tmp_path / sig.name
        rc, out, err = finish(process)
        assert rc == 0, err[-3000:]
        assert load_checkpoint(run_dir / "last.pth")["step"] == SIGNAL_EPOCHS * SIGNAL_STEPS
        assert re.search(r"resumed from .*last\.pth: epoch 1, batch \d+, step \d+", out)
        records = read_metrics(run_dir)
        assert [r["step"] for r in records] == list(range(1, SIGNAL_EPOCHS * SIGNAL_STEPS + 1))
        for r in records:
            epoch, iteration = divmod(r["step"] - 1, SIGNAL_STEPS)
            assert r["epoch"] == epoch
            assert r["lr"] == pytest.approx(lr_at(cfg.optim, epoch, iteration, SIGNAL_STEPS), rel=1e-12)
        lrs = [r["lr"] for r in records]
        assert lrs[SIGNAL_STEPS] == pytest.approx(0.5 * lrs[SIGNAL_STEPS - 1])   # the milestone


def start_torchrun_signal_run(tmp_path, synthetic_h5, name: str, *extra: str,
                              launcher: str = "torch.distributed.run", **popen):
    """(agent, run directory, log directory) of a 2-rank torchrun (or `launcher`) run of the signal tests."""
    preset = write_micro_preset(tmp_path)
    logs = tmp_path / "logs"
    agent = start(torchrun(logs, "--config", str(preset), "--train-h5", str(synthetic_h5[0]),
                           "--out-dir", str(tmp_path), "--run-name", name, "--batch-size", "4",
                           "--epochs", str(SIGNAL_EPOCHS), *extra,
                           *[arg for item in SIGNAL_SETS for arg in ("--set", item)],
                           launcher=launcher), **popen)
    return agent, tmp_path / name, logs


@pytest.mark.slow
def test_sigterm_to_one_rank_under_torchrun_stops_both_ranks_at_the_same_step_with_one_checkpoint(
        tmp_path, synthetic_h5):
    agent, run_dir, logs = start_torchrun_signal_run(tmp_path, synthetic_h5, "ddp")
    wait_until(lambda: logged_steps(run_dir) >= 2, agent, "two logged steps")
    workers = worker_pids(agent.pid)
    assert sorted(workers) == [0, 1]
    os.kill(workers[1], signal.SIGTERM)              # rank 1 only: rank 0 saves by agreement
    rc, _, agent_err = finish(agent)
    assert rc != 0                                   # the workers exit with the Interrupted code
    assert "exitcode: 2" in agent_err
    state = load_checkpoint(run_dir / "last.pth")
    batch = state["iteration"]
    assert state["epoch"] == 0 and 2 <= batch < SIGNAL_STEPS and state["step"] == batch
    assert state["world_size"] == 2 and state["mode"] == "ddp"
    assert sorted(p.name for p in run_dir.iterdir() if p.suffix == ".pth" or TEMP_SUFFIX in p.name) \
        == ["last.pth"]
    rank0, rank1 = (worker_log(logs, 0, rank, "stderr") for rank in (0, 1))
    assert "Traceback" not in rank0 + rank1
    assert resume_hint(rank0, run_dir).startswith(
        f"stopped by a signal on another rank at epoch 1, batch {batch}; ")
    assert resume_hint(rank1, run_dir).startswith(f"stopped by SIGTERM at epoch 1, batch {batch}; ")


# -- the signal to the process group, as a scheduler sends it, with DataLoader workers ---------------
@pytest.mark.slow
def test_sigterm_to_the_group_of_the_projects_launcher_saves_ends_it_with_code_2_and_resume_auto_continues(
        tmp_path, synthetic_h5):
    agent, run_dir, logs = start_torchrun_signal_run(tmp_path, synthetic_h5, "group", "--workers", "2",
                                                     launcher="runtime.launch", start_new_session=True)
    wait_until(lambda: logged_steps(run_dir) >= 2, agent, "two logged steps")
    os.killpg(agent.pid, signal.SIGTERM)       # agent, both ranks and their four DataLoader workers
    rc, _, agent_err = finish(agent)
    state = load_checkpoint(run_dir / "last.pth")
    batch = state["iteration"]
    assert state["epoch"] == 0 and 2 <= batch < SIGNAL_STEPS and state["step"] == batch
    hint = f"stopped by SIGTERM at epoch 1, batch {batch}; "
    for rank in (0, 1):
        err = worker_log(logs, 0, rank, "stderr")
        assert "Traceback" not in err and "killed by signal" not in err, err[-3000:]
        assert resume_hint(err, run_dir).startswith(hint)
    # plain torchrun would end with 1 and its SignalException's traceback (torch's own handler)
    assert rc == 2 and "Traceback" not in agent_err, agent_err[-3000:]
    assert resume_hint(agent_err, run_dir).startswith(hint) and agent_err.count("stopped by") == 1
    rc, _, err = finish(start(agent.args + ["--resume", "auto"]))
    assert rc == 0, err[-3000:]
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    assert records[-1]["epoch"] == SIGNAL_EPOCHS - 1 and load_checkpoint(run_dir / "last.pth")["step"] \
        == len(records) > batch


STARTING = "stopped by SIGTERM; the last completed checkpoint is kept"


def catches(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler for `sig` (the SigCgt mask of /proc/PID/status)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["while torch imports", "once the run folder is written"])
def test_sigterm_to_the_group_of_a_starting_run_ends_it_with_one_line_and_the_command_runs_again(
        tmp_path, synthetic_h5, moment):
    """Before the first step the run's own handler (save, then code 2) is not yet in place: a
    SIGTERM then ends it with code 143 and one line, where it used to end it silently. The run then
    starts again: the same command where no run folder was written, else with `--resume auto`, as
    the same command's refusal says (a folder with config.yaml is a run stopped before its first
    checkpoint)."""
    command = [sys.executable, "train.py", "--config", str(write_micro_preset(tmp_path)), "--train-h5",
               str(synthetic_h5[0]), "--out-dir", str(tmp_path), "--run-name", "run", "--device", "cpu",
               "--workers", "2", "--epochs", "1", "--set", "train.max_steps_per_epoch=2"]
    process = start(command, start_new_session=True)
    if moment == "while torch imports":     # once it catches SIGTERM: then it reads argv, imports torch
        wait_until(lambda: catches(process.pid, signal.SIGTERM), process, "a SIGTERM handler")
    else:
        wait_until(lambda: (tmp_path / "run" / "config.yaml").exists(), process, "the run folder")
    os.killpg(process.pid, signal.SIGTERM)
    rc, out, err = finish(process)
    lines = message_lines(err)
    assert "Traceback" not in err and lines, err[-3000:]
    if rc == 2:     # the run was quicker than the signal: it had trained a step, saved and said so
        assert moment != "while torch imports" and lines[-1].startswith("stopped by SIGTERM at epoch 1")
    else:
        assert rc == 143 and lines[-1] == STARTING, err[-3000:]
        assert moment != "while torch imports" or not tmp_path.joinpath("run").exists()
    rc, _, err = finish(start(command + (["--resume", "auto"] if (tmp_path / "run").exists() else [])))
    assert rc == 0 and load_checkpoint(tmp_path / "run" / "last.pth")["step"] == 2, err[-3000:]


def _slow_to_start(worker_id: int) -> None:
    """Waits in the window a signal can hit (torch's SIGTERM handler is in place, ours not yet)
    until the test's SIGTERM has come: it is pending (blocked), or it killed this worker."""
    deadline = time.monotonic() + 60
    while signal.SIGTERM not in signal.sigpending() and time.monotonic() < deadline:
        time.sleep(0.01)
    ignore_stop_signals(worker_id)


@pytest.mark.slow
def test_dataloader_workers_signalled_while_they_start_live_on_and_serve_every_sample():
    # torchrun and SLURM signal the whole group, possibly as the workers of a loader are forked
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    loader = PersistentWorkersLoader(list(range(8)), batch_size=2, num_workers=2, persistent_workers=True,
                                     worker_init_fn=_slow_to_start)
    iterator = iter(loader)
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == mask    # this process's mask is back
    pids = [str(worker.pid) for worker in iterator._workers]
    # sent by another process, as torchrun and SLURM send it (torch's handler spares the parent's)
    subprocess.run([sys.executable, "-c", "import os, signal, sys\n"
                    "for pid in sys.argv[1:]: os.kill(int(pid), signal.SIGTERM)", *pids], check=True)
    assert sorted(int(x) for batch in iterator for x in batch) == list(range(8))
    assert all(worker.is_alive() for worker in iterator._workers)
    iterator._shutdown_workers()


@pytest.mark.slow
def test_sigterm_to_the_process_group_during_validation_stops_within_a_batch_and_resume_validates_again(
        tmp_path, synthetic_h5):
    preset = write_micro_preset(tmp_path)
    command = [sys.executable, "tests/multiprocess_runs.py", "--config", str(preset), "--device", "cpu",
               "--train-h5", str(synthetic_h5[0]), "--val-h5", str(synthetic_h5[1]), "--workers", "2",
               "--val-every", "1", "--out-dir", str(tmp_path), "--run-name", "val", "--epochs", "2",
               "--set", "train.max_steps_per_epoch=2"]
    # 8 validation samples of 1.5 s each in 2 workers: the validation alone takes 6 s
    process = start(command, env=child_env(TEST_SLOW_VAL="1.5"), start_new_session=True)
    last = tmp_path / "val" / "last.pth"
    wait_until(last.exists, process, "last.pth of epoch 1")
    os.killpg(process.pid, signal.SIGTERM)
    signalled = time.monotonic()
    rc, _, err = finish(process)
    stopped_after = time.monotonic() - signalled
    assert rc == 2 and "Traceback" not in err, err[-3000:]
    assert resume_hint(err, last.parent).startswith(
        "stopped by SIGTERM while validating epoch 1 (resuming validates it again); ")
    state = load_checkpoint(last)
    assert (state["epoch"], state["iteration"], state["step"], state["validation_pending"]) == (1, 0, 2, True)
    assert stopped_after < 12, stopped_after    # one batch and the workers' shutdown, not the rest
    rc, out, err = finish(start(command + ["--resume", "auto"]))
    assert rc == 0, err[-3000:]
    assert [r["epoch"] for r in read_metrics(last.parent, "val")] == [0, 1]
    assert load_checkpoint(last)["step"] == 4


# Ctrl-C landing in the parent's side of a fork (a DataLoader worker's), in an at-fork hook such as
# logging's: Python prints "Exception ignored" and drops that KeyboardInterrupt
SWALLOWED_CTRL_C = """\
import os, runpy, signal, sys
fired = []
def swallowing():
    if not fired:
        fired.append(True)
        signal.raise_signal(signal.SIGINT)
        sum(range(1000))
os.register_at_fork(after_in_parent=swallowing)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_a_ctrl_c_whose_keyboardinterrupt_a_fork_hook_swallowed_still_ends_the_run_at_the_next_step(
        tmp_path, synthetic_h5):
    preset = write_micro_preset(tmp_path)
    rc, out, err = finish(start([sys.executable, "-c", SWALLOWED_CTRL_C, "train.py", "--config", str(preset),
                                 "--train-h5", str(synthetic_h5[0]), "--workers", "2", "--device", "cpu",
                                 "--out-dir", str(tmp_path), "--run-name", "r", "--epochs", "2",
                                 "--set", "train.max_steps_per_epoch=3"]))
    assert "Exception ignored" in err and "KeyboardInterrupt" in err, err[-3000:]   # it was swallowed
    lines = message_lines(err)
    assert rc == 130 and lines[-1] == "interrupted (Ctrl-C); the last completed checkpoint is kept", err[-3000:]
    assert not (tmp_path / "r" / "last.pth").exists()         # it ended at its first step, not later


# -- bad steps ------------------------------------------------------------------------------------
def in_process(tmp_path, synthetic_h5, *args: str) -> dict:
    preset = write_micro_preset(tmp_path)
    return train.main(["--config", str(preset), "--train-h5", str(synthetic_h5[0]),
                       "--out-dir", str(tmp_path), "--set", "train.max_steps_per_epoch=3", *args])


def test_non_finite_loss_stops_after_k_bad_steps_and_keeps_the_last_good_checkpoint(
        tmp_path, synthetic_h5, capsys):
    in_process(tmp_path, synthetic_h5, "--epochs", "1", "--run-name", "nan")
    last = tmp_path / "nan" / "last.pth"
    good = last.read_bytes()
    capsys.readouterr()
    # LR 1e30: the first step of epoch 2 blows the weights up, every later loss is not finite
    argv = ["--train-h5", str(synthetic_h5[0]), "--out-dir", str(tmp_path), "--run-name", "nan",
            "--resume", "auto", "--epochs", "3", "--lr", "1e30", "--set", "optim.max_bad_steps=2",
            "--set", "train.max_steps_per_epoch=6"]
    with pytest.raises(SystemExit) as stop:
        run_main(train.main, argv)
    assert stop.value.code == 3
    err = message_lines(capsys.readouterr().err)
    assert err == [f"error: 2 consecutive steps had a non-finite or abnormal loss or gradients "
                   f"(last loss nan); stopped. The last good checkpoint is {last}: lower optim.lr, "
                   "enable --clip-grad, or use O0"]
    assert last.read_bytes() == good
    records = read_metrics(tmp_path / "nan")
    assert [r["skipped_steps"] for r in records] == [0, 0, 0, 0, 1]   # 3 good, 1 good, 1 bad logged


def test_fp16_scaler_overflows_are_skipped_and_counted(tmp_path, synthetic_h5, capsys):
    # a dynamic loss scale of 2^24 overflows float16 gradients: the scaler halves it at each skip.
    # A run whose every step was such a back-off is the scaler finding its range, not divergence:
    # it says so and saves the lowered scale (a bad loss at every step still ends diverged: test_train)
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        run_main(lambda argv: in_process(tmp_path, synthetic_h5, *argv),
                 ["--epochs", "1", "--run-name", "fp16", "--opt-level", "O1", "--amp-dtype", "float16",
                  "--set", "amp.init_scale=16777216"])
    assert stop.value.code == 0
    assert "all 3 steps of this run overflowed the dynamic loss scale, which backed off to 2.09715e+06: no " \
           "weight changed yet; last.pth keeps the lowered scale" in capsys.readouterr().out
    assert [r["skipped_steps"] for r in read_metrics(tmp_path / "fp16")] == [1, 2, 3]
    assert load_checkpoint(tmp_path / "fp16" / "last.pth")["scaler"]["scale"] == 2.0 ** 21


def test_every_step_overflowing_a_fixed_loss_scale_names_the_scale_not_the_learning_rate(
        tmp_path, synthetic_h5, capsys):
    """Issue 47: a fixed --loss-scale of 2^24 overflows float16's gradients at every step; the stop
    used to say "lower optim.lr, enable --clip-grad, or use O0"."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        run_main(lambda argv: in_process(tmp_path, synthetic_h5, *argv),
                 ["--epochs", "1", "--run-name", "fixed", "--opt-level", "O1", "--amp-dtype", "float16",
                  "--loss-scale", "16777216", "--set", "optim.max_bad_steps=2"])
    assert stop.value.code == 3
    err = message_lines(capsys.readouterr().err)[-1]
    assert err.startswith("error: 2 consecutive steps had a non-finite or abnormal loss or gradients")
    assert err.endswith("stopped. No checkpoint was written before: the fixed loss scale 1.67772e+07 "
                        "(--loss-scale) overflowed float16's gradients at each: use --loss-scale dynamic or "
                        "a lower number")
