"""Review of the third session's changes: accumulation with O2/O3 master weights and the LR curve,
resume with another K, old configs resuming, and metrics with several resumes."""
from __future__ import annotations

import json
import signal

import pytest
import torch
from torch import nn

import train
from config import build_config
from engine.checkpoint import load_checkpoint
from engine.cli import single_process_context
from engine.logger import RunLogger
from engine.trainer import Interrupted, Launch, Trainer

MICRO = ["model.stacks=1", "model.depth=2", "model.channels=12", "model.increase=4",
         "model.head_channels=8", "model.stem_channels=4", "model.se_reduction=4",
         "loss.scale_weights=[0.1,0.4,1.6]", "data.input_size=64"]
QUICK = ["--set", "data.workers=0", "--set", "train.tensorboard=false", "--val-every", "0",
         "--optimizer", "sgd", "--lr", "0.01", "--warmup-epochs", "1", "--set", "train.log_every=1"]


def micro_sets():
    return [x for s in MICRO for x in ("--set", s)]


def run(tmp_path, synthetic_h5, *extra):
    return train.main(["--train-h5", str(synthetic_h5[0]), "--out-dir", str(tmp_path), *QUICK,
                       *micro_sets(), *extra])


def trainer(tmp_path, synthetic_h5, name, batch, accumulate, *extra):
    sets = [f"data.train_h5={synthetic_h5[0]}", "data.workers=0", f"train.out_dir={tmp_path}",
            f"train.run_name={name}", f"train.batch_size={batch}", f"train.accumulate={accumulate}",
            "optim.name=sgd", "optim.lr=0.01", "optim.warmup_epochs=0", "optim.decay_every=0",
            "train.tensorboard=false", "train.device=cpu", *MICRO, *extra]
    return Trainer(build_config("tiny", sets=sets), Launch(single_process_context("cpu")))


def bn_eval(model):
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.eval()


@pytest.mark.parametrize("level,dtype", [("O2", "bfloat16"), ("O2", "float16"), ("O3", "float16")])
def test_accumulated_half_precision_step_equals_joined(tmp_path, synthetic_h5, level, dtype):
    amp = [f"amp.opt_level={level}", f"amp.dtype={dtype}", "amp.loss_scale=128"]
    joined = trainer(tmp_path, synthetic_h5, "j", 4, 1, *amp)
    split = trainer(tmp_path, synthetic_h5, "s", 2, 2, *amp)
    start = {k: v.clone().float() for k, v in joined.precision.float32_state_dict(joined.model).items()}
    batch = [torch.stack(t) for t in zip(*(joined.train_set[i] for i in range(4)))]
    halves = [[t[:2] for t in batch], [t[2:] for t in batch]]
    for t in (joined, split):
        t.net.train()
        bn_eval(t.model)
    a_out = joined.run_step([batch], 0, 0)
    b_out = split.run_step(halves, 0, 0)
    assert not a_out["skipped"] and not b_out["skipped"]
    a = joined.precision.float32_state_dict(joined.model)
    b = split.precision.float32_state_dict(split.model)
    keys = [k for k in a if a[k].is_floating_point()]
    update = torch.cat([(a[k] - start[k]).flatten() for k in keys]).norm()
    diff = torch.cat([(a[k] - b[k]).flatten() for k in keys]).norm()
    assert update > 0 and diff / update < 0.02, (diff / update).item()


def test_lr_curve_with_accumulation_matches_the_joined_batch(tmp_path, synthetic_h5):
    run(tmp_path, synthetic_h5, "--batch-size", "4", "--epochs", "2", "--run-name", "joined")
    run(tmp_path, synthetic_h5, "--batch-size", "2", "--accumulate", "2", "--epochs", "2", "--run-name", "acc")
    lrs = {}
    for name in ("joined", "acc"):
        recs = [json.loads(l) for l in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        lrs[name] = [(r["step"], r["lr"]) for r in recs if r["kind"] == "train"]
    assert lrs["joined"] == pytest.approx(lrs["acc"])


def test_resume_with_another_accumulate(tmp_path, synthetic_h5, monkeypatch):
    run_step = Trainer.run_step

    def stop_after_third_step(self, batches, epoch, first):
        out = run_step(self, batches, epoch, first)
        if self.step == 2:
            self.stop_signal = signal.SIGTERM
            out["stop"] = True
        return out

    monkeypatch.setattr(Trainer, "run_step", stop_after_third_step)
    with pytest.raises(Interrupted):
        run(tmp_path, synthetic_h5, "--batch-size", "2", "--epochs", "2", "--run-name", "r")
    monkeypatch.setattr(Trainer, "run_step", run_step)
    stopped = load_checkpoint(tmp_path / "r/last.pth")
    assert (stopped["epoch"], stopped["iteration"]) == (0, 3)
    run(tmp_path, synthetic_h5, "--batch-size", "2", "--epochs", "2", "--run-name", "r",
        "--resume", "auto", "--accumulate", "2")
    done = load_checkpoint(tmp_path / "r/last.pth")
    # 39 samples, 19 batches of 2, 18 used with K=2: 3 done, then (18-3)//2 = 7 steps, then 9
    assert done["step"] == 3 + 7 + 9 and done["config"]["train"]["accumulate"] == 2


def test_resume_old_style_config_with_flags(tmp_path, synthetic_h5):
    run(tmp_path, synthetic_h5, "--batch-size", "4", "--epochs", "1", "--run-name", "old")
    path = tmp_path / "old/last.pth"
    state = torch.load(path, weights_only=False)
    state["config"]["amp"]["channels_last"] = False
    state["config"]["amp"]["loss_scale"] = "128.0"
    del state["config"]["train"]["accumulate"]
    torch.save(state, path)
    out = run(tmp_path, synthetic_h5, "--batch-size", "4", "--epochs", "2", "--run-name", "old",
              "--resume", "auto", "--channels-last", "True", "--accumulate", "2")
    done = load_checkpoint(path)
    assert done["config"]["amp"]["channels_last"] is True
    assert done["config"]["amp"]["loss_scale"] == "128.0"
    assert done["config"]["train"]["accumulate"] == 2
    assert done["epoch"] == 2 and out["step"] == 9 + 4   # 39 samples: 9 batches of 4, then 4 steps of 2


def test_metrics_read_after_several_resumes(tmp_path):
    log = RunLogger(tmp_path, True, tensorboard=False)
    for s in range(1, 11):
        log.log("train", s, loss=1.0)
    log = RunLogger(tmp_path, True, tensorboard=False, resumed_step=6)
    for s in range(7, 10):
        log.log("train", s, loss=2.0)
    log = RunLogger(tmp_path, True, tensorboard=False, resumed_step=8)
    for s in range(9, 12):
        log.log("train", s, loss=3.0)
    train_recs = [(r["step"], r["loss"]) for r in log.read() if r["kind"] == "train"]
    assert train_recs == [(s, 1.0) for s in range(1, 7)] + [(7, 2.0), (8, 2.0)] + [(s, 3.0) for s in (9, 10, 11)]


def test_resume_marker_after_a_line_cut_by_a_crash_still_counts(tmp_path):
    log = RunLogger(tmp_path, True, tensorboard=False)
    for s in range(1, 6):
        log.log("train", s, loss=1.0)
    with open(tmp_path / "metrics.jsonl", "a") as fh:    # a node crash cut the record of step 6
        fh.write('{"kind": "train", "step": 6, "lo')
    log = RunLogger(tmp_path, True, tensorboard=False, resumed_step=3)
    log.log("train", 4, loss=2.0)
    assert [(r["step"], r["loss"]) for r in log.read() if r["kind"] == "train"] == \
        [(1, 1.0), (2, 1.0), (3, 1.0), (4, 2.0)]


def test_a_switch_is_not_taken_for_a_loss_scale():
    from config.errors import ConfigError
    with pytest.raises(ConfigError, match="option amp.loss_scale: True is not 'dynamic' or a positive number"):
        build_config("tiny", sets=["amp.loss_scale=true"])
    assert build_config("tiny", sets=["amp.loss_scale=128"]).amp.loss_scale == 128
