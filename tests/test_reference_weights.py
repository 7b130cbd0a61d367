"""Checkpoints in the authors' layout (`posenet.` keys under `weights`, SGD state by index, epoch,
Apex amp state) through every command that takes weights: train.py --weights, evaluate.py,
demo.py, the converter, and train.py --resume-reference continuing their run. Files are made by
`tests/reference_files.py` from rule weights, tiny-sized except one of the full imhn layout."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import demo
import evaluate
import train
import train_distributed
import train_parallel
from data.skeleton import builtin
from common.errors import run_cli
from config.loader import build_config
from config.schema import AmpConfig
from engine.precision import NativePrecision as Precision
from runtime.checkpoint import load_checkpoint, load_weights
from engine.optim import lr_at
from models import build_model
from engine.convert_reference import main as convert_main
from models.reference import FIRST_CONV, parameter_keys
from reference_files import model_entries, reference_file, rule_weights, to_reference, tsv_entries

COCO = builtin("coco")

APEX = {"loss_scaler0": {"loss_scale": 512.0, "unskipped": 37}}
QUICK = ["--set", "data.workers=0", "--set", "train.max_steps_per_epoch=1", "--batch-size", "2",
         "--set", "train.tensorboard=false", "--val-every", "0", "--set", "train.ap_every=0"]


@pytest.fixture(scope="module")
def tiny():
    cfg = build_config("tiny").model
    model = build_model(cfg, COCO)
    return cfg, model, rule_weights(model_entries(model, cfg.depth))


@pytest.fixture(scope="module")
def tiny_reference(tiny, tmp_path_factory):
    """A training checkpoint of the authors for the tiny network: DataParallel `module.` prefix,
    no BatchNorm counters, momentum buffer i filled with i, epoch 7, an Apex amp state."""
    path = tmp_path_factory.mktemp("reference") / "PoseNet_7_epoch.pth"
    return reference_file(path, tiny[2], module_prefix=True, counters=False, epoch=7, amp=APEX)


def test_the_authors_weights_load_with_names_mapped_and_the_first_conv_flipped(tiny, tiny_reference):
    cfg, _, weights = tiny
    model = build_model(cfg, COCO)
    report = load_weights(model, tiny_reference)
    assert report["converted"] and not report["missing"] and not report["unexpected"]
    state = model.state_dict()
    back = to_reference(state, model, cfg.depth)      # our weights written in the authors' layout
    counters = [k for k in back if k.endswith("num_batches_tracked")]
    assert all(int(back[k]) == 0 for k in counters)   # the file had none: they start at 0
    assert {k[len("posenet."):]: v for k, v in back.items() if k not in counters}.keys() == weights.keys()
    assert all(torch.equal(back["posenet." + k], v) for k, v in weights.items())
    first = weights["pre.conv1.weight"]
    assert torch.equal(state[FIRST_CONV], first[:, [2, 1, 0]])        # BGR input channels -> RGB


def test_train_weights_takes_the_authors_layout_and_says_it_converted(tiny_reference, synthetic_h5,
                                                                       tmp_path, capsys):
    train_h5, _ = synthetic_h5
    train.main(["--weights", str(tiny_reference), "--train-h5", str(train_h5), "--out-dir", str(tmp_path),
                "--run-name", "ft", "--epochs", "1", *QUICK])
    lines = [line for line in capsys.readouterr().out.splitlines() if "converted in memory" in line]
    assert len(lines) == 1 and lines[0].startswith(f"loaded weights from {tiny_reference}: 936 tensors")
    assert load_checkpoint(tmp_path / "ft" / "last.pth")["epoch"] == 1


@pytest.mark.parametrize("script", [train, train_parallel, train_distributed])
def test_another_shape_names_the_settings_that_differ(script, tiny_reference, tmp_path, capsys):
    code = run_cli(script.main, ["--weights", str(tiny_reference), "--set", "model.stacks=3",
                                 "--set", "model.channels=48", "--out-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert (f"error: --weights {tiny_reference} holds another network (model.stacks 2 there, 3 here; "
            "model.channels 32 there, 48 here): add --config tiny to build it") in err
    # where the network is built first (evaluate.py, demo.py with --set), the loader says the same
    cfg = build_config("tiny", sets=["model.stacks=3"]).model
    with pytest.raises(Exception, match=r"other settings \(model.stacks 2 there, 3 here\)"):
        load_weights(build_model(cfg, COCO), tiny_reference)


@pytest.mark.slow
def test_full_imhn_layout_loads_and_is_told_which_preset_builds_it(tmp_path, capsys):
    """The authors' full network, as their file stores it (counters, `posenet.`); constant tensors
    stored once (expanded) keep the file small, the first conv is real to see the flip."""
    entries = tsv_entries()
    weights = {k: torch.full((1,), 0.5).expand(shape) for k, shape in entries}
    weights["pre.conv1.weight"] = rule_weights(entries[:1])["pre.conv1.weight"]
    path = reference_file(tmp_path / "PoseNet_52_epoch.pth", weights, momentum=False)
    code = run_cli(train.main, ["--weights", str(path), "--out-dir", str(tmp_path)])   # tiny preset
    err = capsys.readouterr().err
    assert code == 2 and "model.stacks 4 there, 2 here" in err and "add --config imhn512 to build it" in err
    model = build_model(build_config("imhn512").model, COCO)
    report = load_weights(model, path)
    assert report["converted"] and report["loaded"] == len(model.state_dict())
    assert torch.equal(model.stem.conv[0].weight, weights["pre.conv1.weight"].flip(1))
    assert model.stacks[3].heads[4].predict.bias.eq(0.5).all()


def test_converter_writes_a_checkpoint_of_this_trainer(tiny, tiny_reference, tmp_path, capsys):
    cfg, _, weights = tiny
    out = tmp_path / "converted.pth"
    assert convert_main([str(tiny_reference), str(out), "--config", "tiny", "--set", "optim.name=sgd"]) == 0
    said = capsys.readouterr().out
    assert said.count("\n") == 1 and f"wrote {out}" in said and "SGD momentum of 498 of 498" in said
    state = load_checkpoint(out)
    assert state["config"]["model"] == build_config("tiny").model.__dict__ and state["epoch"] == 8
    assert state["scaler"] == {"scale": 512.0, "_growth_tracker": 37}
    model = build_model(cfg, COCO)
    load_weights(model, state)
    keys = parameter_keys(model, cfg.depth)              # reference parameter index -> our name
    ours = [name for name, _ in model.named_parameters()]
    momentum = state["optimizer"]["state"]
    assert all(momentum[ours.index(key)]["momentum_buffer"].eq(i).all() for i, key in enumerate(keys))
    # an existing file is never replaced
    assert convert_main([str(tiny_reference), str(out)]) == 2
    assert "already exists" in capsys.readouterr().err


@pytest.mark.slow         # many CPU-seconds
def test_evaluate_and_demo_take_the_authors_file_and_its_conversion_alike(tiny_reference, coco4_dir,
                                                                         tmp_path, capsys):
    converted = tmp_path / "converted.pth"
    assert convert_main([str(tiny_reference), str(converted)]) == 0    # imhn512 with the file's network
    capsys.readouterr()
    results = {}
    for weights in (tiny_reference, converted):
        out = tmp_path / f"{weights.stem}.json"
        code = evaluate.main(["--weights", str(weights), "--ann", str(coco4_dir / "test_coco.json"),
                              "--images", str(coco4_dir), "--max-images", "1", "--no-progress",
                              "--out", str(out), "--set", "data.input_size=128"])
        captured = capsys.readouterr()
        assert code == 0
        assert ("converted in memory" in captured.err) == (weights == tiny_reference)
        results[weights] = json.loads(out.read_text())
    assert results[tiny_reference] == results[converted]
    picture = tmp_path / "pose.png"
    assert demo.main(["--weights", str(tiny_reference), "--image", str(coco4_dir / "000000040083.jpg"),
                      "--out", str(picture), "--device", "cpu", "--set", "data.input_size=128"]) == 0
    assert "converted in memory" in capsys.readouterr().err and picture.is_file()


@pytest.mark.slow
def test_resume_reference_continues_the_authors_run(tiny_reference, synthetic_h5, tmp_path, capsys):
    """Epoch 7 finished there: the run goes on at epoch 8 (0-based) on the LR curve, with the
    momentum of every parameter and the Apex loss scale."""
    train_h5, _ = synthetic_h5
    argv = ["--resume-reference", str(tiny_reference), "--config", "tiny", "--set", "optim.name=sgd",
            "--train-h5", str(train_h5), "--out-dir", str(tmp_path), "--run-name", "go-on",
            "--epochs", "9", "--opt-level", "O1", "--amp-dtype", "float16", *QUICK]
    train.main(argv)
    out = capsys.readouterr().out
    assert "resumed from" in out and "epoch 9, batch 0 (the authors' run: SGD momentum of 498 of 498" in out
    assert "loss scale 512" in out
    run_dir = tmp_path / "go-on"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "train"]
    cfg = build_config("tiny", sets=["optim.name=sgd"])
    assert len(steps) == 1 and steps[0]["epoch"] == 8
    assert steps[0]["lr"] == pytest.approx(lr_at(cfg.optim, 8, 0, 1, epochs=9))
    assert lr_at(cfg.optim, 8, 0, 1, epochs=9) != lr_at(cfg.optim, 0, 0, 1, epochs=9)
    last = load_checkpoint(run_dir / "last.pth")
    assert last["epoch"] == 9 and last["step"] == 9
    assert last["scaler"]["scale"] in (512.0, 256.0)
    # their buffer of parameter index i was filled with i: one step later it is 0.9 i + gradient
    model = build_model(cfg.model, COCO)
    ours = [name for name, _ in model.named_parameters()]
    means = [float(last["optimizer"]["state"][ours.index(key)]["momentum_buffer"].mean())
             for key in parameter_keys(model, cfg.model.depth)]
    assert np.corrcoef(means, 0.9 * np.arange(len(means)))[0, 1] > 0.999


def test_resume_reference_refuses_an_optimiser_without_momentum(tiny_reference, tmp_path, capsys):
    code = run_cli(train.main, ["--resume-reference", str(tiny_reference), "--config", "tiny",
                                "--out-dir", str(tmp_path), *QUICK])
    assert code == 2 and "needs optim.name=sgd with momentum (this config: adamw)" in capsys.readouterr().err


def test_an_apex_loss_scale_maps_onto_the_grad_scaler():
    precision = Precision(AmpConfig(opt_level="O1", dtype="float16"), torch.device("cpu"))
    precision.load_state_dict({"scale": 512.0, "_growth_tracker": 37})
    state = precision.state_dict()
    assert state["scale"] == 512.0 and state["_growth_tracker"] == 37 and state["growth_interval"] == 2000
