"""Skeletons from the data: COCO with the method's channels, CrowdPose, inferred ones, fine-tuning across
skeletons, and every bad skeleton as one error line."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

import evaluate
import train
from common.errors import run_cli
from config.loader import build_config
from config.schema import InferenceConfig, TargetConfig
from data.skeleton import DEFAULT_SIGMA, builtin, from_checkpoint
from config.views import SampleSettings
from data.dataset import KeypointDataset
from data.h5format import KeypointH5
from data.make_hdf5 import ConvertSettings, convert, main as make_hdf5
from data.targets import render_targets
from runtime.checkpoint import load_checkpoint, load_weights
from inference.evaluation import oracle_maps
from inference.grouping import group_people
from models import build_model

DIGEST = Path(__file__).resolve().parent / "data" / "coco4_targets_digest.json"
QUICK = ["--set", "data.workers=0", "--set", "train.tensorboard=false", "--epochs", "1",
         "--set", "train.max_steps_per_epoch=1", "--batch-size", "2"]
CROWDPOSE = builtin("crowdpose")


# -- COCO: the targets of before, bit for bit ------------------------------------------------------
def test_coco_builtin_gives_the_targets_of_before_bit_for_bit(coco4_dir, tmp_path):
    """tests/data/coco4_targets_digest.json was computed by the code before skeletons existed
    (commit 68f2375): augmented train samples (flips included) of two epochs, centred val samples
    and the oracle maps at image size."""
    expected = json.loads(DIGEST.read_text())
    cfg = build_config("tiny", sets=["augment.flip_prob=0.5"])
    found = {}
    for split in ("train", "val"):
        convert(coco4_dir / "test_coco.json", coco4_dir, tmp_path / f"{split}.h5",
                ConvertSettings(split=split, progress=False))
        dataset = KeypointDataset(tmp_path / f"{split}.h5", SampleSettings.of(cfg), train=split == "train")
        assert dataset.skeleton == builtin("coco")
        for epoch in (0, 1):
            dataset.set_epoch(epoch)
            for i in range(len(dataset)):
                sample = dataset.sample_arrays(i)
                digest = hashlib.sha256(sample["target"].tobytes() + sample["people"].tobytes())
                found[f"{split}/{epoch}/{i}/flip{int(sample['params'].flip)}"] = digest.hexdigest()[:16]
    h5 = KeypointH5(tmp_path / "val.h5")
    for img in range(h5.num_images):
        maps, factor = oracle_maps(h5, img, cfg.targets)
        assert factor == 1.0
        found[f"oracle/{img}"] = hashlib.sha256(maps.tobytes()).hexdigest()[:16]
    assert found == expected
    assert sum(k.endswith("flip1") for k in found) > 5


def test_files_and_checkpoints_without_a_skeleton_are_coco(coco4_dir, tmp_path):
    path = tmp_path / "old.h5"
    convert(coco4_dir / "test_coco.json", coco4_dir, path, ConvertSettings(split="val", progress=False))
    with h5py.File(path, "a") as f:          # as written before the skeleton was stored
        del f.attrs["skeleton"]
    h5 = KeypointH5(path)
    assert h5.skeleton == builtin("coco") and h5.people(0).shape[1:] == (18, 3)
    assert from_checkpoint({"model": {}}) == builtin("coco") and builtin("coco").num_channels == 50


# -- CrowdPose ------------------------------------------------------------------------------------
def crowdpose_json(coco4_dir: Path, out: Path) -> Path:
    """coco4 in CrowdPose's layout: its 14 keypoints and order, head and neck, no area, and the
    category's skeleton as CrowdPose's files have it (COCO's 1-based links, useless for 14)."""
    data = json.loads((coco4_dir / "test_coco.json").read_text())
    coco = builtin("coco").dataset_keypoints
    for ann in data["annotations"]:
        kp = np.asarray(ann["keypoints"], float).reshape(17, 3)
        rows = [kp[coco.index(n)] for n in CROWDPOSE.dataset_keypoints[:12]]
        shoulders = kp[[coco.index("left_shoulder"), coco.index("right_shoulder")]]
        neck = ([*shoulders[:, :2].mean(0), 2] if (shoulders[:, 2] > 0).all() else [0, 0, 0])
        rows += [kp[coco.index("nose")], neck]                      # head: the nose stands in
        ann["keypoints"] = np.asarray(rows).reshape(-1).round(2).tolist()
        ann["num_keypoints"] = int((np.asarray(rows)[:, 2] > 0).sum())
        ann.pop("area", None)
    category = dict(data["categories"][0], keypoints=list(CROWDPOSE.dataset_keypoints))
    data["categories"] = [category]
    out.write_text(json.dumps(data))
    return out


@pytest.mark.slow
def test_a_crowdpose_file_converts_trains_a_step_and_evaluates(coco4_dir, tmp_path, capsys):
    ann = crowdpose_json(coco4_dir, tmp_path / "crowdpose.json")
    for split in ("train", "val"):
        assert make_hdf5(["--ann", str(ann), "--images", str(coco4_dir), "--out",
                          str(tmp_path / f"{split}.h5"), "--split", split, "--quiet"]) == 0
        assert "built-in skeleton crowdpose" in capsys.readouterr().out
    h5 = KeypointH5(tmp_path / "val.h5")
    assert h5.skeleton == CROWDPOSE and h5.people(0).shape[1:] == (14, 3)
    assert all("area" in a for a in h5.annotations(0))        # filled in for COCOeval
    done = train.main(["--train-h5", str(tmp_path / "train.h5"), "--val-h5", str(tmp_path / "val.h5"),
                       "--out-dir", str(tmp_path), "--run-name", "cp", "--ap-every", "1",
                       "--set", "train.ap_max_images=2", *QUICK])
    assert done["step"] == 1 and 0.0 <= done["AP"] <= 1.0
    ckpt = load_checkpoint(tmp_path / "cp" / "last.pth")
    assert from_checkpoint(ckpt) == CROWDPOSE
    channels = {v.shape[0] for k, v in ckpt["model"].items() if k.endswith(".bias")}
    assert 36 in channels and 50 not in channels                   # 20 limbs + 14 keypoints + 2
    capsys.readouterr()
    out = tmp_path / "results.json"
    assert evaluate.main(["--weights", str(tmp_path / "cp" / "last.pth"), "--h5", str(tmp_path / "val.h5"),
                          "--out", str(out), "--no-progress", "--max-images", "2"]) == 0
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert stats["num_images"] == 2 and 0.0 <= stats["AP"] <= 1.0
    assert all(len(r["keypoints"]) == 14 * 3 for r in json.loads(out.read_text()))
    convert(coco4_dir / "test_coco.json", coco4_dir, tmp_path / "coco.h5",
            ConvertSettings(split="val", progress=False))
    assert evaluate.main(["--weights", str(tmp_path / "cp" / "last.pth"), "--h5", str(tmp_path / "coco.h5"),
                          "--out", str(out), "--overwrite", "--no-progress"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {tmp_path / 'coco.h5'}: its people have skeleton coco, 18 keypoints, 50 channels but the "
        "model was trained on crowdpose, 14 keypoints, 36 channels"]


def test_the_oracle_scores_with_the_skeleton_sigmas(coco4_dir, tmp_path, capsys):
    ann = crowdpose_json(coco4_dir, tmp_path / "crowdpose.json")
    convert(ann, coco4_dir, tmp_path / "val.h5", ConvertSettings(split="val", progress=False))
    assert evaluate.main(["--oracle", "--h5", str(tmp_path / "val.h5"), "--preset", "tiny",
                          "--out", str(tmp_path / "o.json"), "--no-progress"]) == 0
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert stats["AP"] > 0.9


def test_grouping_decodes_people_of_another_skeleton(coco4_dir):
    data = json.loads((coco4_dir / "test_coco.json").read_text())
    coco = builtin("coco")
    info = next(img for img in data["images"] if img["id"] == 197388)
    people = np.stack([coco.from_annotation(a["keypoints"]) for a in data["annotations"]
                       if a["image_id"] == 197388 and a["num_keypoints"] > 0])
    # CrowdPose's keypoints taken from COCO's: the nose stands in for the head
    ours = people[:, [coco.keypoints.index({"head": "nose"}.get(k, k)) for k in CROWDPOSE.keypoints]]
    height, width = info["height"], info["width"]
    maps = render_targets(ours, height, width, 1, TargetConfig(), CROWDPOSE)
    found, scores = group_people(maps, InferenceConfig(), CROWDPOSE)
    assert found.shape == (5, 14, 3) and (scores > 0).all()
    for person in ours:
        labelled = person[:, 2] > 0
        error = np.abs(found[:, labelled, :2] - person[labelled, :2]).max(axis=(1, 2))
        assert error.min() <= 1.0


# -- inferred skeletons ---------------------------------------------------------------------------
def test_a_skeleton_is_inferred_from_the_json(coco4_dir, tmp_path, capsys):
    data = json.loads((coco4_dir / "test_coco.json").read_text())
    keep = [0, 5, 6, 9, 10]                     # nose, shoulders, wrists, under other names
    names = ["snout", "left_paw_top", "right_paw_top", "left_tip", "right_tip"]
    for ann in data["annotations"]:
        ann["keypoints"] = np.asarray(ann["keypoints"]).reshape(17, 3)[keep].reshape(-1).tolist()
        ann.pop("num_keypoints")
    data["categories"] = [{"id": 1, "name": "person", "keypoints": names,
                           "skeleton": [[1, 2], [1, 3], [2, 4], [3, 5], [1, 4], [1, 5]]}]
    ann = tmp_path / "mine.json"
    ann.write_text(json.dumps(data))
    assert make_hdf5(["--ann", str(ann), "--images", str(coco4_dir), "--out", str(tmp_path / "m.h5"),
                      "--split", "val", "--quiet"]) == 0
    said = capsys.readouterr().out
    assert "inferred from the JSON" in said and "left_paw_top/right_paw_top" in said
    assert f"OKS sigma {DEFAULT_SIGMA}" in said
    skeleton = KeypointH5(tmp_path / "m.h5").skeleton
    assert skeleton.keypoints[0] == "snout" and skeleton.main_limbs == 4 and skeleton.num_limbs == 6
    assert skeleton.limbs[:4] == ((0, 1), (0, 2), (0, 3), (0, 4))      # a tree from the best-linked
    assert skeleton.sigmas == (DEFAULT_SIGMA,) * 5 and skeleton.num_channels == 6 + 5 + 2
    index = skeleton.keypoints.index
    assert skeleton.flip[index("left_tip")] == index("right_tip")


# -- fine-tuning a COCO model onto another skeleton -------------------------------------------------
@pytest.mark.slow
def test_a_coco_checkpoint_fine_tunes_onto_another_skeleton(coco4_dir, synthetic_h5, tmp_path, capsys):
    coco_train = synthetic_h5[0]
    train.main(["--train-h5", str(coco_train), "--out-dir", str(tmp_path), "--run-name", "coco", *QUICK])
    ann = crowdpose_json(coco4_dir, tmp_path / "crowdpose.json")
    convert(ann, coco4_dir, tmp_path / "cp.h5", ConvertSettings(split="train", progress=False))
    weights = tmp_path / "coco" / "last.pth"
    argv = ["--train-h5", str(tmp_path / "cp.h5"), "--out-dir", str(tmp_path), "--weights", str(weights),
            *QUICK]
    capsys.readouterr()
    assert run_cli(train.main, [*argv, "--run-name", "refused"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith(f"error: {weights} was trained on skeleton coco")
    assert "--allow-partial" in error[0] and not (tmp_path / "refused").exists()
    train.main([*argv, "--run-name", "tuned", "--allow-partial", "--freeze", "stacks.0.*"])   # docs/data.md
    said = capsys.readouterr().out
    coco_model = load_checkpoint(weights)["model"]
    tuned = load_checkpoint(tmp_path / "tuned" / "last.pth")
    assert from_checkpoint(tuned) == CROWDPOSE
    fresh = sorted(k for k in coco_model if coco_model[k].shape != tuned["model"][k].shape)
    assert fresh and all(k.endswith((".weight", ".bias")) for k in fresh)
    assert f"{len(coco_model) - len(fresh)} tensors; {len(fresh)} of another shape start fresh " \
           f"(--allow-partial): " in said and all(k in said for k in fresh)
    # the fresh heads of the frozen stack 0 trained (they used to stay at their random values); the
    # rest of stack 0, BatchNorm statistics included, stayed as the COCO model had it
    fresh_0 = [k for k in fresh if k.startswith("stacks.0.")]
    line = next(line for line in said.splitlines() if line.startswith("--freeze"))
    assert line.startswith(f"--freeze stacks.0.*: {len(fresh_0)} of the tensors it names start fresh "
                           "(--allow-partial), so they stay trainable: ")
    assert sorted(line.split("trainable: ")[1].split(", ")) == fresh_0
    torch.manual_seed(0)                                    # the run's seed: its initial weights
    initial = build_model(build_config("tiny").model, CROWDPOSE).state_dict()
    assert fresh_0 and all(not torch.equal(tuned["model"][k], initial[k]) for k in fresh_0)
    assert all(torch.equal(tuned["model"][k], v) for k, v in coco_model.items()
               if k.startswith("stacks.0.") and k not in fresh)
    # everything else came from the COCO model: loaded into a fresh CrowdPose network, it is that
    model = build_model(build_config("tiny").model, CROWDPOSE)
    report = load_weights(model, weights, allow_partial=True)
    assert sorted(n.split(" (")[0] for n in report["mismatched"]) == fresh
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in coco_model.items() if k not in fresh)
    # the fine-tune resumes with --resume auto alone: its checkpoint says which tensors were fresh,
    # so the same tensors are frozen and the optimiser state fits
    assert sorted(tuned["fresh_tensors"]) == fresh
    train.main(["--resume", "auto", "--run-name", "tuned", "--out-dir", str(tmp_path), "--epochs", "2"])
    resumed = load_checkpoint(tmp_path / "tuned" / "last.pth")
    assert resumed["epoch"] == 2 and resumed["step"] == 2
    assert all(torch.equal(resumed["model"][k], v) for k, v in coco_model.items()
               if k.startswith("stacks.0.") and k not in fresh)
    assert all(not torch.equal(resumed["model"][k], tuned["model"][k]) for k in fresh_0)
    # a checkpoint that does not record them (an older version's): the error names --freeze
    (tmp_path / "old").mkdir()
    torch.save({k: v for k, v in tuned.items() if k != "fresh_tensors"}, tmp_path / "old" / "last.pth")
    capsys.readouterr()
    assert run_cli(train.main, ["--resume", "auto", "--run-name", "old", "--out-dir", str(tmp_path)]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "optimiser state does not fit" in error[0]
    assert "--freeze stacks.0.* (train.freeze)" in error[0] and "--allow-partial" in error[0]


# -- bad skeletons ----------------------------------------------------------------------------------
GOOD = {"keypoints": ["head", "left_hand", "right_hand"],
        "limbs": [["head", "left_hand"], ["head", "right_hand"]]}


@pytest.mark.parametrize("change, message", [
    ({"limbs": [["head", "left_hand"], ["head", "tail"]]},
     "limbs: ['head', 'tail'] names 'tail', which is not a keypoint "
     "(keypoints: 'head', 'left_hand', 'right_hand')"),
    ({"limbs": [[0, 1], [1, 2]]},                    # issue 47: numbers are not read from 0 or 1 unsaid
     "limbs: [0, 1] gives keypoint numbers; a skeleton file names the keypoints, e.g. ['head', 'left_hand']"),
    ({"channels": ["head", "left_hand", "Right_hand"]},
     "channels must list every keypoint and derived keypoint once ('head', 'left_hand', 'right_hand')"),
    ({"flip": [["left_hand", "right_hand"], ["right_hand", "head"]]},
     "flip pairs are not symmetric: 'right_hand' pairs with both 'left_hand' and 'head'"),
    ({"limbs": [["head", "head"], ["head", "left_hand"], ["head", "right_hand"]]},
     "limbs: ['head', 'head'] joins 'head' to itself"),
    ({"keypoints": []}, "the skeleton has no keypoints"),
    ({"flip": [["left_hand", "left_hand"]]},
     "flip: ['left_hand', 'left_hand'] joins 'left_hand' to itself"),
    ({"limbs": [["head", "left_hand"]], "flip": []},
     "keypoint 'right_hand' is unreachable: no chain of limbs joins it to 'head', so the grouping "
     "could never put it in a person (add a limb)"),
    ({"limbs": [["head", "left_hand"], ["left_hand", "right_hand"]]},
     "limb ['head', 'left_hand'] has no mirror limb ['head', 'right_hand'] (add it, or fix the flip pairs)"),
    # numbers checked for sense by the bounds of config.schema.FILE_FIELDS (issue 47)
    ({"sigmas": 5.0}, "sigmas: head's 5.0 must be > 0 and <= 1"),
    ({"sigmas": [0.05, 0.05, 2.0]}, "sigmas: right_hand's 2.0 must be > 0 and <= 1"),
    ({"sigmas": [0.05, "x", 0.05]}, "sigmas: left_hand's 'x' is text, not a number"),
    ({"metric": "pck", "pck_threshold": 1e9}, "pck_threshold 1000000000.0 must be > 0 and <= 1"),
    ({"pck_threshold": True}, "pck_threshold True is not a number"),
])
def test_each_bad_skeleton_is_one_error_line(change, message, coco4_dir, tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(json.dumps(dict(GOOD, **change)))            # JSON is YAML
    code = make_hdf5(["--ann", str(coco4_dir / "test_coco.json"), "--images", str(coco4_dir),
                      "--out", str(tmp_path / "x.h5"), "--skeleton", str(path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"error: --skeleton {path}: {message}"]
    assert not (tmp_path / "x.h5").exists()


def test_a_skeleton_of_other_keypoints_than_the_json_is_refused(coco4_dir, tmp_path, capsys):
    code = make_hdf5(["--ann", str(coco4_dir / "test_coco.json"), "--images", str(coco4_dir),
                      "--out", str(tmp_path / "x.h5"), "--skeleton", "crowdpose"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"error: {coco4_dir / 'test_coco.json'}: skeleton crowdpose has 14 "
                                 "keypoints, but no field of the annotations holds as many (keypoints 17)"]


def test_training_and_validation_files_of_different_skeletons_are_refused(
        coco4_dir, synthetic_h5, tmp_path, capsys):
    ann = crowdpose_json(coco4_dir, tmp_path / "crowdpose.json")
    convert(ann, coco4_dir, tmp_path / "cp_val.h5", ConvertSettings(split="val", progress=False))
    code = run_cli(train.main, ["--train-h5", str(synthetic_h5[0]), "--val-h5", str(tmp_path / "cp_val.h5"),
                       "--out-dir", str(tmp_path), *QUICK])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].startswith(f"error: --val-h5 {tmp_path / 'cp_val.h5'}: its skeleton (crowdpose, 14 "
                             "keypoints, 36 channels) is not that of --train-h5")


# -- another animal end to end ----------------------------------------------------------------------
@pytest.mark.slow
def test_the_tiny_preset_learns_synthetic_four_legged_animals(tmp_path, capsys):
    """`python -m data.synthetic --skeleton quadruped` (not a subset of COCO's keypoints) drawn,
    converted, the tiny preset trained on the CPU, and validation AP from pycocotools with the
    quadruped's sigmas >= 0.4; demo.py then draws the animals from the checkpoint alone.
    160 images, 5 epochs of 32 steps at twice the preset's LR (0.004; both drops in epoch 5).
    Validated every epoch, it scored AP 0.000, 0.000, 0.281, 0.341, 0.530 after epochs 1-5 on one
    thread and 0.000, 0.000, 0.211, 0.331, 0.555 on two; at the preset's LR, 6 epochs reach 0.330
    and 8 about 0.8. About 75 s of CPU time."""
    import demo
    from data.synthetic import main as synthetic

    folder = tmp_path / "animals"
    assert synthetic(["--out", str(folder), "--skeleton", "quadruped", "--train-images", "160",
                      "--val-images", "12"]) == 0
    for split in ("train", "val"):
        assert make_hdf5(["--ann", str(folder / f"{split}.json"), "--images", str(folder / split),
                          "--out", str(tmp_path / f"{split}.h5"), "--split", split, "--quiet"]) == 0
    assert "built-in skeleton quadruped" in capsys.readouterr().out
    done = train.main(["--train-h5", str(tmp_path / "train.h5"), "--val-h5", str(tmp_path / "val.h5"),
                       "--out-dir", str(tmp_path), "--run-name", "animals", "--epochs", "5", "--lr", "0.004",
                       "--ap-every", "5", "--set", "data.workers=0", "--set", "train.tensorboard=false"])
    curve = [(r["epoch"] + 1, round(r["AP"], 3)) for r in map(json.loads, (
        tmp_path / "animals" / "metrics.jsonl").read_text().splitlines()) if "AP" in r]
    print("validation AP by epoch:", curve)
    assert done["AP"] >= 0.4, curve
    picture = tmp_path / "drawn.png"
    capsys.readouterr()
    assert demo.main(["--weights", str(tmp_path / "animals" / "best.pth"), "--image",
                      str(folder / "val" / "000001000001.jpg"), "--out", str(picture)]) == 0
    assert picture.is_file() and "people found" in capsys.readouterr().out
