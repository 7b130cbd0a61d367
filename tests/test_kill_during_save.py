"""SIGKILL at random moments of a process that saves checkpoints in a loop (also mid-write) never
costs more than the checkpoint being written: the newest valid one is always found and loads."""
from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine.checkpoints import find_latest_checkpoint
from runtime.checkpoint import TEMP_SUFFIX, load_checkpoint, save_checkpoint

pytestmark = pytest.mark.slow          # every test here starts processes

REPO = Path(__file__).resolve().parents[1]
KILLS = 20
PAYLOAD = 500_000      # floats per checkpoint (2 MB): a save takes long enough to be hit

# One long-lived helper imports torch once, then forks a fresh saver per round (each saver resumes
# from the newest checkpoint like `--resume auto`, then saves last.pth and every 5 steps epoch_N.pth
# without pause), reports the saver's pid, and reports how it died.
HELPER = f"""
import os, sys, torch
from engine.checkpoints import find_latest_checkpoint
from runtime.checkpoint import load_checkpoint, save_checkpoint
run_dir = sys.argv[1]
print("ready", flush=True)
for _ in sys.stdin:
    pid = os.fork()
    if pid == 0:
        try:
            step = load_checkpoint(find_latest_checkpoint(run_dir))["step"]
            base = torch.arange({PAYLOAD}, dtype=torch.float32)
            while True:
                step += 1
                state = {{"step": step, "epoch": step // 5, "weights": base + step}}
                save_checkpoint(os.path.join(run_dir, "last.pth"), state)
                if step % 5 == 0:
                    save_checkpoint(os.path.join(run_dir, f"epoch_{{step // 5}}.pth"), state)
        finally:
            os._exit(1)
    print(pid, flush=True)
    _, status = os.waitpid(pid, 0)
    print("signal", os.WTERMSIG(status) if os.WIFSIGNALED(status) else -1, flush=True)
"""


def read_line(process: subprocess.Popen, timeout: float = 30.0) -> str:
    if not select.select([process.stdout], [], [], timeout)[0]:
        raise AssertionError(f"helper said nothing for {timeout} s")
    return process.stdout.readline().decode().strip()


def test_sigkill_at_random_moments_always_leaves_a_loadable_latest_checkpoint(tmp_path):
    save_checkpoint(tmp_path / "last.pth", {"step": 0, "epoch": 0,
                                            "weights": torch.arange(PAYLOAD, dtype=torch.float32)})
    env = dict(os.environ, PYTHONPATH=str(REPO))
    helper = subprocess.Popen([sys.executable, "-c", HELPER, str(tmp_path)], cwd=REPO, env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
    rng = random.Random(7)
    steps, killed_mid_write = [0], 0
    try:
        assert read_line(helper, timeout=60) == "ready"
        for _ in range(KILLS):
            helper.stdin.write(b"go\n")
            saver = int(read_line(helper))
            time.sleep(rng.uniform(0.05, 0.4))
            os.kill(saver, signal.SIGKILL)
            assert read_line(helper) == f"signal {int(signal.SIGKILL)}"   # killed, not crashed
            temps = [p for p in tmp_path.iterdir() if p.name.endswith(TEMP_SUFFIX)]
            killed_mid_write += bool(temps)
            assert len(temps) <= 1
            latest = find_latest_checkpoint(tmp_path)
            assert latest == tmp_path / "last.pth"
            state = load_checkpoint(latest)
            assert torch.equal(state["weights"], torch.arange(PAYLOAD, dtype=torch.float32) + state["step"])
            assert state["step"] >= steps[-1]
            steps.append(state["step"])
    finally:
        helper.stdin.close()
        helper.kill()
        helper.wait(timeout=30)
    print(f"steps after each kill: {steps}; kills during a save: {killed_mid_write}")
    assert steps[-1] > KILLS                 # the savers made progress across the kills
    assert killed_mid_write >= 1, "no kill landed during a save: the test did not test that"


# A saver that plants the temporary file of an earlier killed save, then is SIGKILLed by its own
# torch.save after half of the checkpoint is written: the kill pattern of repeated pre-emptions.
KILLED_MID_WRITE = """
import os, signal, sys, torch
from runtime import checkpoint
run_dir = sys.argv[1]
with open(os.path.join(run_dir, ".last.pth.earlier" + checkpoint.TEMP_SUFFIX), "wb") as stale:
    stale.write(b"x" * 1000)
def half_then_killed(obj, file):
    file.write(b"y" * 1000)
    file.flush()
    os.kill(os.getpid(), signal.SIGKILL)
checkpoint.torch.save = half_then_killed
checkpoint.save_checkpoint(os.path.join(run_dir, "last.pth"), {"step": 1})
"""


def test_a_save_killed_mid_write_leaves_only_its_own_temp_file_not_the_earlier_ones(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    for _ in range(2):      # two pre-emptions in a row, each killed during its save
        proc = subprocess.run([sys.executable, "-c", KILLED_MID_WRITE, str(tmp_path)], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
        temps = [p.name for p in tmp_path.iterdir() if p.name.endswith(TEMP_SUFFIX)]
        assert len(temps) == 1 and not temps[0].startswith(".last.pth.earlier"), temps
