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
from config.errors import ConfigError
from engine.checkpoint import load_checkpoint
from engine.cli import single_process_context
from engine.trainer import Interrupted, Launch, Trainer

QUICK = ["--set", "data.workers=0", "--set", "train.tensorboard=false", "--val-every", "0",
         "--optimizer", "sgd", "--lr", "0.01", "--warmup-epochs", "1"]


def run(tmp_path, synthetic_h5, *extra):
    return train.main(["--train-h5", str(synthetic_h5[0]), "--out-dir", str(tmp_path), *QUICK, *extra])


def trainer(tmp_path, synthetic_h5, name: str, batch: int, accumulate: int) -> Trainer:
    sets = [f"data.train_h5={synthetic_h5[0]}", "data.workers=0", f"train.out_dir={tmp_path}",
            f"train.run_name={name}", f"train.batch_size={batch}", f"train.accumulate={accumulate}",
            "optim.name=sgd", "optim.lr=0.01", "optim.warmup_epochs=0", "optim.decay_every=0",
            "train.tensorboard=false", "train.device=cpu"]
    return Trainer(build_config("tiny", sets=sets), Launch(single_process_context("cpu")))


def bn_eval(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.eval()


def test_an_accumulated_step_equals_one_step_on_the_joined_batch(tmp_path, synthetic_h5):
    joined, split = trainer(tmp_path, synthetic_h5, "joined", 4, 1), trainer(tmp_path, synthetic_h5, "split", 2, 2)
    start = {k: v.clone() for k, v in joined.model.state_dict().items()}
    assert all(torch.equal(start[k], v) for k, v in split.model.state_dict().items())
    batch = [torch.stack(t) for t in zip(*(joined.train_set[i] for i in range(4)))]
    halves = [[t[:2] for t in batch], [t[2:] for t in batch]]
    for t in (joined, split):
        t.net.train()
        bn_eval(t.model)
    out_joined = joined.run_step([batch], 0, 0)
    out_split = split.run_step(halves, 0, 0)
    assert not out_joined["skipped"] and not out_split["skipped"]
    assert out_split["loss"] == pytest.approx(out_joined["loss"], rel=1e-5)   # mean of the 4 samples
    a, b = joined.model.state_dict(), split.model.state_dict()
    keys = [k for k in a if a[k].is_floating_point()]
    update = torch.cat([(a[k] - start[k]).flatten() for k in keys]).norm()
    diff = torch.cat([(a[k] - b[k]).flatten() for k in keys]).norm()
    assert update > 0 and diff / update < 1e-3          # summed instead of averaged would be ~1


def test_train_py_takes_one_step_per_k_batches(tmp_path, synthetic_h5, capsys):
    run(tmp_path, synthetic_h5, "--batch-size", "2", "--accumulate", "3", "--epochs", "1", "--run-name", "acc")
    out = capsys.readouterr().out
    assert "batch 2 per process, 2 in total, 3 batches per step (6 samples)" in out
    samples = int(re.search(r"data: (\d+) training samples", out).group(1))
    ckpt = load_checkpoint(tmp_path / "acc/last.pth")
    assert ckpt["step"] == samples // 6 and ckpt["epoch"] == 1 and ckpt["iteration"] == 0
    assert ckpt["config"]["train"]["accumulate"] == 3


def test_a_run_stopped_between_accumulated_steps_resumes_bit_for_bit(tmp_path, synthetic_h5, monkeypatch):
    args = ["--batch-size", "2", "--accumulate", "2", "--epochs", "2", "--set", "train.max_steps_per_epoch=3"]
    run(tmp_path, synthetic_h5, *args, "--run-name", "straight")

    run_step = Trainer.run_step

    def stop_after_second_step(self, batches, epoch, first):
        out = run_step(self, batches, epoch, first)
        if self.step == 1:                 # the step being taken is the run's second
            self.stop_signal = signal.SIGTERM
            out["stop"] = True
        return out

    monkeypatch.setattr(Trainer, "run_step", stop_after_second_step)
    with pytest.raises(Interrupted):
        run(tmp_path, synthetic_h5, *args, "--run-name", "resumed")
    monkeypatch.setattr(Trainer, "run_step", run_step)
    stopped = load_checkpoint(tmp_path / "resumed/last.pth")
    assert (stopped["epoch"], stopped["iteration"], stopped["step"]) == (0, 4, 2)   # 4 batches = 2 steps
    run(tmp_path, synthetic_h5, *args, "--run-name", "resumed", "--resume", "auto")
    a, b = load_checkpoint(tmp_path / "straight/last.pth"), load_checkpoint(tmp_path / "resumed/last.pth")
    assert a["step"] == b["step"] == 6
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


@pytest.mark.parametrize("accumulate,message", [
    ("0", "option train.accumulate: 0 must be at least 1"),
    ("100", "option train.accumulate: 100 batches per step, but an epoch has only \\d+ batches of 2"),
])
def test_impossible_accumulation_is_refused_naming_the_option(tmp_path, synthetic_h5, accumulate, message):
    with pytest.raises(ConfigError, match=message):
        run(tmp_path, synthetic_h5, "--batch-size", "2", "--accumulate", accumulate, "--epochs", "1")


def test_an_epoch_resumed_at_its_end_reports_no_train_loss_rather_than_zero(tmp_path, synthetic_h5,
                                                                            monkeypatch, capsys):
    args = ["--batch-size", "2", "--accumulate", "2", "--epochs", "2", "--set", "train.max_steps_per_epoch=3",
            "--run-name", "edge"]
    run_step = Trainer.run_step

    def stop_at_the_epochs_last_step(self, batches, epoch, first):
        out = run_step(self, batches, epoch, first)
        if self.step == 2:                 # the step being taken is the epoch's third and last
            self.stop_signal = signal.SIGTERM
            out["stop"] = True
        return out

    monkeypatch.setattr(Trainer, "run_step", stop_at_the_epochs_last_step)
    with pytest.raises(Interrupted):
        run(tmp_path, synthetic_h5, *args)
    monkeypatch.setattr(Trainer, "run_step", run_step)
    run(tmp_path, synthetic_h5, *args, "--resume", "auto")
    assert "epoch 1/2: no training step counted" in capsys.readouterr().out
    lines = [json.loads(line) for line in (tmp_path / "edge/metrics.jsonl").read_text().splitlines()]
    val = [r for r in lines if r["kind"] == "val"]
    assert [r["epoch"] for r in val] == [0, 1]
    assert "train_loss" not in val[0] and val[1]["train_loss"] > 0
