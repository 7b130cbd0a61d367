"""Issue 47, class 5: an option that would have no effect in a command is refused by one rule
(`common.errors.refuse_inapplicable`): one `error:` line naming it and why, exit code 2, nothing
written. evaluate.py's cases are in tests/test_evaluate.py.
"""
from __future__ import annotations

import importlib

import pytest

from bad_inputs import one_error_line
from common.errors import run_cli

CONVERT = ["--ann", "C/test_coco.json", "--images", "C/", "--out", "T/o.h5"]
CASES = {   # name: (module, argv with T the test's folder and C coco4's, what the line says)
    "make_hdf5 --list-skeletons with a split": (
        "data.make_hdf5", ["--list-skeletons", "--split", "val"],
        "option --split does not apply with --list-skeletons: it lists the built-in skeletons"),
    "make_hdf5 options of a conversion without --out": (
        "data.make_hdf5", ["--ann", "C/test_coco.json", "--images", "C/", "--dump-skeleton", "T/s.yaml",
                           "--keep-all", "--max-images", "2", "--quiet"],
        "options --keep-all and --max-images and --quiet do not apply without --out: nothing is converted"),
    "make_hdf5 --keep-all on the val split": (
        "data.make_hdf5", [*CONVERT, "--split", "val", "--keep-all"],
        "option --keep-all does not apply to --split val: it keeps every image"),
    "make_hdf5 --links-from with a built-in skeleton": (
        "data.make_hdf5", [*CONVERT, "--links-from", "0"],
        "option --links-from does not apply here: the skeleton is built-in coco, so the JSON's links "
        "(categories[].skeleton) are not read"),
    "make_hdf5 --links-from with --skeleton": (
        "data.make_hdf5", [*CONVERT, "--links-from", "1", "--skeleton", "coco"],
        "the skeleton is --skeleton coco, so the JSON's links"),
    "demo --out of the camera": (
        "demo", ["--weights", "T/w.pth", "--camera", "0", "--out", "T/o.mp4", "--overwrite"],
        "options --out and --overwrite do not apply to --camera: its frames are shown in a live window"),
    "demo --preset of an ONNX file": (
        "demo", ["--weights", "T/w.onnx", "--image", "C/000000197388.jpg", "--out", "T/o.png", "--preset",
                 "tiny"],
        "option --preset does not apply to an ONNX --weights: the file carries its own config"),
    "export --preset of a trainer's checkpoint": (
        "export", ["--weights", "T/run.pth", "--out", "T/o.onnx", "--preset", "tiny"],
        "option --preset does not apply to a checkpoint of this trainer: it carries its own config"),
    "train --loss-scale in float32": (
        "train", ["--loss-scale", "128"], "option --loss-scale does not apply to this run: only float16"),
    "train --loss-scale in bfloat16": (
        "train", ["--opt-level", "O1", "--amp-dtype", "bfloat16", "--loss-scale", "dynamic"],
        "option --loss-scale does not apply to this run: only float16 training"),
    "train --amp-dtype at O0": (
        "train", ["--amp-dtype", "float16"], "option --amp-dtype does not apply at --opt-level O0: it trains "
        "in float32"),
    "train --keep-batchnorm-fp32 at O1": (
        "train", ["--opt-level", "O1", "--keep-batchnorm-fp32", "True"],
        "option --keep-batchnorm-fp32 does not apply at --opt-level O1: only O2 and O3"),
    "train --allow-partial without --weights": (
        "train_distributed", ["--allow-partial"], "option --allow-partial does not apply without --weights"),
    "train --early-stop without validation": (
        "train", ["--early-stop", "3", "--val-every", "0", "--ap-every", "0"],
        "option --early-stop does not apply with --val-every 0 and --ap-every 0: it counts validations"),
    "train_parallel --gpus on the CPU": (
        "train_parallel", ["--gpus", "0", "--device", "cpu"], "option --gpus does not apply on the CPU"),
}


@pytest.fixture
def trainer_checkpoint(tmp_path):
    from config.loader import build_config, to_dict
    from runtime.checkpoint import save_checkpoint
    save_checkpoint(tmp_path / "run.pth", {"config": to_dict(build_config("tiny")), "model": {}})


@pytest.mark.parametrize("name", CASES)
def test_an_option_that_does_not_apply_is_refused_naming_it(name, tmp_path, coco4_dir, capsys,
                                                            trainer_checkpoint):
    module, argv, says = CASES[name]
    folders = {"C/": f"{coco4_dir}/", "T/": f"{tmp_path}/"}
    argv = [folders[a[:2]] + a[2:] if a[:2] in folders else a for a in argv]
    before = sorted(tmp_path.iterdir())
    main = importlib.import_module(module).main
    if module.startswith("train"):      # a run that is not refused ends soon
        argv += ["--out-dir", str(tmp_path), "--epochs", "1", "--set", "train.max_steps_per_epoch=1"]
    code = run_cli(main, argv) if module.startswith("train") else main(argv)
    assert code == 2
    assert says in one_error_line(capsys.readouterr().err)
    assert sorted(tmp_path.iterdir()) == before                 # nothing written
