"""The GPU script on a CPU machine: bench/gpu_smoke.sh parses; the smoke's --cpu-check runs every
section's code at toy sizes on the CPU (command lines of training runs parsed only) and ends each
with its JSON line. (Running it on a GPU is what it is for; these checks only keep it from rotting.)"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from child_env import child_env
from test_preemption import REPO


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_gpu_script_parses():
    proc = subprocess.run(["bash", "-n", "bench/gpu_smoke.sh"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
def test_the_smokes_cpu_check_runs_every_section_and_ends_each_with_its_json_line(tmp_path):
    proc = subprocess.run([sys.executable, "bench/gpu_smoke.py", "--cpu-check"], cwd=REPO, capture_output=True,
                          text=True, timeout=900, env=child_env(OUT=str(tmp_path)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    lines = [json.loads(line) for line in (tmp_path / "smoke" / "sections.jsonl").read_text().splitlines()]
    smoke = load_script("gpu_smoke")
    assert [line["section"] for line in lines] == ["env", *smoke.PARALLEL, *smoke.ALONE]
    assert all(str(line["status"]).startswith(("ok", "skipped")) for line in lines), lines
    by_name = {line["section"]: line for line in lines}
    assert all(row["ok"] for row in by_name["levels"]["levels"].values())     # four command lines parsed
    assert by_name["throughput"]["rows"]["O1 bf16 b16"]["ms_per_step_median"] > 0
    assert by_name["evaluation"]["pictures"] == 2 and by_name["evaluation"]["split_ms"]["network"] > 0
    first = by_name["first_step"]       # each cuDNN setting in a fresh process: its first five steps
    rows = [first["cudnn_benchmark_off"], first["cudnn_benchmark_on"]]
    assert len({first["pid"], *(row["pid"] for row in rows)}) == 3
    for row in rows:
        assert len(row["steps_s"]) == 5 and min(row["steps_s"]) > 0 and row["capture_step"] is None   # CPU
        assert row["to_first_step_s"] > row["import_all_s"] + row["build_s"] > row["import_torch_s"] > 0
