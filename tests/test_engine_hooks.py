"""The engine's seams: a user's hook runs, sees every step and keeps its state in the
checkpoint; docs/extending.md's example of one runs as printed; the LR follows the total batch, the
same in every launch mode."""
from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import config
from config import build_config
from common.errors import CheckpointError
from runtime.checkpoint import load_checkpoint
from runtime.distributed import DistContext
from engine.cli import single_process_context
from engine.hooks import EpochEnd, Hook, LRSchedule, best_metric, default_hooks
from engine.optim import lr_at
from engine.run_trainer import Launch, build_trainer

EXTENDING = Path(__file__).resolve().parent.parent / "docs" / "extending.md"


def quick_sets(tmp_path, synthetic_h5, name: str) -> list[str]:
    return [f"data.train_h5={synthetic_h5[0]}", "data.workers=0", f"train.out_dir={tmp_path}",
            f"train.run_name={name}", "train.batch_size=2", "train.max_steps_per_epoch=1",
            "train.epochs=2", "train.val_every=0", "train.ap_every=0", "train.tensorboard=false",
            "train.device=cpu"]


class Recorder(Hook):
    checkpoint_key = "recorder"

    def __init__(self):
        self.events, self.losses, self.restored = [], [], None

    def before_epoch(self, trainer, epoch):
        self.events.append(("epoch", epoch))

    def before_step(self, trainer, epoch, first):
        self.events.append(("step", trainer.step, first))

    def after_step(self, trainer, out):
        self.losses.append((trainer.step, out.loss, out.lr, out.skipped))

    def on_stop(self, trainer):
        self.events.append(("stop",))

    def before_save(self, trainer, name, state):
        state["saved_as"] = name           # a hook may add to what a checkpoint holds

    def state_dict(self):
        return {"steps_seen": torch.tensor(len(self.losses))}

    def load_state_dict(self, state):
        self.restored = int(state["steps_seen"])


@pytest.mark.slow         # many CPU-seconds
def test_a_user_hook_sees_every_step_and_keeps_its_state_in_the_checkpoint(tmp_path, synthetic_h5):
    hook = Recorder()
    result = build_trainer(build_config("tiny", sets=quick_sets(tmp_path, synthetic_h5, "hooked")),
                           Launch(single_process_context("cpu")), hooks=[hook]).fit()
    assert result["step"] == 2
    assert hook.events == [("epoch", 0), ("step", 0, 0), ("epoch", 1), ("step", 1, 0), ("stop",)]
    assert [s for s, *_ in hook.losses] == [1, 2]
    assert all(loss > 0 and lr > 0 and not skipped for _, loss, lr, skipped in hook.losses)
    saved = load_checkpoint(tmp_path / "hooked/last.pth")
    assert int(saved["recorder"]["steps_seen"]) == 2 and saved["saved_as"] == "last.pth"
    again = Recorder()          # resumed (nothing left to train): the hook gets its state back
    sets = quick_sets(tmp_path, synthetic_h5, "hooked") + ["train.resume=auto"]
    build_trainer(build_config("tiny", sets=sets), Launch(single_process_context("cpu")), hooks=[again]).fit()
    assert again.restored == 2 and again.losses == []


def test_the_docs_hook_example_runs_as_printed(tmp_path, synthetic_h5, monkeypatch, capsys):
    example = next(block for block in re.findall(r"```python\n(.*?)```", EXTENDING.read_text(), re.S)
                   if "class SkippedSteps(Hook)" in block)
    assert len([line for line in example.splitlines() if line.strip()]) <= 16
    build = config.build_config
    fast = quick_sets(tmp_path, synthetic_h5, "x")[:-1]        # its own run name, the CPU already
    fast = [s for s in fast if not s.startswith(("train.run_name", "train.epochs"))]
    monkeypatch.setattr(config, "build_config", lambda preset, sets=(): build(preset, sets=[*sets, *fast]))
    exec(compile(example, str(EXTENDING), "exec"), {"__name__": "readme_example"})
    assert "0 of 1 steps skipped" in capsys.readouterr().out
    assert load_checkpoint(tmp_path / "hooked/last.pth")["skipped_steps_hook"] == {"skipped": 0}


def lr_of_mode(world_size: int, batch_size: int, accumulate: int, reference_batch: int) -> float:
    """The LR the engine's schedule hook sets for the first step after warm-up, in a run of
    `world_size` processes (1 for train.py and train_parallel.py)."""
    cfg = build_config("tiny", sets=[f"train.batch_size={batch_size}", f"train.accumulate={accumulate}",
                                     f"optim.reference_batch={reference_batch}", "optim.warmup_epochs=0"])
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    trainer = SimpleNamespace(accumulate=accumulate, batches_per_epoch=10 * accumulate, epochs=10,
                              optim_step=SimpleNamespace(set_lr=lambda lr: optimizer.param_groups[0]
                                                         .update(lr=lr)))
    hooks = default_hooks(cfg, checkpoints=None, logger=None, ctx=DistContext(world_size=world_size))
    next(hook for hook in hooks if isinstance(hook, LRSchedule)).before_step(trainer, 0, 0)
    return optimizer.param_groups[0]["lr"]


def test_the_lr_follows_the_total_batch_the_same_in_every_mode():
    lr = build_config("tiny").optim.lr
    # a total batch of 16: one process of 16, 2 processes of 8, 4 GPUs x 4 (DataParallel: one
    # process), or 8 accumulated twice: the LR is the same, lr x 16 / 8
    runs = [(1, 16, 1), (2, 16, 1), (4, 16, 1), (1, 8, 2), (2, 8, 2)]
    assert [lr_of_mode(*run, reference_batch=8) for run in runs] == pytest.approx([2 * lr] * len(runs))
    # no reference batch (the default): optim.lr at any total batch and in any mode
    assert [lr_of_mode(*run, reference_batch=0) for run in runs] == pytest.approx([lr] * len(runs))
    assert build_config("tiny").optim.reference_batch == 0
    optim = build_config("tiny", sets=["optim.reference_batch=4"]).optim
    quadruple = lr_at(optim, 50, 0, 10, total_batch=16, epochs=60)
    assert quadruple == pytest.approx(4 * lr_at(optim, 50, 0, 10, total_batch=4, epochs=60))


def epoch_end(values: list[dict], metric: str = "loss", patience: int = 0, ap_every: int = 1):
    """An `EpochEnd` whose validations give `values` in turn, on a stand-in loop; (the hook, the
    checkpoints it saves as (name, epoch), the loop, the lines it says)."""
    saved, said = [], []
    checkpoints = SimpleNamespace(save=lambda trainer, name, epoch, *rest, **pending: saved.append((name, epoch)))
    logger = SimpleNamespace(log=lambda *args, **kwargs: None, plot_curves=lambda: None)
    train = build_config("tiny", sets=["train.val_every=1", f"train.early_stop_patience={patience}",
                                       f"train.ap_every={ap_every}"]).train
    hook = EpochEnd(train, checkpoints, logger, said.append, SimpleNamespace(), metric)
    hook.validate = lambda trainer, epoch, *due: values[epoch]
    trainer = SimpleNamespace(hooks=[hook], epochs=len(values), step=0, finish_requested=False)
    return hook, saved, trainer, said


def test_the_epoch_end_decides_best_pth_and_early_stopping_in_one_place():
    hook, saved, trainer, said = epoch_end([{"loss": 3.0}, {"loss": 2.0}, {"loss": 2.5}, {}, {"loss": 2.1}],
                                           patience=2)
    for epoch in range(5):
        hook.after_epoch(trainer, epoch, 1.0)
    assert [s for s in saved if s[0] == "best.pth"] == [("best.pth", 1), ("best.pth", 2)]  # improved twice
    assert hook.state_dict() == {"best_metric": 2.0, "bad_validations": 2,   # a pass without a loss: none
                                 "best_loss": 2.0}
    assert trainer.finish_requested
    assert hook.outcome() == {"loss": 2.1, "best_metric": 2.0, "early_stopped": True}
    assert [line for line in said if "best" in line] == ["epoch 1/5: train loss 1, val loss 3 (best)",
                                                         "epoch 2/5: train loss 1, val loss 2 (best)"]
    assert said[-1] == "early stop after epoch 5: no improvement in 2 validations"
    resumed = epoch_end([{"loss": 2.05}], patience=2)[0]
    resumed.load_state_dict(hook.state_dict())
    assert resumed.judge({"loss": 2.05}) is False and resumed.bad_validations == 3
    with pytest.raises(CheckpointError, match="its bad_validations is damaged"):
        resumed.load_state_dict({"best_metric": 1.0, "bad_validations": -1})
    ap = epoch_end([], metric="AP")[0]                            # AP: higher is better
    assert [ap.judge({"AP": value, "loss": 1.0}) for value in (0.2, 0.1, 0.3)] == [True, False, True]


@pytest.mark.parametrize("name, values, best_value", [
    ("fly", [0.5, 0.7, 0.6], 0.7),       # PCK first: higher is better; AP is not even measured
    ("coco", [0.5, 0.7, 0.6], 0.7),
])
def test_best_pth_follows_the_skeletons_first_metric(name, values, best_value):
    from dataclasses import replace

    from data.skeleton import Scoring, builtin

    key = "PCK" if name == "fly" else "AP"
    measured, unmeasured = (build_config("tiny", sets=[f"train.ap_every={n}"]).train for n in (1, 0))
    assert best_metric(measured, builtin(name)) == key and best_metric(unmeasured, builtin(name)) == "loss"
    hook = epoch_end([], metric=best_metric(measured, builtin(name)))[0]
    for value in values:
        hook.judge({key: value, "loss": 1.0})
    assert hook.best == best_value
    epe = epoch_end([], metric=replace(builtin("fly"), scoring=Scoring(("epe", "pck"))).scoring.key)[0]
    for value in (3.0, 2.0, 2.5):                                 # EPE: lower is better
        epe.judge({"EPE": value, "PCK": 1 / value})
    assert epe.best == 2.0


@pytest.mark.parametrize("saved_best", [None, float("nan")])    # a fresh run; one resumed from a NaN best
def test_a_nan_validation_loss_is_never_the_best_and_never_blocks_a_later_one(saved_best):
    """A float16 validation that overflowed (loss NaN) must not become best.pth, nor the value every
    later loss is compared with (NaN < x is false: best.pth would never be written again)."""
    hook, saved, trainer, _ = epoch_end([{"loss": loss} for loss in (float("nan"), 2.0, float("inf"), 1.5)],
                                        patience=3)
    hook.load_state_dict({"best_metric": saved_best})
    for epoch in range(4):
        hook.after_epoch(trainer, epoch, 1.0)
    assert [s for s in saved if s[0] == "best.pth"] == [("best.pth", 2), ("best.pth", 4)]
    assert hook.best == 1.5 and hook.bad_validations == 0


def test_a_validation_that_finds_nobody_is_never_best_and_ties_go_to_the_lower_validation_loss():
    """EPE and AP are -1 when nothing was found: never a score (EPE -1 used to beat every real error)."""
    epe, saved, trainer, _ = epoch_end([{"EPE": 3.0, "loss": 1.0}, {"EPE": -1.0, "loss": 1.0},
                                        {"EPE": 2.0, "loss": 1.0}], metric="EPE")
    for epoch in range(3):
        epe.after_epoch(trainer, epoch, 1.0)
    assert [s for s in saved if s[0] == "best.pth"] == [("best.pth", 1), ("best.pth", 3)] and epe.best == 2.0
    nobody = epoch_end([], metric="AP")[0]
    assert nobody.judge({"AP": -1.0, "loss": 1.0}) is False and nobody.best is None
    ties, saved, trainer, said = epoch_end([{"AP": 0.0, "loss": 3.0}, {"AP": 0.0, "loss": 2.0},
                                            {"AP": 0.0, "loss": 2.5}], metric="AP")
    for epoch in range(3):
        ties.judge(ties.validate(trainer, epoch), epoch) and saved.append(("best.pth", epoch + 1))
    assert saved == [("best.pth", 1), ("best.pth", 2)] and ties.best_loss == 2.0
    assert said == ["epoch 2 ties the best AP 0: its validation loss 2 is below the best's 3, so it "
                    "becomes best.pth",
                    "epoch 3 ties the best AP 0: its validation loss 2.5 is not below the best's 2, so "
                    "best.pth stays"]


def test_a_validation_loss_orders_of_magnitude_above_the_training_loss_is_said_once():
    hook, _, trainer, said = epoch_end([{"loss": 6.3e7}, {"loss": 3.5e15}, {"loss": 4.0}])
    for epoch in range(3):
        hook.after_epoch(trainer, epoch, 5.0)
    lines = [line for line in said if "BatchNorm" in line]
    assert lines == ["the validation loss 6.3e+07 is 1.26e+07 x the training loss 5: BatchNorm's running "
                     "statistics likely come from pictures of another domain (the --weights' data); they "
                     "follow this data as training goes on"]


def test_early_stopping_is_carried_across_a_resume():
    """A run early stopping ended stays ended; one stopped at --epochs 2 of 6 (whose last epoch
    measured AP off the --ap-every 5 schedule) and continued judges as the straight run."""
    hook, _, trainer, _ = epoch_end([{"loss": 2.0}, {"loss": 3.0}, {"loss": 3.0}], patience=2)
    for epoch in range(3):
        hook.after_epoch(trainer, epoch, 1.0)
    assert trainer.finish_requested
    resumed, _, again, said = epoch_end([{"loss": 1.0}] * 5, patience=2)
    resumed.load_state_dict(hook.state_dict())
    again.resumed, again.epoch = SimpleNamespace(validation_pending=False), 3
    resumed.before_train(again)
    assert again.finish_requested and resumed.outcome()["early_stopped"]
    assert said == ["the run was ended by early stopping after epoch 3 (2 validations without improvement): "
                    "nothing to train; a larger --early-stop continues it"]
    values = [{"loss": 1.0}] * 4 + [{"loss": 1.0, "AP": 0.3}, {"loss": 1.0, "AP": 0.2}]
    straight, straight_saved, loop, _ = epoch_end(values, metric="AP", patience=1, ap_every=5)
    for epoch in range(6):
        straight.after_epoch(loop, epoch, 1.0)
    short, short_saved, loop, _ = epoch_end([{"loss": 1.0}, {"loss": 1.0, "AP": 0.5}], metric="AP",
                                            patience=1, ap_every=5)
    for epoch in range(2):
        short.after_epoch(loop, epoch, 1.0)
    assert ("best.pth", 2) in short_saved            # its only AP: the best there is, for now
    longer, longer_saved, loop, _ = epoch_end(values, metric="AP", patience=1, ap_every=5)
    longer.load_state_dict(short.state_dict())
    for epoch in range(2, 6):
        longer.after_epoch(loop, epoch, 1.0)
    assert longer.state_dict() == straight.state_dict() and longer.stopped == straight.stopped
    best_of = lambda saved: [s for s in saved if s[0] == "best.pth"]      # noqa: E731
    assert best_of(longer_saved) == best_of(straight_saved) == [("best.pth", 5)]


def test_a_steps_note_reaches_the_console_once_through_the_train_log():
    """O3's first update says how many updates round away (`StepResult.note`): `TrainLog` hands
    it to the run's console; a step without a note says nothing."""
    from engine.hooks import TrainLog
    from engine.trainer import StepResult

    said, steps = [], []
    logger = SimpleNamespace(log_step=lambda step, loss: steps.append(step), log=lambda *a, **k: None)
    hook = TrainLog(logger, log_every=100, say=said.append)
    trainer = SimpleNamespace(step=1, optim_step=SimpleNamespace(skipped_total=0))
    note = "20% of the first step's updates round away"
    hook.after_step(trainer, StepResult(1.0, 0.1, False, False, note=note))
    trainer.step = 2
    hook.after_step(trainer, StepResult(1.0, 0.1, False, False))
    assert said == [note] and steps == [1, 2]
