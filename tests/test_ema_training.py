"""--ema and the validation pictures in real train.py runs: the EMA is what validation measures and
best.pth keeps, a stopped and resumed run continues it bit for bit, --weights takes it, and each
AP validation writes val_pictures/epoch_N.png."""
from __future__ import annotations

import json

import cv2
import pytest
import torch

import train
from config.loader import build_config
from runtime.checkpoint import load_checkpoint
from inference.val_pictures import HEADER, TILE
from test_train import QUICK
EMA = ["--ema", "0.9", "--set", "train.ema_tau=2", "--ap-every", "1", "--set", "train.ap_max_images=2",
       "--set", "train.val_pictures=2"]


def run(tmp_path, synthetic_h5, *extra):
    train_h5, val_h5 = synthetic_h5
    return train.main(["--train-h5", str(train_h5), "--val-h5", str(val_h5), "--out-dir", str(tmp_path),
                       *QUICK, *extra])


@pytest.fixture(scope="module")
def straight(tmp_path_factory, synthetic_h5):
    """The run directory of two epochs with --ema and AP validation each epoch."""
    out = tmp_path_factory.mktemp("ema")
    run(out, synthetic_h5, "--epochs", "2", "--run-name", "straight", *EMA)
    return out / "straight"


def validation_loss(weights: dict, saved_config: dict, val_h5) -> float:
    """The validation loss of `weights`, computed as the trainer's validation computes it."""
    from config.views import SampleSettings
    from data.dataset import KeypointDataset
    from engine.precision import NativePrecision as Precision
    from engine.loaders import to_model_input
    from runtime.distributed import DistContext
    from engine.build import ModelWithLoss
    from engine.loaders import val_loader
    from models import FocalL2Loss, build_model

    cfg = build_config(None, overrides={k: v for k, v in saved_config.items() if k != "preset"})
    dataset = KeypointDataset(val_h5, SampleSettings.of(cfg), train=False)
    model = build_model(cfg.model, dataset.skeleton)
    model.load_state_dict(weights)
    ctx = DistContext(device=torch.device("cpu"))
    net = ModelWithLoss(model, FocalL2Loss(cfg.loss, dataset.skeleton), Precision(cfg.amp, ctx.device)).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in val_loader(dataset, cfg.data, cfg.train.batch_size, ctx):
            per_sample, _ = net(*to_model_input(batch, ctx.device, dataset.painter_for(ctx.device)))
            total, count = total + per_sample.double().sum().item(), count + per_sample.numel()
    return total / count


def test_validation_and_best_pth_use_the_ema_weights(straight, synthetic_h5):
    last, best = load_checkpoint(straight / "last.pth"), load_checkpoint(straight / "best.pth")
    assert last["ema"]["updates"] == 6 and best["ema"]["updates"] in (3, 6)
    assert all(v.dtype == torch.float32 for v in last["ema"]["model"].values() if v.is_floating_point())
    val = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in val if r["kind"] == "val"]
    recorded = val[-1]["loss"]
    of_ema = validation_loss(last["ema"]["model"], last["config"], synthetic_h5[1])
    of_training = validation_loss(last["model"], last["config"], synthetic_h5[1])
    assert recorded == pytest.approx(of_ema, rel=1e-6)
    assert abs(of_training - of_ema) > 1e-4 * abs(of_ema)      # the two weights do differ


@pytest.mark.slow
def test_an_ema_run_stopped_and_resumed_equals_the_straight_run(straight, tmp_path, synthetic_h5):
    run(tmp_path, synthetic_h5, "--epochs", "1", "--run-name", "resumed", *EMA)
    run(tmp_path, synthetic_h5, "--epochs", "2", "--run-name", "resumed", "--resume", "auto", *EMA)
    a, b = load_checkpoint(straight / "last.pth"), load_checkpoint(tmp_path / "resumed/last.pth")
    assert a["ema"]["updates"] == b["ema"]["updates"] == 6
    assert a["ema"]["model"].keys() == b["ema"]["model"].keys()
    assert all(torch.equal(a["ema"]["model"][k], b["ema"]["model"][k]) for k in a["ema"]["model"])
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_weights_from_a_checkpoint_with_ema_take_the_ema(straight, tmp_path, synthetic_h5, capsys):
    run(tmp_path, synthetic_h5, "--epochs", "1", "--run-name", "tune", "--weights",
        str(straight / "best.pth"), "--set", "train.max_steps_per_epoch=1", "--val-every", "0")
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("loaded weights")]
    assert len(said) == 1 and "the EMA weights (decay 0.9, " in said[0], said


def test_each_ap_validation_writes_a_picture(straight, synthetic_h5):
    for epoch in (1, 2):
        picture = cv2.imread(str(straight / f"val_pictures/epoch_{epoch}.png"))
        assert picture is not None and picture.shape == (HEADER + 2 * TILE, 2 * TILE, 3)
    assert not list((straight / "val_pictures").glob(".*"))      # no temporary file left


@pytest.mark.slow
def test_two_ranks_hold_the_same_ema_and_rank_0_saves_it(tmp_path, synthetic_h5):
    from multiprocess_runs import data_args, dumps, forked_launch

    forked_launch([*data_args(synthetic_h5, tmp_path), "--epochs", "1", "--sync-bn", *EMA,
                   "--run-name", "ddp"])
    rank0, rank1 = (dump["ema"] for dump in dumps(tmp_path / "ddp"))
    assert rank0["updates"] == rank1["updates"] == 3
    assert all(torch.equal(rank0["model"][k], rank1["model"][k]) for k in rank0["model"])
    saved = load_checkpoint(tmp_path / "ddp/last.pth")["ema"]["model"]
    assert all(torch.equal(saved[k], rank0["model"][k]) for k in saved)
    assert (tmp_path / "ddp/val_pictures/epoch_1.png").is_file()      # drawn by rank 0 alone


def test_a_damaged_ema_in_the_checkpoint_resumed_is_one_error_line_naming_it(straight, tmp_path, synthetic_h5,
                                                                              capsys):
    from common.errors import run_cli
    from runtime.checkpoint import save_checkpoint

    state = load_checkpoint(straight / "last.pth")
    state["ema"] = {"decay": 0.9, "model": {}}                   # no "updates"
    damaged = tmp_path / "damaged" / "last.pth"
    damaged.parent.mkdir()
    save_checkpoint(damaged, state)
    before = damaged.read_bytes()
    capsys.readouterr()
    train_h5, val_h5 = synthetic_h5
    code = run_cli(train.main, ["--train-h5", str(train_h5), "--val-h5", str(val_h5),
                                "--resume", str(damaged), "--epochs", "3", *QUICK, *EMA])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and lines == [f"error: checkpoint {damaged}: its EMA state is damaged "
                                   "(expected 'updates' and 'model'); start from its weights with "
                                   "--weights"], lines
    assert damaged.read_bytes() == before
    assert {p.name for p in damaged.parent.iterdir()} - {".run.lock"} == {"last.pth"}


@pytest.mark.slow
def test_resuming_a_checkpoint_without_ema_under_ema_says_where_the_average_starts(tmp_path, synthetic_h5,
                                                                                  capsys):
    run(tmp_path, synthetic_h5, "--epochs", "1", "--run-name", "plain", "--val-every", "0")
    capsys.readouterr()
    run(tmp_path, synthetic_h5, "--epochs", "2", "--run-name", "plain", "--resume", "auto", "--ema", "0.9",
        "--val-every", "0")
    last = tmp_path / "plain" / "last.pth"
    said = [line for line in capsys.readouterr().out.splitlines() if "no EMA" in line]
    assert said == [f"checkpoint {last} has no EMA of the weights (its run had no --ema): the average starts "
                    "from its weights now, its decay warming up again"], said
    assert load_checkpoint(last)["ema"]["updates"] == 3


def test_resuming_an_ema_run_with_ema_0_says_the_average_is_dropped(straight, tmp_path, synthetic_h5,
                                                                     capsys):
    """The other direction of the test above was resumed without a word."""
    import shutil
    shutil.copytree(straight, tmp_path / "copy", ignore=shutil.ignore_patterns(".run.lock"))
    capsys.readouterr()
    run(tmp_path, synthetic_h5, "--epochs", "3", "--run-name", "copy", "--resume", "auto", "--ema", "0",
        "--val-every", "0", "--ap-every", "0")
    last = tmp_path / "copy" / "last.pth"
    assert f"--ema 0: the average of the weights in {last} is dropped; this run validates and keeps its own " \
           "weights (resume with --ema DECAY to continue the average)" in capsys.readouterr().out.splitlines()
    assert load_checkpoint(last)["epoch"] == 3 and "ema" not in load_checkpoint(last)
