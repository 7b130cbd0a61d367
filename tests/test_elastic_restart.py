"""A rank that dies under `torchrun --max-restarts 1` costs only the work since the last checkpoint:
the agent restarts both gloo workers, `--resume auto --run-name R` in the command makes them resume
from `last.pth`, and the job finishes with the step count of a run never interrupted."""
from __future__ import annotations

import os
import re
import signal

import pytest

from runtime.checkpoint import load_checkpoint
from test_preemption import (finish, read_metrics, start, torchrun, wait_until, worker_log,
                             worker_pids, write_micro_preset)

pytestmark = pytest.mark.slow          # every test here starts processes

EPOCHS, STEPS = 4, 4


def test_a_rank_killed_once_restarts_the_job_which_resumes_and_finishes(tmp_path, synthetic_h5):
    preset = write_micro_preset(tmp_path)
    logs = tmp_path / "logs"
    agent = start(torchrun(logs, "--config", str(preset), "--train-h5", str(synthetic_h5[0]),
                           "--out-dir", str(tmp_path), "--run-name", "R", "--resume", "auto",
                           "--batch-size", "4", "--epochs", str(EPOCHS),
                           "--set", f"train.max_steps_per_epoch={STEPS}", restarts=1))
    last = tmp_path / "R" / "last.pth"
    wait_until(last.exists, agent, "the first last.pth")
    first_workers = worker_pids(agent.pid)
    assert sorted(first_workers) == [0, 1]
    os.kill(first_workers[0], signal.SIGKILL)        # rank 0 crashes (it may be writing a checkpoint)
    rc, _, agent_err = finish(agent, timeout=180)
    assert rc == 0, agent_err[-3000:]
    assert "failed (exitcode: -9) local_rank: 0" in agent_err
    assert sorted(p.name for p in logs.glob("*/attempt_*")) == ["attempt_0", "attempt_1"]
    first_out = worker_log(logs, 0, 0, "stdout")
    restart_out = worker_log(logs, 1, 0, "stdout")
    assert "no checkpoint in" in first_out and "resumed from" not in first_out
    resumed = re.search(r"resumed from (\S+): epoch (\d+), batch 0, step (\d+)", restart_out)
    assert resumed and resumed.group(1) == str(last)
    resumed_step = int(resumed.group(3))
    assert resumed_step >= STEPS and resumed_step == (int(resumed.group(2)) - 1) * STEPS
    assert f"done. checkpoints: {last}" in restart_out
    state = load_checkpoint(last)
    assert (state["epoch"], state["step"], state["world_size"]) == (EPOCHS, EPOCHS * STEPS, 2)
    steps = [r["step"] for r in read_metrics(tmp_path / "R")]
    restarted_at = max(i for i, s in enumerate(steps) if s == resumed_step + 1)
    assert steps[restarted_at:] == list(range(resumed_step + 1, EPOCHS * STEPS + 1))
    assert "Traceback" not in worker_log(logs, 1, 0, "stderr") + worker_log(logs, 1, 1, "stderr")
