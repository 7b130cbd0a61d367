"""An interrupted run ends bit for bit where the same run straight through ends (CPU), in the flows
users chain: launch {train.py, train_parallel.py, 2 DDP gloo ranks, the same with --sync-bn} x start
{scratch, --weights, --weights --freeze, --allow-partial --freeze onto another skeleton} x option
{none, --ema, --accumulate 2, --zero, --delay-allreduce, O1 bfloat16} x interruption {stopped after
epoch 1 then `--resume auto` alone, SIGTERM mid-epoch 1 to the process group then `--resume auto`
alone, SIGKILL mid-epoch 2 then the whole first command plus `--resume auto --run-name RUN`, as the
SIGTERM line prints it}. Each case compares the final weights, EMA and optimiser state of last.pth.

Not the full product (288 cases) but a covering array of strength 2 (`pairwise`): every pair of
levels of two factors is in some case. The signalled legs run in a session of their own, signalled
as a group with their two DataLoader workers per rank: the script's main (train.py or
train_parallel.py) as `python SCRIPT` runs it, or 2 ranks of train_distributed.py's forked as one job,
as srun starts it; each forked from this process, its standard error read from a file (the scripts
started as fresh interpreters, and torchrun's agent, which forwards a SIGTERM to its workers' own
sessions, are test_preemption's). The other legs, and the straight runs, call the same entry point
in this process, or on ranks forked from it (tests/gloo_ranks.py): a Python start (3-5 s of CPU)
spared each.
"""
from __future__ import annotations

import itertools
import os
import signal
import time
from pathlib import Path

import pytest
import torch

import train
import train_distributed
import train_parallel
from data.synthetic import ensure_synthetic_h5
from engine.cli import run_main
from gloo_ranks import as_forked_ranks, forked_job
from runtime.checkpoint import load_checkpoint
from test_preemption import finish, logged_steps, resume_hint, wait_until, write_micro_preset

FACTORS = {
    "launch": ["train.py", "train_parallel.py", "ddp", "ddp-sync-bn"],
    "start": ["scratch", "weights", "weights-freeze", "partial-freeze"],
    "option": ["none", "ema", "accumulate", "zero", "delay-allreduce", "O1-bfloat16"],
    "interruption": ["epoch", "sigterm", "sigkill"],
}
OPTION_ARGS = {"none": [], "ema": ["--ema", "0.9"], "accumulate": ["--accumulate", "2"],
               "zero": ["--zero"], "delay-allreduce": ["--delay-allreduce"],
               "O1-bfloat16": ["--opt-level", "O1", "--amp-dtype", "bfloat16"]}
EPOCHS, STEPS = 2, 3
# LR warm-up over epoch 1, halved at epoch 2: a resume that lost its place leaves the curve
QUICK = ["--workers", "2", "--batch-size", "4", "--device", "cpu", "--epochs", str(EPOCHS),
         "--set", f"train.max_steps_per_epoch={STEPS}", "--set", "optim.milestones=[1]",
         "--set", "optim.decay_factor=0.5"]


def pairwise(factors: dict[str, list]) -> list[dict]:
    """A small covering array of strength 2, the same every time: the product of the two largest
    factors, each other factor's level chosen row by row to cover the most pairs not yet covered
    (the first such level on ties), then rows for any pair still uncovered."""
    names = sorted(factors, key=lambda n: -len(factors[n]))
    uncovered = {((a, x), (b, y)) for a, b in itertools.combinations(names, 2)
                 for x in factors[a] for y in factors[b]}

    def newly_covered(row: dict) -> set:
        return {((a, row[a]), (b, row[b])) for a, b in itertools.combinations(names, 2)
                if a in row and b in row} & uncovered

    def completed(row: dict) -> dict:
        for name in names:
            if name not in row:
                row[name] = max(factors[name], key=lambda level: len(newly_covered({**row, name: level})))
        uncovered.difference_update(newly_covered(row))
        return row
    rows = [completed(dict(zip(names[:2], pair)))
            for pair in itertools.product(*(factors[n] for n in names[:2]))]
    while uncovered:
        (a, x), (b, y) = min(uncovered, key=lambda p: (names.index(p[0][0]), names.index(p[1][0]), str(p)))
        rows.append(completed({a: x, b: y}))
    return [{name: row[name] for name in factors} for row in rows]


CASES = pairwise(FACTORS)


def case_id(case: dict) -> str:
    return "-".join(case.values())


def test_the_cases_cover_every_pair_of_levels_in_24_cases():
    pairs = {((a, case[a]), (b, case[b])) for case in CASES for a, b in itertools.combinations(FACTORS, 2)}
    assert pairs == {((a, x), (b, y)) for a, b in itertools.combinations(FACTORS, 2)
                     for x in FACTORS[a] for y in FACTORS[b]}
    assert len(CASES) == len(FACTORS["option"]) * len(FACTORS["launch"])      # the least there can be
    assert len({case_id(case) for case in CASES}) == len(CASES) and CASES == pairwise(FACTORS)


# -- the runs -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def inputs(tmp_path_factory, synthetic_h5) -> dict:
    """The preset, the COCO and quadruped training files, and a COCO run's last.pth to start from."""
    folder = tmp_path_factory.mktemp("matrix")
    preset = write_micro_preset(folder)
    quadruped, _ = ensure_synthetic_h5(folder / "quadruped", train_images=24, val_images=2,
                                       skeleton="quadruped")
    train.main(["--config", str(preset), "--train-h5", str(synthetic_h5[0]), "--out-dir", str(folder),
                "--run-name", "base", "--epochs", "1", "--set", "train.max_steps_per_epoch=2",
                "--device", "cpu"])
    return dict(preset=preset, coco=synthetic_h5[0], quadruped=quadruped, base=folder / "base" / "last.pth",
                out=folder)


def command(case: dict, inputs: dict, name: str) -> list[str]:
    """The first command's arguments (after the script) of the case's run `name`."""
    start = {"scratch": [], "weights": ["--weights", str(inputs["base"])],
             "weights-freeze": ["--weights", str(inputs["base"]), "--freeze", "stem"],
             "partial-freeze": ["--weights", str(inputs["base"]), "--allow-partial",
                                "--freeze", "stem", "stacks.0.*"]}[case["start"]]
    data = inputs["quadruped" if case["start"] == "partial-freeze" else "coco"]
    return ["--config", str(inputs["preset"]), "--train-h5", str(data), "--out-dir", str(inputs["out"]),
            "--run-name", name, *QUICK, *start, *OPTION_ARGS[case["option"]],
            *(["--sync-bn"] if case["launch"] == "ddp-sync-bn" else [])]


def entry_point(case: dict):
    """The case's script's `main`, and on how many forked ranks it runs (0: in one process, no ranks)."""
    if case["launch"].startswith("ddp"):
        return train_distributed.main, 2
    return {"train.py": train, "train_parallel.py": train_parallel}[case["launch"]].main, 0


def run_here(case: dict, argv: list[str]) -> None:
    """The case's entry point on `argv`, in this process or on 2 ranks forked from it."""
    main, ranks = entry_point(case)
    if ranks:
        as_forked_ranks(main, ranks, argv)
    else:
        main(argv)


class ForkedJob:
    """A `gloo_ranks.forked_job` with what `wait_until` and `finish` call of a Popen: its standard
    error is the file its processes write theirs to."""

    def __init__(self, job, stderr: Path):
        self.job, self.pid, self.stderr = job, job.pid, stderr

    def poll(self):
        return self.job.exitcode

    returncode = property(poll)

    def kill(self):
        self.job.kill()

    def communicate(self, timeout=None):
        self.job.join(timeout)
        return "", self.stderr.read_text() if self.stderr.exists() else ""


def start_real(case: dict, argv: list[str], stderr: Path):
    """The case's first command forked from this process in a session of its own: the script's main
    as `python SCRIPT ...` runs it, or 2 ranks of train_distributed.py's as srun starts them."""
    main, ranks = entry_point(case)
    return ForkedJob(forked_job(run_main, ranks, main, argv, stderr=stderr), stderr)


def wait_until_gone(group: int) -> None:
    """Until no process of `group` lives: a killed rank or DataLoader worker holds the run's lock
    until it is gone, as a scheduler waits for every process of a job it killed."""
    def alive():
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                state, _, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
            except (OSError, IndexError):
                continue
            if int(pgrp) == group and state != "Z":
                return True
        return False
    deadline = time.monotonic() + 60
    while alive():
        assert time.monotonic() < deadline, f"processes of group {group} still live 60 s after SIGKILL"
        time.sleep(0.05)


def interrupted(case: dict, inputs: dict, name: str) -> None:
    """The case's run `name`, interrupted and resumed as the case says."""
    argv, run_dir = command(case, inputs, name), inputs["out"] / name
    alone = ["--resume", "auto", "--run-name", name, "--out-dir", str(inputs["out"])]
    if case["interruption"] == "epoch":
        run_here(case, argv[:argv.index("--epochs") + 1] + ["1"] + argv[argv.index("--epochs") + 2:])
        return run_here(case, alone + ["--epochs", str(EPOCHS)])
    process = start_real(case, argv, inputs["out"] / f"{name}.stderr")
    if case["interruption"] == "sigterm":
        wait_until(lambda: logged_steps(run_dir) >= 1, process, "the first logged step")
        os.killpg(process.pid, signal.SIGTERM)
        rc, _, err = finish(process)
        assert rc == 2 and "Traceback" not in err, err[-3000:]
        resume_hint(err, run_dir)
        state = load_checkpoint(run_dir / "last.pth")
        batches = STEPS * (2 if case["option"] == "accumulate" else 1)
        # in epoch 1: mid-epoch, or after its last step where a loaded machine let the run go on
        assert state["epoch"] == 0 and 0 < state["iteration"] <= batches
        return run_here(case, alone)
    wait_until(lambda: logged_steps(run_dir) > STEPS, process, "a logged step of epoch 2")
    os.killpg(process.pid, signal.SIGKILL)
    rc, _, _ = finish(process)
    wait_until_gone(process.pid)
    assert rc == -signal.SIGKILL and load_checkpoint(run_dir / "last.pth")["epoch"] == 1
    run_here(case, argv + ["--resume", "auto", "--run-name", name])


def differences(a, b, where: str = "") -> list[str]:
    """Where two checkpoint values differ (tensors bit for bit), as 'key.key' paths."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b), key=str)
                for d in (differences(a[k], b[k], f"{where}.{k}") if k in a and k in b
                          else [f"{where}.{k} (only one has it)"])]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}.{i}")]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return [f"{where} ({a.dtype} {tuple(a.shape)} against {b.dtype} {tuple(b.shape)})"]
        gap = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
        return [] if torch.equal(a, b) else [f"{where} (max |a - b| {gap:.3g})"]
    return [] if a == b else [f"{where} ({a!r} against {b!r})"]


def test_differences_name_each_value_that_is_not_the_same_bit_for_bit():
    a = {"model": {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(3)}, "optimizer": {"state": [{"step": 2}]}}
    b = {"model": {"w": torch.tensor([1.0, 2.0 + 2 ** -22]), "n": torch.tensor(3.0)},
         "optimizer": {"state": [{"step": 3}]}, "ema": None}
    assert differences(a, a) == []
    assert differences(a, b) == [".ema (only one has it)", ".model.n (torch.int64 () against torch.float32 ())",
                                 ".model.w (max |a - b| 2.38e-07)", ".optimizer.state.0.step (2 against 3)"]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_an_interrupted_run_ends_with_the_state_of_the_same_run_straight_through(case, inputs):
    name = case_id(case)
    run_here(case, command(case, inputs, f"{name}-straight"))
    interrupted(case, inputs, name)
    straight, resumed = (load_checkpoint(inputs["out"] / run / "last.pth")
                         for run in (f"{name}-straight", name))
    assert (resumed["epoch"], resumed["step"]) == (straight["epoch"], straight["step"]) \
        == (EPOCHS, EPOCHS * STEPS)
    assert (resumed.get("ema") is None) == (case["option"] != "ema")
    parts = ("model", "ema", "optimizer", "scaler")
    assert differences({k: resumed.get(k) for k in parts}, {k: straight.get(k) for k in parts}) == []
