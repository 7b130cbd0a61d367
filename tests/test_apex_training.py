"""`--amp-backend apex` through the engine's real training loop, on Apex 25.04's own code (its
CUDA-only pieces stood in: tests/apex_cpu_standins.py): steps, validation, AP, checkpoints and
resume at O1, O2 and O3, with --ema, --accumulate 2 and --freeze; a checkpoint of either backend
resumed by the other; Apex's SyncBatchNorm over one and over two gloo ranks (with Apex's DDP).

Agreement with the native backend (`--amp-dtype float16`, the same flags): every logged training
and validation loss within LOSS_RTOL relative. Both run float16 at every level (Apex's O1 by its
patched functions, the native O1 by autocast; O2/O3 the same half model), so they differ by
rounding and by which operations each casts: 2e-2 covers that with a wide margin, and is far
below what a step that did not happen or a wrong loss scale changes.
"""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train
from apex_cpu_standins import install, remove, requires_apex
from child_env import child_env, find_free_port
from runtime.checkpoint import load_checkpoint

REPO = Path(__file__).resolve().parents[1]
LOSS_RTOL = 2e-2
# the tiny preset made tinier still: float16 convolutions on a CPU are slow
SMALL = ["--set", "model.stacks=1", "--set", "model.depth=2", "--set", "model.channels=16",
         "--set", "model.increase=8", "--set", "model.stem_channels=4", "--set", "data.input_size=64",
         "--set", "loss.scale_weights=[1,1,1]", "--set", "data.workers=0", "--set", "train.tensorboard=false",
         "--set", "train.max_steps_per_epoch=2", "--batch-size", "2", "--set", "train.log_every=1",
         "--set", "amp.init_scale=8", "--lr", "1e-4",
         "--amp-dtype", "float16", "--channels-last", "off", "--device", "cpu"]
VALIDATE = ["--ap-every", "1", "--set", "train.ap_max_images=1", "--set", "inference.scales=[0.5]",
            "--set", "train.val_pictures=0"]
FEATURES = ["--ema", "0.9", "--set", "train.ema_tau=2", "--accumulate", "2", "--freeze", "stem"]


def data(synthetic_h5, out: Path) -> list[str]:
    return ["--train-h5", str(synthetic_h5[0]), "--val-h5", str(synthetic_h5[1]), "--out-dir", str(out)]


def run_in_process(backend: str, args: list[str]) -> None:
    """train.py's main in this process; the apex backend with the CPU stand-ins for its duration."""
    if backend == "apex":
        install()
    try:
        train.main([*args, "--amp-backend", backend])
    finally:
        if backend == "apex":
            remove()


def losses(run_dir: Path) -> dict:
    """{"train": [loss per logged step], "val": [validation loss per epoch], "skipped": count}."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["kind"] == "train"]
    return {"train": [r["loss"] for r in train_rows], "val": [r["loss"] for r in rows if r["kind"] == "val"],
            "skipped": train_rows[-1]["skipped_steps"] if train_rows else None}


def epoch_losses(run_dir: Path) -> list[float]:
    """[train loss, validation loss] of each epoch, over all ranks."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [x for r in rows if r["kind"] == "val" for x in (r["train_loss"], r["loss"])]


def assert_agree(apex: dict, native: dict) -> None:
    assert len(apex["train"]) == len(native["train"]) > 0 and len(apex["val"]) == len(native["val"]) > 0
    assert apex["skipped"] == native["skipped"]
    for a, n in zip(apex["train"], native["train"]):
        assert math.isfinite(n) and a == pytest.approx(n, rel=LOSS_RTOL)
    for a, n in zip(apex["val"], native["val"]):      # O3's float16 validation is NaN in both
        assert a == pytest.approx(n, rel=LOSS_RTOL, nan_ok=True)


def assert_checkpoint(path: Path, epoch: int, ema: bool = True) -> dict:
    state = load_checkpoint(path)
    assert state["epoch"] == epoch
    assert all(v.dtype != torch.float16 for v in state["model"].values())
    assert ("ema" in state) == ema
    return state


@pytest.mark.slow
@requires_apex
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_apex_trains_validates_saves_and_resumes_like_native_and_across_backends(tmp_path, synthetic_h5,
                                                                                 level):
    """One epoch per backend (2 steps of 2 accumulated batches, EMA, frozen stem, validation and
    AP, last.pth and best.pth), then each run's last.pth resumed for a second epoch by the other
    backend: losses agree with the native backend's, epoch by epoch."""
    # O3 (float16 weights, no master copies) steps with SGD and BatchNorm in float32: AdamW's
    # epsilon underflows in float16 and the first update makes NaN with either backend
    bn = ["--keep-batchnorm-fp32", "True", "--optimizer", "sgd", "--lr", "0.01"] if level == "O3" else []
    common = [*data(synthetic_h5, tmp_path), *SMALL, *VALIDATE, *FEATURES, "--opt-level", level, *bn]
    for backend in ("native", "apex"):
        run_in_process(backend, [*common, "--epochs", "1", "--run-name", backend])
    first = {b: losses(tmp_path / b) for b in ("native", "apex")}
    assert_agree(first["apex"], first["native"])
    saved = {b: assert_checkpoint(tmp_path / b / "last.pth", 1)["model"] for b in ("native", "apex")}
    assert_checkpoint(tmp_path / "apex" / "best.pth", 1)
    # the frozen stem: the same initial float32 values in both, untouched (Apex cast it to float16)
    frozen = [k for k in saved["apex"] if k.startswith("stem.") and k.endswith(("weight", "bias"))]
    assert frozen and all(torch.equal(saved["apex"][k], saved["native"][k]) for k in frozen)
    # each backend resumes the other's checkpoint (its loss scale in the other's layout)
    for backend, other in (("native", "apex"), ("apex", "native")):
        run_in_process(backend, [*common, "--epochs", "2", "--resume", str(tmp_path / other / "last.pth")])
    second = {b: losses(tmp_path / b) for b in ("native", "apex")}   # appended to the run it resumed
    assert_agree(second["native"], second["apex"])     # apex resumed by native vs native by apex
    for backend in ("native", "apex"):
        state = assert_checkpoint(tmp_path / backend / "last.pth", 2)
        assert state["ema"]["updates"] == 4 - state["skipped_steps"]


@pytest.mark.slow
@requires_apex
def test_apex_syncbn_and_ddp_on_two_gloo_ranks_train_as_one_native_process(tmp_path, synthetic_h5):
    """Two gloo ranks (a total batch of 2: 1 each) under Apex O2 with Apex's SyncBatchNorm (its
    Python build) and Apex's DDP (delay_allreduce, predivided by 2), --accumulate 2 and --ema: the
    same losses as one native process (SyncBN makes the ranks' batch norms one over the joint batch)."""
    common = [*data(synthetic_h5, tmp_path), *SMALL, *VALIDATE, "--ema", "0.9", "--accumulate", "2",
              "--opt-level", "O2", "--epochs", "1"]
    run_in_process("native", [*common, "--run-name", "native"])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(find_free_port()), str(REPO / "tests" / "apex_cpu_standins.py"), "train_distributed",
           *common, "--sync-bn", "--delay-allreduce", "--run-name", "apex", "--amp-backend", "apex"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    layers = [int(n) for n in re.findall(r"apex SyncBatchNorm layers: (\d+)", proc.stdout)]
    assert len(layers) == 2 and layers[0] == layers[1] > 0              # one conversion per rank
    assert "Python-only build" in proc.stdout
    # each rank logs its own steps' losses; the epoch's train loss (all ranks) and validation agree
    apex, native = (epoch_losses(tmp_path / name) for name in ("apex", "native"))
    assert len(apex) == len(native) == 2 and apex == pytest.approx(native, rel=LOSS_RTOL)
    assert_checkpoint(tmp_path / "apex" / "last.pth", 1)


@pytest.mark.slow
@requires_apex
def test_apex_syncbn_and_ddp_in_a_gloo_group_of_one_train_as_a_native_process(tmp_path, synthetic_h5):
    """A real process group of one rank (bench/group_of_one.py: a 1-process torchrun makes no group)
    under Apex O1 (its patched functions in float16) with Apex's SyncBatchNorm and DDP (delay_allreduce),
    --accumulate 2,
    --ema and --freeze: the same losses as the native backend's single process."""
    common = [*data(synthetic_h5, tmp_path), *SMALL, *VALIDATE, *FEATURES, "--opt-level", "O1",
              "--epochs", "1"]
    run_in_process("native", [*common, "--run-name", "native"])
    cmd = [sys.executable, str(REPO / "tests" / "apex_cpu_standins.py"), "bench.group_of_one",
           *common, "--sync-bn", "--delay-allreduce", "--run-name", "apex", "--amp-backend", "apex"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    (layers,) = [int(n) for n in re.findall(r"apex SyncBatchNorm layers: (\d+)", proc.stdout)]
    assert layers > 0 and f"{layers} SyncBN layers" in proc.stdout
    assert "group of one: backend gloo" in proc.stdout
    assert_agree(losses(tmp_path / "apex"), losses(tmp_path / "native"))
    assert_checkpoint(tmp_path / "apex" / "last.pth", 1)
