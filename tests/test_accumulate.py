"""Gradient accumulation (`--accumulate K`): one optimiser step per K batches, equal to one step on
the K batches joined; a run interrupted between steps resumes bit for bit; bad settings are refused.

The equality is checked with BatchNorm in eval mode: in train mode a batch of 4 and two batches of
2 normalise with different statistics, which is what accumulation means and not an error.
"""
from __future__ import annotations

import json
import re
import signal

import pytest
import torch
from torch import nn

import train
from config import build_config
from common.errors import ConfigError
from runtime.checkpoint import load_checkpoint
from engine.cli import single_process_context
from engine.loaders import to_model_input
from engine.run_trainer import Launch, Run, build_run
from engine.trainer import Interrupted, Trainer
from test_preemption import write_micro_preset

QUICK = ["--set", "data.workers=0", "--set", "train.tensorboard=false", "--val-every", "0",
         "--optimizer", "sgd", "--lr", "0.01", "--warmup-epochs", "1"]


def run(tmp_path, synthetic_h5, *extra):
    return train.main(["--config", str(write_micro_preset(tmp_path)), "--train-h5", str(synthetic_h5[0]),
                       "--out-dir", str(tmp_path), *QUICK, *extra])


def trainer(tmp_path, synthetic_h5, name: str, batch: int, accumulate: int, *extra: str) -> Run:
    sets = [f"data.train_h5={synthetic_h5[0]}", "data.workers=0", f"train.out_dir={tmp_path}",
            f"train.run_name={name}", f"train.batch_size={batch}", f"train.accumulate={accumulate}",
            "optim.name=sgd", "optim.lr=0.01", "optim.warmup_epochs=0", "optim.decay_every=0",
            "train.tensorboard=false", "train.device=cpu", *extra]
    return build_run(build_config(str(write_micro_preset(tmp_path)), sets=sets),
                     Launch(single_process_context("cpu")))


def bn_eval(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.eval()


def run_stopped_at_step(tmp_path, synthetic_h5, monkeypatch, step: int, *args) -> None:
    """train.py stopped as by SIGTERM during optimiser step `step` (1-based): it saves and raises."""
    run_step = Trainer.run_step

    def stopping(self, inputs):
        out = run_step(self, inputs)
        if self.step == step - 1:          # self.step counts the steps finished before this one
            self.stop_signal = signal.SIGTERM
            out.stop = True
        return out

    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "run_step", stopping)
        with pytest.raises(Interrupted):
            run(tmp_path, synthetic_h5, *args)


@pytest.mark.parametrize("level,dtype,tolerance", [
    ("O0", "auto", 1e-3),
    # O2/O3: the half-precision gradient is summed over the K backward passes, then copied to the
    # float32 master gradient (O2) or unscaled in place (O3); rounding differs by up to ~0.3 %
    *(pytest.param(*case, marks=pytest.mark.slow)          # many CPU-seconds each
      for case in (("O2", "bfloat16", 0.02), ("O2", "float16", 0.02), ("O3", "float16", 0.02))),
])
def test_an_accumulated_step_equals_one_step_on_the_joined_batch(tmp_path, synthetic_h5, level, dtype,
                                                                 tolerance):
    amp = [f"amp.opt_level={level}", f"amp.dtype={dtype}", "amp.loss_scale=128"]
    joined = trainer(tmp_path, synthetic_h5, "joined", 4, 1, *amp)
    split = trainer(tmp_path, synthetic_h5, "split", 2, 2, *amp)
    start = joined.components.precision.float32_state_dict(joined.components.model)
    split_start = split.components.precision.float32_state_dict(split.components.model)
    assert all(torch.equal(start[k], v) for k, v in split_start.items())
    batch = [torch.stack(t) for t in zip(*(joined.components.data.train_set[i] for i in range(4)))]
    halves = [[t[:2] for t in batch], [t[2:] for t in batch]]
    for t in (joined, split):
        t.components.net.train()
        bn_eval(t.components.model)
    painter, cpu = joined.components.data.train_set.painter_for("cpu"), torch.device("cpu")
    out_joined = joined.trainer.run_step([to_model_input(batch, cpu, painter)])
    out_split = split.trainer.run_step([to_model_input(half, cpu, painter) for half in halves])
    assert not out_joined.skipped and not out_split.skipped
    assert out_split.loss == pytest.approx(out_joined.loss, rel=10 * tolerance)  # mean of the 4 samples
    a = joined.components.precision.float32_state_dict(joined.components.model)
    b = split.components.precision.float32_state_dict(split.components.model)
    keys = [k for k in a if a[k].is_floating_point()]
    update = torch.cat([(a[k] - start[k]).flatten() for k in keys]).norm()
    diff = torch.cat([(a[k] - b[k]).flatten() for k in keys]).norm()
    assert update > 0 and diff / update < tolerance      # summed instead of averaged would be ~1


def test_the_lr_curve_by_step_is_the_joined_batchs(tmp_path, synthetic_h5):
    """Warm-up and decay follow optimiser steps: K=2 of batch 2 gets the LR of batch 4 at every step."""
    args = ["--epochs", "2", "--set", "train.log_every=1", "--set", "train.max_steps_per_epoch=4"]
    run(tmp_path, synthetic_h5, "--batch-size", "4", *args, "--run-name", "joined")
    run(tmp_path, synthetic_h5, "--batch-size", "2", "--accumulate", "2", *args, "--run-name", "acc")
    lrs = {}
    for name in ("joined", "acc"):
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        lrs[name] = {r["step"]: r["lr"] for r in records if r["kind"] == "train"}
    assert list(lrs["acc"]) == list(lrs["joined"]) == list(range(1, 9))
    assert list(lrs["acc"].values()) == pytest.approx(list(lrs["joined"].values()))


def test_train_py_takes_one_step_per_k_batches(tmp_path, synthetic_h5, capsys):
    run(tmp_path, synthetic_h5, "--batch-size", "2", "--accumulate", "3", "--epochs", "1",
        "--run-name", "acc")
    out = capsys.readouterr().out
    assert "batch 2 per process, 2 in total, 3 batches per step (6 samples)" in out
    samples = int(re.search(r"data: (\d+) training samples", out).group(1))
    ckpt = load_checkpoint(tmp_path / "acc/last.pth")
    assert ckpt["step"] == samples // 6 and ckpt["epoch"] == 1 and ckpt["iteration"] == 0
    assert ckpt["config"]["train"]["accumulate"] == 3


def test_a_run_stopped_between_accumulated_steps_resumes_bit_for_bit(tmp_path, synthetic_h5, monkeypatch):
    args = ["--batch-size", "2", "--accumulate", "2", "--epochs", "2", "--set", "train.max_steps_per_epoch=3"]
    run(tmp_path, synthetic_h5, *args, "--run-name", "straight")
    run_stopped_at_step(tmp_path, synthetic_h5, monkeypatch, 2, *args, "--run-name", "resumed")
    stopped = load_checkpoint(tmp_path / "resumed/last.pth")
    assert (stopped["epoch"], stopped["iteration"], stopped["step"]) == (0, 4, 2)   # 4 batches = 2 steps
    run(tmp_path, synthetic_h5, *args, "--run-name", "resumed", "--resume", "auto")
    a, b = load_checkpoint(tmp_path / "straight/last.pth"), load_checkpoint(tmp_path / "resumed/last.pth")
    assert a["step"] == b["step"] == 6
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_a_run_resumed_with_another_k_goes_on_from_the_same_batch(tmp_path, synthetic_h5, monkeypatch):
    """The checkpoint counts loader batches: stopped after batch 3 with K=1, resumed with K=2, the
    epoch (capped at 4 steps of K batches) goes on with batches 3-4 and 5-6: 3 + 2 + 4 steps."""
    args = ["--batch-size", "2", "--epochs", "2", "--set", "train.max_steps_per_epoch=4", "--run-name", "k"]
    run_stopped_at_step(tmp_path, synthetic_h5, monkeypatch, 3, *args)
    assert load_checkpoint(tmp_path / "k/last.pth")["iteration"] == 3
    run(tmp_path, synthetic_h5, *args, "--resume", "auto", "--accumulate", "2")
    done = load_checkpoint(tmp_path / "k/last.pth")
    assert done["step"] == 3 + 2 + 4 and done["config"]["train"]["accumulate"] == 2


@pytest.mark.parametrize("accumulate,message", [
    ("0", "option train.accumulate: 0 must be >= 1"),
    ("100", "option train.accumulate: 100 batches per step, but an epoch has only \\d+ batches of 2"),
])
def test_impossible_accumulation_is_refused_naming_the_option(tmp_path, synthetic_h5, accumulate, message):
    with pytest.raises(ConfigError, match=message):
        run(tmp_path, synthetic_h5, "--batch-size", "2", "--accumulate", accumulate, "--epochs", "1")


def test_an_epoch_resumed_at_its_end_reports_no_train_loss_rather_than_zero(tmp_path, synthetic_h5,
                                                                            monkeypatch, capsys):
    args = ["--batch-size", "2", "--accumulate", "2", "--epochs", "2", "--set", "train.max_steps_per_epoch=3",
            "--run-name", "edge"]
    run_stopped_at_step(tmp_path, synthetic_h5, monkeypatch, 3, *args)      # the epoch's last step
    run(tmp_path, synthetic_h5, *args, "--resume", "auto")
    assert "epoch 1/2: no training step counted" in capsys.readouterr().out
    lines = [json.loads(line) for line in (tmp_path / "edge/metrics.jsonl").read_text().splitlines()]
    val = [r for r in lines if r["kind"] == "val"]
    assert [r["epoch"] for r in val] == [0, 1]
    assert "train_loss" not in val[0] and val[1]["train_loss"] > 0
