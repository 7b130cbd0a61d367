"""The project runs from its clone, from any working directory: the entry scripts start from another
folder, and pip refuses to install the project (its generic top-level packages would shadow a
user's modules in site-packages) with one line that says how to use it instead."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from child_env import child_env

REPO = Path(__file__).resolve().parent.parent
ENTRIES = ["train.py", "train_parallel.py", "train_distributed.py", "evaluate.py", "demo.py", "export.py"]


@pytest.mark.slow
def test_entry_scripts_start_from_another_folder(tmp_path):
    runs = [[sys.executable, str(REPO / script), "--help"] for script in ENTRIES]
    runs.append([sys.executable, "-m", "data.make_hdf5", "--help"])
    started = [subprocess.Popen(run, cwd=tmp_path, env=child_env(PYTHONPATH=str(REPO)), text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for run in runs]
    for run, process in zip(runs, started):
        out = process.communicate(timeout=300)[0]
        assert process.returncode == 0 and "usage:" in out, (run, out)
    assert list(tmp_path.iterdir()) == []            # nothing written where the user stands


@pytest.mark.slow
@pytest.mark.parametrize("command", [["wheel", "--no-deps", "-w", "wheels"],
                                     ["install", "--dry-run", "--no-deps", "-e"]],
                         ids=["install", "editable"])
def test_pip_refuses_to_install_the_project_and_says_why(command, tmp_path):
    done = subprocess.run([sys.executable, "-m", "pip", *command, str(REPO), "--no-index",
                           "--disable-pip-version-check"], cwd=tmp_path, env=child_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "error: this project is not installed with pip" in done.stdout + done.stderr
    assert "PYTHONPATH" in done.stdout + done.stderr and not list(tmp_path.rglob("*.whl"))
