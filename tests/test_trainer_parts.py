"""The loop apart from its assembly: a `Trainer` built from a model, a loss, an optimiser step and
batches alone (no configuration, no run directory), and docs/extending.md's run whose loss a
`TrainerBuilder` subclass replaces."""
from __future__ import annotations

import os
import re
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

import pytest

from config import build_config
from config.schema import AmpConfig, OptimConfig
from runtime.checkpoint import load_checkpoint
from engine.ema import WeightsEMA
from engine.hooks import EpochEnd, Hook, default_hooks
from engine.logger import RunLogger
from engine.build import ModelWithLoss
from engine.optim import OptimStep, lr_at
from engine.precision import NativePrecision as Precision
from engine.checkpoints import Checkpoints
from engine.trainer import StepResult, Trainer, LoopInputs

EXTENDING = Path(__file__).resolve().parent.parent / "docs" / "extending.md"



class SquaredError(nn.Module):
    def forward(self, outputs, target, mask):
        per_sample = ((outputs - target) ** 2 * mask).flatten(1).sum(1)
        return per_sample, {"squared": per_sample.detach()}


class Steps(Hook):
    def __init__(self):
        self.seen = []

    def after_step(self, trainer, out):
        self.seen.append(out)


def test_a_trainer_runs_from_a_model_a_loss_an_optimiser_step_and_batches(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    model = nn.Conv2d(3, 2, 3, padding=1)
    precision = Precision(AmpConfig(), torch.device("cpu"))
    optimizer = torch.optim.SGD(model.parameters(), lr=2e-3)
    step = OptimStep(precision, optimizer, list(model.parameters()), model, OptimConfig())
    images = torch.randn(4, 3, 8, 8)
    inputs = [(images[i:i + 2], images[i:i + 2, :2] * 0.5, torch.ones(2, 1, 8, 8)) for i in (0, 2)]
    hook = Steps()
    parts = LoopInputs(ModelWithLoss(model, SquaredError(), precision), step, LoopInputs.feed(inputs),
                       batches_per_epoch=2, epochs=3)
    result = Trainer(parts, [hook]).fit()
    assert result == {"epoch": 3, "step": 6}
    assert all(isinstance(out, StepResult) and not out.skipped for out in hook.seen)
    assert [(out.epoch, out.first, out.last_of_epoch) for out in hook.seen[:2]] == [(0, 0, False), (0, 1, True)]
    losses = [out.loss for out in hook.seen]
    assert losses[-1] < 0.5 * losses[0]                  # it learnt the target, step by step
    assert set(hook.seen[0].loss_parts) == {"squared"}
    assert os.listdir(tmp_path) == []                     # no run directory, no file of any kind


def test_a_bare_trainer_runs_with_the_engines_default_hooks(tmp_path):
    """The engine's hooks take their settings when they are made and read the loop alone: a bare
    `Trainer` runs with them, writes checkpoints and logs, keeps best.pth and stops early."""
    def parts_and_hooks(validations):
        torch.manual_seed(0)
        model = nn.Conv2d(3, 2, 3, padding=1)
        precision = Precision(AmpConfig(), torch.device("cpu"))
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        step = OptimStep(precision, optimizer, list(model.parameters()), model, OptimConfig())
        checkpoints = Checkpoints(tmp_path, model, optimizer, precision)
        hooks = default_hooks(cfg, checkpoints, logger, said.append, validator=SimpleNamespace())
        next(h for h in hooks if isinstance(h, EpochEnd)).validate = lambda trainer, epoch, *due: validations[epoch]
        parts = LoopInputs(ModelWithLoss(model, SquaredError(), precision), step, LoopInputs.feed(inputs),
                           batches_per_epoch=2, epochs=4, model=model)
        return Trainer(parts, hooks), checkpoints

    cfg = build_config("tiny", sets=["train.val_every=1", "train.ap_every=0", "train.early_stop_patience=1",
                                     "train.log_every=1", "train.ema=0.5"])
    images = torch.randn(4, 3, 8, 8)
    inputs = [(images[i:i + 2], images[i:i + 2, :2] * 0.5, torch.ones(2, 1, 8, 8)) for i in (0, 2)]
    logger, said = RunLogger(tmp_path, True, tensorboard=False).open(), []
    trainer, _ = parts_and_hooks([{"loss": 2.0}, {"loss": 1.0}, {"loss": 1.5}, {"loss": 0.5}])
    assert trainer.fit() == {"epoch": 3, "step": 6, "loss": 1.5, "best_metric": 1.0, "early_stopped": True}
    train = [r for r in logger.read() if r["kind"] == "train"]
    assert [r["lr"] for r in train] == pytest.approx([lr_at(cfg.optim, e, b, 2, total_batch=8, epochs=4)
                                                      for e in range(3) for b in (0, 1)])
    assert [r["loss"] for r in logger.read() if r["kind"] == "val"] == [2.0, 1.0, 1.5]
    best, last = load_checkpoint(tmp_path / "best.pth"), load_checkpoint(tmp_path / "last.pth")
    assert (best["epoch"], best["best_metric"], last["epoch"], last["bad_validations"]) == (2, 1.0, 3, 1)
    assert last["ema"]["updates"] == 6
    assert said[-1] == "early stop after epoch 3: no improvement in 1 validations"
    again, checkpoints = parts_and_hooks([])           # resumed: the loop and every hook where they were
    checkpoints.restore(again, last, tmp_path / "last.pth", said.append)
    ema, end = (next(h for h in again.hooks if isinstance(h, kind)) for kind in (WeightsEMA, EpochEnd))
    assert (again.epoch, again.step, ema.updates) == (3, 6, 6)
    assert end.state_dict() == {"best_metric": 1.0, "bad_validations": 1, "best_loss": 1.0}


def test_accumulated_steps_take_the_model_inputs_of_several_batches():
    torch.manual_seed(0)
    model = nn.Conv2d(3, 2, 1)
    precision = Precision(AmpConfig(), torch.device("cpu"))
    step = OptimStep(precision, torch.optim.SGD(model.parameters(), lr=0.1), list(model.parameters()),
                     model, OptimConfig())
    images = torch.randn(4, 3, 4, 4)
    inputs = [(images[i:i + 1], torch.zeros(1, 2, 4, 4), torch.ones(1, 1, 4, 4)) for i in range(4)]
    trainer = Trainer(LoopInputs(ModelWithLoss(model, SquaredError(), precision), step,
                                 LoopInputs.feed(inputs), batches_per_epoch=4, accumulate=2))
    assert trainer.fit() == {"epoch": 1, "step": 2}


def test_the_docs_loss_example_replaces_the_loss_of_a_run(tmp_path, synthetic_h5, monkeypatch, capsys):
    example = next(block for block in re.findall(r"```python\n(.*?)```", EXTENDING.read_text(), re.S)
                   if "def build_loss" in block)
    loss = example[example.index("class LastStackL2"):example.index("cfg = ")]
    assert len([line for line in loss.splitlines() if line.strip()]) <= 10    # the loss, in ten lines
    import config
    build = config.build_config
    fast = [f"data.train_h5={synthetic_h5[0]}", "data.workers=0", f"train.out_dir={tmp_path}",
            "train.batch_size=2", "train.max_steps_per_epoch=2", "train.epochs=1", "train.val_every=0",
            "train.ap_every=0", "train.tensorboard=false", "data.input_size=64"]
    monkeypatch.setattr(config, "build_config", lambda preset, sets=(): build(preset, sets=[*sets, *fast]))
    from models import FocalL2Loss
    called = []
    monkeypatch.setattr(FocalL2Loss, "forward", lambda *args: called.append(1))
    namespace = {"__name__": "loss_example"}
    exec(compile(example, str(EXTENDING), "exec"), namespace)
    assert called == []                                   # the focal loss never ran
    assert (tmp_path / "l2/last.pth").is_file() and "done." in capsys.readouterr().out
    lines = (tmp_path / "l2/metrics.jsonl").read_text()
    assert '"l2"' in lines and '"keypoints"' not in lines  # the log holds the new loss's parts


def test_the_seams_are_typed_the_optimiser_step_and_what_a_run_starts_from(tmp_path):
    """The loop's `OptimiserStep` Protocol names what it uses, which `OptimStep` has; `load_start`
    says what a run starts from by name (it was a tuple read as `start[3]`)."""
    from dataclasses import replace

    from data.skeleton import builtin
    from engine.checkpoints import Start, load_start
    from engine.trainer import OptimiserStep

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    step = OptimStep(Precision(AmpConfig(), torch.device("cpu")), torch.optim.SGD(model.parameters(), lr=0.1),
                     list(model.parameters()), model, OptimConfig())
    names = {n for n in vars(OptimiserStep) if not n.startswith("_")} | set(OptimiserStep.__annotations__)
    assert names == {"skipped_total", "bad_streak", "overflow_streak", "update", "set_lr"}
    assert all(hasattr(step, name) for name in names)
    torch.save({"model": {k: v for k, v in model.state_dict().items() if k.startswith("0.")}}, tmp_path / "w.pth")
    train = replace(build_config("tiny").train, weights=str(tmp_path / "w.pth"), allow_partial=True)
    start = load_start(model, None, train, builtin("coco"), lambda line: None)
    assert start == Start(fresh=["1.weight", "1.bias"]) and start.state is None and start.path is None


def test_a_bare_trainer_validates_with_the_builders_validator(tmp_path, synthetic_h5):
    """Validation included, without a stand-in: the parts and the `Validator` a `TrainerBuilder`
    builds, under a bare `Trainer` with the engine's hooks and no run around them."""
    from engine.build import TrainerBuilder
    from engine.cli import single_process_context
    from engine.run_trainer import Launch, loop_inputs

    cfg = build_config("tiny", sets=[f"data.train_h5={synthetic_h5[0]}", f"data.val_h5={synthetic_h5[1]}",
                                     "data.workers=0", "train.batch_size=2", "train.max_steps_per_epoch=1",
                                     "train.epochs=2", "train.val_every=1", "train.ap_every=0",
                                     "data.input_size=64", "train.tensorboard=false"])
    launch, builder = Launch(single_process_context("cpu")), TrainerBuilder()
    parts = builder.build(cfg, launch)
    validator = builder.build_validator(cfg, launch.ctx, parts)
    checkpoints = Checkpoints(tmp_path, parts.model, parts.optimizer, parts.precision)
    logger, said = RunLogger(tmp_path, True, tensorboard=False).open(), []
    hooks = default_hooks(cfg, checkpoints, logger, said.append, validator=validator)
    result = Trainer(loop_inputs(cfg.train, parts, launch.ctx.device), hooks).fit()
    losses = [r["loss"] for r in logger.read() if r["kind"] == "val"]
    assert len(losses) == 2 and all(loss > 0 for loss in losses) and result["loss"] == losses[-1]
    assert load_checkpoint(tmp_path / "best.pth")["best_metric"] == min(losses)
    assert validator.loader is not None and said[-1].startswith("epoch 2/2: train loss ")
