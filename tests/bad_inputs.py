"""What the bad-input tests share (a pytest plugin of tests/conftest.py): the checks of a refusal,
a finished run to be refused beside, and the run of every row of the table in docs/bad-input.md.

Each row of the table is a fresh process of `python -m data.make_hdf5`, `train.py` or
`train_distributed.py` (under torchrun where the row is about processes), all started together by
the session fixture `table`; the test file of each subject checks its rows (`TABLE_ROWS`). What
every row asserts: a non-zero exit code, no traceback, and exactly one message line on stderr
(progress bars aside) that starts with `error:` and names the file or option; rows that must not
lose data also check the files they must leave untouched. Two rows need what this machine lacks (a
second GPU, a full disk): they run the real script with `torch.cuda`'s GPU count or `torch.save`'s
writes replaced by a fake, so the error still travels the real path to the terminal.

The other cases call the entry points' `main(argv)` in this process (`refused`): exit code 2,
exactly one `error:` line naming the option or file, no traceback, and every file under the test's
folder byte-identical afterwards.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import pytest
import torch

import train
from common.errors import run_cli
from config.loader import build_config
from data.skeleton import builtin
from runtime.checkpoint import save_checkpoint
from engine.run_dir import LOCK_FILE
from models import build_model
from child_env import child_env, find_free_port
from reference_files import model_entries, reference_file, rule_weights
from test_preemption import REPO, message_lines, torchrun, worker_log, write_micro_preset

from conftest import COCO4_DIR as COCO4

COCO = builtin("coco")
IMAGE = "000000000785.jpg"
PARALLEL = 6

# train.py after a fake: 1 GPU visible, or a disk that fills after 1 kB of each checkpoint
ONE_GPU = """
import runpy, sys, torch
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
FULL_DISK = """
import errno, os, runpy, sys, torch
real_save = torch.save
class FullDisk:
    def __init__(self, file):
        self.file, self.written = file, 0
    def write(self, data):
        if self.written + len(data) > 1024:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.written += len(data)
        return self.file.write(data)
    def flush(self):
        self.file.flush()
torch.save = lambda obj, file, *args, **kwargs: real_save(obj, FullDisk(file), *args, **kwargs)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


class Payload:
    """Unpickling this would run a shell command."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@dataclass
class Case:
    command: list
    says: list                          # substrings of the one error line
    env: dict = field(default_factory=dict)
    rc: int = 0
    stderr: str = ""


def run_case(case: Case) -> Case:
    proc = subprocess.run(case.command, cwd=REPO, env=child_env(**case.env), capture_output=True,
                          text=True, timeout=240)
    case.rc, case.stderr = proc.returncode, proc.stderr
    return case


# -- the bad inputs ---------------------------------------------------------------------------------
def coco_inputs(root: Path) -> dict:
    """JSON files and image folders for the make_hdf5 rows."""
    coco = json.loads((COCO4 / "test_coco.json").read_text())
    coco["images"] = [i for i in coco["images"] if i["file_name"] == IMAGE]
    coco["annotations"] = [a for a in coco["annotations"] if a["image_id"] == coco["images"][0]["id"]]
    (root / "one.json").write_text(json.dumps(coco))
    text = json.dumps(coco)
    (root / "malformed.json").write_text(text[: len(text) // 2])
    instances = json.loads(text)                      # person *instances*, not keypoints
    for category in instances["categories"]:
        category.pop("keypoints", None)
        category.pop("skeleton", None)
    for ann in instances["annotations"]:
        for key in ("keypoints", "num_keypoints"):
            ann.pop(key, None)
    (root / "instances.json").write_text(json.dumps(instances))
    folders = {name: root / name for name in ("good", "missing", "unreadable", "corrupt")}
    for folder in folders.values():
        folder.mkdir()
    shutil.copy(COCO4 / IMAGE, folders["good"] / IMAGE)
    (folders["corrupt"] / IMAGE).write_bytes(os.urandom(4096))
    if os.geteuid() != 0:
        shutil.copy(COCO4 / IMAGE, folders["unreadable"] / IMAGE)
        (folders["unreadable"] / IMAGE).chmod(0)
    else:                        # root reads anything: a directory under the name cannot be read
        (folders["unreadable"] / IMAGE).mkdir()
    return folders


def h5_inputs(root: Path, train_h5: Path) -> None:
    data = train_h5.read_bytes()
    (root / "truncated.h5").write_bytes(data[: len(data) // 2])
    with h5py.File(root / "foreign.h5", "w") as f:
        f["weights"] = torch.zeros(4).numpy()
    shutil.copy(train_h5, root / "old.h5")
    with h5py.File(root / "old.h5", "r+") as f:
        f.attrs["version"] = 0


def checkpoint_inputs(root: Path, preset: Path, run_dir: Path) -> None:
    other = build_config(str(preset), sets=["model.stacks=2", "model.increase=8"])
    save_checkpoint(root / "other_model.pth", {"model": build_model(other.model, COCO).state_dict()})
    data = (run_dir / "last.pth").read_bytes()
    (root / "truncated.pth").write_bytes(data[: len(data) // 2])
    torch.save({"model": Payload(root / "code_ran")}, root / "code.pth")
    tiny = build_model(build_config("tiny").model, COCO)        # the authors' layout, for the tiny network
    reference_file(root / "authors_tiny.pth", rule_weights(model_entries(tiny, tiny.config.depth)))


@pytest.fixture(scope="session")
def table(tmp_path_factory, synthetic_h5) -> dict:
    """Every row of the docs table run at once: the cases, their folder and what the checks need."""
    root = tmp_path_factory.mktemp("bad_input")
    preset = write_micro_preset(root)
    train_h5 = synthetic_h5[0]
    runs = root / "runs"
    train.main(["--config", str(preset), "--train-h5", str(train_h5), "--out-dir", str(runs),
                "--run-name", "done", "--epochs", "1", "--set", "train.max_steps_per_epoch=1"])
    shutil.copytree(runs / "done", runs / "disk")
    folders = coco_inputs(root)
    h5_inputs(root, train_h5)
    checkpoint_inputs(root, preset, runs / "done")

    py = sys.executable
    make = [py, "-m", "data.make_hdf5", "--out", str(root / "out.h5")]
    trainer = [py, "train.py", "--config", str(preset), "--out-dir", str(runs)]
    with_data = trainer + ["--train-h5", str(train_h5)]
    one = str(root / "one.json")
    port_holder = socket.socket()
    port_holder.bind(("127.0.0.1", 0))
    port_holder.listen()
    port = port_holder.getsockname()[1]
    logs = root / "torchrun"
    cases = {
        "malformed JSON": Case(make + ["--ann", str(root / "malformed.json"), "--images",
                                       str(folders["good"])],
                               [str(root / "malformed.json"), "malformed JSON"]),
        "non-keypoint COCO JSON": Case(make + ["--ann", str(root / "instances.json"), "--images",
                                               str(folders["good"])],
                                       [str(root / "instances.json"), "0 keypoint names"]),
        "missing image": Case(make + ["--ann", one, "--images", str(folders["missing"])],
                              [str(folders["missing"] / IMAGE), "is missing", one]),
        "unreadable image": Case(make + ["--ann", one, "--images", str(folders["unreadable"])],
                                 [str(folders["unreadable"] / IMAGE), "cannot be read"]),
        "corrupt image": Case(make + ["--ann", one, "--images", str(folders["corrupt"])],
                              [str(folders["corrupt"] / IMAGE), "not a readable image"]),
        "missing HDF5": Case(trainer + ["--train-h5", str(root / "nowhere.h5")],
                             ["--train-h5", str(root / "nowhere.h5"), "no such file"]),
        "truncated HDF5": Case(trainer + ["--train-h5", str(root / "truncated.h5")],
                               [str(root / "truncated.h5"), "truncated or damaged HDF5"]),
        "foreign HDF5": Case(trainer + ["--train-h5", str(root / "foreign.h5")],
                             [str(root / "foreign.h5"), "not a keypoint dataset"]),
        "older HDF5 format": Case(trainer + ["--train-h5", str(root / "old.h5")],
                                  [str(root / "old.h5"), "older format version", "convert it again"]),
        "checkpoint of another model": Case(
            with_data + ["--weights", str(root / "other_model.pth")],
            [str(root / "other_model.pth"), "does not match the model", "not in the model: stacks.0.merge.",
             "with another shape: stacks.0.hourglass.", "(file [10, 12, 1, 1], model [8, 12, 1, 1])",
             "--allow-partial"]),
        "authors' checkpoint of another network": Case(
            with_data + ["--weights", str(root / "authors_tiny.pth")],
            [f"--weights {root / 'authors_tiny.pth'} holds another network (model.stacks 2 there",
             "add --config tiny to build it"]),
        "truncated checkpoint": Case(trainer + ["--resume", str(root / "truncated.pth")],
                                     [str(root / "truncated.pth"), "truncated or corrupt"]),
        "checkpoint that runs code": Case(with_data + ["--weights", str(root / "code.pth")],
                                          [str(root / "code.pth"), "refused", "execute code", "system"]),
        "learning rate that overflows AdamW": Case(with_data + ["--lr", "3e38"],
                                                   ["optim.lr", "3e+38", "<= 1e+30"]),
        "pure float16 with AdamW": Case(with_data + ["--opt-level", "O3", "--optimizer", "adamw",
                                                     "--amp-dtype", "float16"],
                                        ["O3 with --optimizer adamw in float16", "--opt-level O2"]),
        "unknown opt level": Case(with_data + ["--opt-level", "O4"],
                                  ["argument --opt-level", "'O4'", "'O0', 'O1', 'O2', 'O3'"]),
        "unknown preset": Case(with_data[:2] + ["--config", "imhn1024"], ["'imhn1024'", "imhn512", "tiny"]),
        "batch not divisible by processes": Case(
            torchrun(logs, "--config", str(preset), "--train-h5", str(train_h5), "--out-dir",
                     str(runs), "--batch-size", "3"),
            ["train.batch_size", "3 does not divide over 2 processes"]),
        "more processes than GPUs": Case(
            [py, "-c", ONE_GPU, "train_distributed.py", "--config", str(preset), "--device", "cuda"],
            ["2 processes on this node but only 1 CUDA GPU", "--nproc_per_node"],
            env=dict(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_port()))),
        "port in use": Case(
            [py, "train_distributed.py", "--config", str(preset), "--device", "cpu"],
            [f"MASTER_PORT {port} is already in use", "pick a free port"],
            env=dict(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))),
        "freeze pattern matching nothing": Case(with_data + ["--freeze", "stacks.7"],
                                                ["--freeze pattern 'stacks.7'", "matches no module", "stem"]),
        "full disk while saving": Case(
            [py, "-c", FULL_DISK, "train.py", "--out-dir", str(runs), "--run-name", "disk",
             "--resume", "auto", "--epochs", "2"],
            [f"cannot save checkpoint {runs / 'disk' / 'last.pth'}", "no space left on device",
             "previous file there, if any, is intact"]),
        "output directory of another run": Case(with_data + ["--run-name", "done"],
                                                [str(runs / "done"), "already holds a run",
                                                 "--resume auto", "--overwrite"]),
    }
    before = {name: (runs / name / "last.pth").read_bytes() for name in ("done", "disk")}
    try:
        with ThreadPoolExecutor(PARALLEL) as pool:
            list(pool.map(run_case, cases.values()))
    finally:
        port_holder.close()
    # torchrun adds its own report of the workers' exit codes: the row checks rank 0's own stderr
    batch = cases["batch not divisible by processes"]
    agent_stderr, batch.stderr = batch.stderr, worker_log(logs, 0, 0, "stderr")
    return {"cases": cases, "root": root, "runs": runs, "before": before, "logs": logs,
            "agent_stderr": agent_stderr}


TABLE_ROWS = {   # test module: the rows of the docs table it checks (tests/conftest.py: on one worker)
    "test_bad_data_files": ["malformed JSON", "non-keypoint COCO JSON", "missing image", "unreadable image",
                            "corrupt image", "missing HDF5", "truncated HDF5", "foreign HDF5",
                            "older HDF5 format"],
    "test_bad_checkpoints": ["checkpoint of another model", "authors' checkpoint of another network",
                             "truncated checkpoint", "checkpoint that runs code"],
    "test_bad_options": ["learning rate that overflows AdamW", "pure float16 with AdamW", "unknown opt level",
                         "unknown preset", "batch not divisible by processes", "more processes than GPUs",
                         "port in use", "freeze pattern matching nothing"],
    "test_output_safety": ["full disk while saving", "output directory of another run"],
}


def check_row(table: dict, row: str) -> None:
    """The row ended non-zero with one error line holding each of its texts."""
    case = table["cases"][row]
    assert case.rc != 0
    line = one_error_line(case.stderr, skip_progress=False)
    for text in case.says:
        assert text in line, line


# -- the checks of a refusal ------------------------------------------------------------------------
def snapshot(root: Path) -> dict:
    """Every file under `root` and its bytes; the empty lock file a run claims its folder with
    (engine.run_dir.LOCK_FILE) is bookkeeping, not content."""
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and p.name != LOCK_FILE}


def one_error_line(stderr: str, skip_progress: bool = True) -> str:
    """The one message line of `stderr`, which starts with `error:` (no traceback); with
    `skip_progress`, make_hdf5's `converting ...` progress lines are not counted."""
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [line for line in message_lines(stderr)
             if not (skip_progress and line.startswith("converting "))]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr[-3000:]
    return lines[0]


def skipped_lines(stderr: str) -> tuple[list[str], str]:
    """(the `skipped: ...` lines with which `make_hdf5 --skip-bad` lists what it left out, the rest
    of `stderr`)."""
    lines = stderr.splitlines()
    listed = [line for line in lines if line.startswith("skipped: ")]
    return listed, "\n".join(line for line in lines if not line.startswith("skipped: "))


def refused(capsys, main, argv, says, root: Path, code: int = 2, skipped: tuple = ()) -> str:
    """Run `main(argv)`; assert the exit code, the `skipped` lines listed first (`--skip-bad`),
    then one error line holding every text of `says`, no traceback, and nothing changed under
    `root`."""
    before = snapshot(root)
    capsys.readouterr()
    assert main([str(a) for a in argv]) == code
    listed, err = skipped_lines(capsys.readouterr().err)
    assert listed == list(skipped), listed
    line = one_error_line(err)
    for text in says:
        assert str(text) in line, line
    after = snapshot(root)
    assert after.keys() == before.keys() and all(after[p] == before[p] for p in before)
    return line


def first_ann(coco: dict) -> dict:
    """The first annotation of a COCO dict that has keypoints."""
    return next(a for a in coco["annotations"] if a["num_keypoints"] > 0)


def train_cli(argv):
    return run_cli(train.main, [str(a) for a in argv])


@pytest.fixture(scope="module")
def env(tmp_path_factory, synthetic_h5):
    """A finished run `runs/done` with a user's file beside it, a micro preset, COCO inputs."""
    root = tmp_path_factory.mktemp("classes")
    preset = write_micro_preset(root)
    runs = root / "runs"
    train.main(["--config", str(preset), "--train-h5", str(synthetic_h5[0]), "--out-dir", str(runs),
                "--run-name", "done", "--epochs", "1", "--set", "train.max_steps_per_epoch=1"])
    (runs / "notes.txt").write_text("a user's file next to the runs")
    (runs / "done" / "mine.txt").write_text("a user's file inside a run")
    coco = json.loads((COCO4 / "test_coco.json").read_text())
    images = root / "images"
    images.mkdir()
    for info in coco["images"]:
        shutil.copy(COCO4 / info["file_name"], images / info["file_name"])
    (root / "coco.json").write_text(json.dumps(coco))
    trainer = ["--config", preset, "--out-dir", runs, "--train-h5", synthetic_h5[0]]
    return {"root": root, "runs": runs, "preset": preset, "trainer": trainer, "coco": coco,
            "images": images, "train_h5": synthetic_h5[0]}
