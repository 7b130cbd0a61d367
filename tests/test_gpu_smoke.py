"""The GPU scripts on a CPU machine: bench/gpu_smoke.sh, bench/gpu_checks.sh and bench/gpu_env.sh
parse; the smoke test's --cpu-check prints its table with each CUDA path skipped once its command
lines are accepted by their scripts' parsers; bench/check_args.py refuses what a script refuses.
(Running them on a GPU is what they are for; these checks only keep them from rotting.)"""
from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from child_env import child_env
from test_preemption import REPO

SCRIPTS = ["bench/gpu_smoke.sh", "bench/gpu_checks.sh", "bench/gpu_env.sh"]


def load_check_args():
    spec = importlib.util.spec_from_file_location("check_args", REPO / "bench" / "check_args.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_gpu_scripts_parse(script):
    proc = subprocess.run(["bash", "-n", script], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_check_args_finds_the_script_past_the_interpreter_and_the_launcher():
    find = load_check_args().script_and_arguments
    assert find(["python3", "train.py", "--epochs", "1"]) == ("train.py", ["--epochs", "1"])
    assert find(["torchrun", "--standalone", "--nproc_per_node", "1", "bench/group_of_one.py", "--zero"]) \
        == ("bench/group_of_one.py", ["--zero"])
    assert find(["python3", "-m", "torch.distributed.run", "--nproc_per_node", "2", "x.py"]) == ("x.py", [])


@pytest.mark.slow
def test_check_args_refuses_what_the_script_refuses_and_runs_nothing(tmp_path):
    proc = subprocess.run([sys.executable, "bench/check_args.py", "python3", "train.py", "--out-dir",
                           str(tmp_path / "runs"), "--no-such-option"], cwd=REPO, capture_output=True,
                          text=True, env=child_env(), timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: unrecognized arguments: --no-such-option (see train.py --help)"]
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_the_smoke_tests_cpu_check_prints_its_table_with_the_cuda_paths_skipped(tmp_path):
    proc = subprocess.run(["bash", "bench/gpu_smoke.sh", "--cpu-check"], cwd=REPO, capture_output=True,
                          text=True, timeout=600,
                          env=child_env(OUT=str(tmp_path), SMOKE_ONLY="^(O2 |torchrun)"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    header, *rows = (tmp_path / "smoke" / "table.txt").read_text().splitlines()
    assert header.split() == ["path", "seconds", "images/s", "result"]
    assert [row[:28].strip() for row in rows] == ["O2 train+resume+AP", "torchrun NCCL group of 1"]
    assert all(row[47:] == "skipped: no CUDA (command lines accepted)" for row in rows), rows
