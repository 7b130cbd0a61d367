"""The GPU scripts on a CPU machine: bench/gpu_smoke.sh, bench/gpu_checks.sh and bench/gpu_env.sh
parse; the smoke's --cpu-check runs every section's code at toy sizes on the CPU (command lines of
training runs parsed only) and ends each with its JSON line; bench/check_args.py refuses what a
script refuses.
(Running them on a GPU is what they are for; these checks only keep them from rotting.)"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from child_env import child_env
from test_preemption import REPO

SCRIPTS = ["bench/gpu_smoke.sh", "bench/gpu_checks.sh", "bench/gpu_env.sh"]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_the_gpu_scripts_parse(script):
    proc = subprocess.run(["bash", "-n", script], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_check_args_finds_the_script_past_the_interpreter_and_the_launcher():
    find = load_script("check_args").script_and_arguments
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
def test_the_smokes_cpu_check_runs_every_section_and_ends_each_with_its_json_line(tmp_path):
    proc = subprocess.run([sys.executable, "bench/gpu_smoke.py", "--cpu-check"], cwd=REPO, capture_output=True,
                          text=True, timeout=900, env=child_env(OUT=str(tmp_path)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    lines = [json.loads(line) for line in (tmp_path / "smoke" / "sections.jsonl").read_text().splitlines()]
    smoke = load_script("gpu_smoke")
    assert [line["section"] for line in lines] == ["env", *smoke.PARALLEL, *smoke.ALONE]
    assert all(str(line["status"]).startswith(("ok", "not built", "skipped")) for line in lines), lines
    by_name = {line["section"]: line for line in lines}
    assert all(row["ok"] for row in by_name["levels"]["levels"].values())     # four command lines parsed
    assert by_name["throughput"]["rows"]["O1 bf16 b16"]["ms_per_step_median"] > 0
    assert by_name["evaluation"]["pictures"] == 2
