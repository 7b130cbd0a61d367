"""Classes of bad input, each through the real command line: inputs that could lose data, train
something wrong with exit 0, hang, end in a traceback or give an unclear message.

Every case asserts the exit code 2, exactly one `error:` line naming the option or file, no
traceback, and that every file under the test's folder is byte-identical afterwards. Most cases
call the entry points' `main(argv)` in this process (cheap); `test_one_case_per_class_in_a_real_process`
runs one of each class as a real subprocess.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import cv2
import h5py
import numpy as np
import pytest
import torch

import evaluate
import train
from common.errors import run_cli
from data import make_hdf5
from data.h5format import KeypointH5
from runtime.checkpoint import FORMAT_VERSION, load_checkpoint, save_checkpoint
from engine.run_setup import LOCK_FILE
from child_env import child_env
from conftest import COCO4_DIR
from test_preemption import REPO, message_lines, torchrun, worker_log, write_micro_preset

IMAGE = "000000000785.jpg"


def snapshot(root: Path) -> dict:
    """Every file under `root` and its bytes; the empty lock file a run claims its folder with
    (engine.run_setup.LOCK_FILE) is bookkeeping, not content."""
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and p.name != LOCK_FILE}


def one_error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [line for line in message_lines(stderr) if not line.startswith("converting ")]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr[-3000:]
    return lines[0]


def refused(capsys, main, argv, says, root: Path, code: int = 2) -> str:
    """Run `main(argv)`; assert the exit code, one error line holding every text of `says`, no
    traceback, and nothing changed under `root`."""
    before = snapshot(root)
    capsys.readouterr()
    assert main([str(a) for a in argv]) == code
    line = one_error_line(capsys.readouterr().err)
    for text in says:
        assert str(text) in line, line
    after = snapshot(root)
    assert after.keys() == before.keys() and all(after[p] == before[p] for p in before)
    return line


def train_cli(argv):
    return run_cli(train.main, [str(a) for a in argv])


@pytest.fixture(scope="module")
def env(tmp_path_factory, synthetic_h5):
    """A finished run `runs/done` with a user's file beside it, a micro preset, COCO inputs."""
    root = tmp_path_factory.mktemp("classes")
    preset = write_micro_preset(root)
    runs = root / "runs"
    train.main(["--config", str(preset), "--train-h5", str(synthetic_h5[0]), "--out-dir", str(runs),
                "--run-name", "done", "--epochs", "1", "--set", "train.max_steps_per_epoch=1"])
    (runs / "notes.txt").write_text("a user's file next to the runs")
    (runs / "done" / "mine.txt").write_text("a user's file inside a run")
    coco = json.loads((COCO4_DIR / "test_coco.json").read_text())
    images = root / "images"
    images.mkdir()
    for info in coco["images"]:
        shutil.copy(COCO4_DIR / info["file_name"], images / info["file_name"])
    (root / "coco.json").write_text(json.dumps(coco))
    trainer = ["--config", preset, "--out-dir", runs, "--train-h5", synthetic_h5[0]]
    return {"root": root, "runs": runs, "preset": preset, "trainer": trainer, "coco": coco,
            "images": images, "train_h5": synthetic_h5[0]}


# -- config values: checked before anything is built or written ------------------------------------
@pytest.mark.parametrize("args,says", [
    (["--lr", "nan"], ["option optim.lr", "not a finite number"]),
    (["--lr", "inf"], ["option optim.lr", "not a finite number"]),
    (["--clip-grad", "nan"], ["option optim.clip_grad_norm", "not a finite number"]),
    (["--clip-grad", "-1"], ["option optim.clip_grad_norm", "-1.0 must be >= 0"]),
    (["--loss-scale", "nan"], ["option amp.loss_scale", "not a finite number"]),
    (["--set", "optim.warmup_start=-1"], ["option optim.warmup_start", "must be >= 0 and <= 1"]),
    (["--set", "optim.decay_factor=-0.2"], ["option optim.decay_factor", "must be > 0"]),
    (["--set", "train.max_steps_per_epoch=-1"], ["option train.max_steps_per_epoch", "must be >= 0"]),
    (["--workers", "-3"], ["option data.workers", "-3 must be >= 0"]),
    (["--seed", "-1"], ["option train.seed", "-1 must be >= 0"]),
    (["--set", "train.log_every=0"], ["option train.log_every", "0 must be >= 1"]),
    (["--set", "targets.keypoint_sigma=0"], ["option targets.keypoint_sigma", "must be > 0"]),
    (["--set", "optim.milestones=abc"], ["option optim.milestones", "expected an integer, got 'abc'"]),
    (["--set", "inference.scales=[.inf]"], ["option inference.scales", "not a finite number"]),
    (["--set", "inference.scales=[]"], ["option inference.scales", "must have 1 to 16 items"]),
    (["--set", "optim.lr=[1]"], ["option optim.lr", "expected a number, got [1]"]),
    (["--set", "optim.lr=true"], ["option optim.lr", "expected a number, got True"]),
    (["--device", "tpu"], ["option train.device", "'tpu' is not auto, cpu, cuda"]),
    (["--set", "optim.max_bad_steps=0"], ["option optim.max_bad_steps", "0 must be >= 1"]),
    (["--set", "model.stacks=1000000000"], ["option model.stacks", "must be >= 1 and <= 64"]),
    (["--set", "model.stacks=16", "--set", "model.channels=2048"],
     ["option model.max_params_m", "million parameters", "--set model.max_params_m=N"]),
    (["--set", "data.input_size=500"], ["option data.input_size", "500 is not a positive multiple of 64"]),
    (["--set", "data.stride=8"], ["option data.stride", "the network's output stride is 4"]),
    (["--run-name", "..", "--overwrite"], ["option train.run_name", "'..' is not a plain folder name"]),
    (["--run-name", ".", "--overwrite"], ["option train.run_name", "'.' is not a plain folder name"]),
    (["--run-name", "../runs", "--overwrite"], ["option train.run_name", "not a plain folder name"]),
])
def test_bad_config_values_are_refused_before_anything_is_written(env, capsys, args, says):
    refused(capsys, train_cli, env["trainer"] + args, says, env["root"])


def test_a_validation_file_without_training_data_is_refused_not_ignored(env, capsys, synthetic_h5):
    """Without --train-h5 the run trains on the synthetic dataset; it validated on that too, silently
    leaving the user's --val-h5 unread."""
    without_data = [a for a in env["trainer"] if a not in ("--train-h5", synthetic_h5[0])]
    refused(capsys, train_cli, without_data + ["--val-h5", synthetic_h5[1]],
            [f"--val-h5 {synthetic_h5[1]} without --train-h5", "give --train-h5 too"], env["root"])


# -- run directories --------------------------------------------------------------------------------
def test_overwrite_waits_for_every_other_check_and_removes_only_the_trainers_files(env, capsys,
                                                                                   synthetic_h5):
    runs = env["runs"]
    work = runs / "again"
    shutil.copytree(runs / "done", work)
    refused(capsys, train_cli, env["trainer"] + ["--run-name", "again", "--overwrite", "--val-h5",
                                                 env["root"] / "nowhere.h5"],
            ["--val-h5", "no such file"], env["root"])
    assert train_cli(env["trainer"] + ["--run-name", "again", "--overwrite", "--epochs", "1",
                                       "--set", "train.max_steps_per_epoch=1"]) == 0
    assert (work / "mine.txt").read_text() == "a user's file inside a run"
    assert (work / "last.pth").is_file() and (runs / "notes.txt").is_file()
    shutil.rmtree(work)


def test_a_run_directory_in_use_is_refused_and_fresh_names_never_collide(env, capsys, monkeypatch):
    from runtime.distributed import DistContext
    from engine.run_setup import choose_run_dir, release_run_dir
    from config.loader import build_config

    cfg = build_config(str(env["preset"]), sets=[f"train.out_dir={env['runs']}"])
    monkeypatch.setattr("time.strftime", lambda fmt: "run-20260101-000000")   # the same second
    first, made_first = choose_run_dir(cfg.train, DistContext())
    second, made_second = choose_run_dir(cfg.train, DistContext())
    assert first != second and made_first and made_second and second.name == "run-20260101-000000-2"
    release_run_dir(first, remove_if_empty=True)
    release_run_dir(second, remove_if_empty=True)
    busy = env["runs"] / "busy"
    busy.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from engine.run_setup import _claim; _claim(Path(sys.argv[1]), False); "
                               "print('locked', flush=True); time.sleep(60)", str(busy)],
                              cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        refused(capsys, train_cli, env["trainer"] + ["--run-name", "busy"],
                [str(busy), "is in use by another run right now"], env["root"])
    finally:
        holder.kill()
        holder.wait()
    shutil.rmtree(busy)


def test_every_rank_gets_the_run_directory_error_and_nothing_hangs(env, tmp_path):
    """The main process picks and claims the directory; its refusal reaches the other ranks
    (they would otherwise wait for the path until the process group's timeout)."""
    before = snapshot(env["runs"])
    proc = subprocess.run(torchrun(tmp_path, *[str(a) for a in env["trainer"]], "--run-name", "done"),
                          cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0
    for rank in (0, 1):
        line = one_error_line(worker_log(tmp_path, 0, rank, "stderr"))
        assert f"{env['runs'] / 'done'} already holds a run" in line, line
    assert snapshot(env["runs"]) == before


def test_resume_of_a_copied_checkpoint_writes_next_to_it(env, capsys):
    copy = env["root"] / "copy"
    copy.mkdir()
    shutil.copy(env["runs"] / "done" / "last.pth", copy / "last.pth")
    done = snapshot(env["runs"] / "done")
    assert train_cli(["--resume", copy / "last.pth", "--train-h5", env["train_h5"], "--epochs", "2",
                      "--set", "train.max_steps_per_epoch=1"]) == 0
    assert load_checkpoint(copy / "last.pth")["epoch"] == 2
    assert snapshot(env["runs"] / "done") == done
    refused(capsys, train_cli, ["--resume", copy / "last.pth", "--run-name", "done", "--out-dir", env["runs"],
                                "--epochs", "3"],
            ["continues the run in", "not --run-name done"], env["root"])
    shutil.rmtree(copy)


def test_resume_auto_refuses_a_newer_or_damaged_checkpoint_and_keeps_it(env, capsys):
    work = env["runs"] / "newer"
    shutil.copytree(env["runs"] / "done", work)
    torch.save({"format_version": FORMAT_VERSION + 1, "step": 99}, work / "epoch_9.pth")
    refused(capsys, train_cli, env["trainer"] + ["--run-name", "newer", "--resume", "auto"],
            [str(work / "epoch_9.pth"), "newer than this trainer", "Nothing was overwritten"], env["root"])
    shutil.rmtree(work)


def test_a_requeued_job_resumes_and_says_its_weights_are_not_loaded(env, capsys):
    """`--resume auto --weights W` in a job script: the first start loads W, a restart resumes the run
    from its checkpoint and says W was not loaded."""
    work = env["runs"] / "requeued"
    shutil.copytree(env["runs"] / "done", work)
    weights = env["runs"] / "done" / "last.pth"
    capsys.readouterr()
    assert train_cli(env["trainer"] + ["--run-name", "requeued", "--resume", "auto", "--weights", weights,
                                       "--epochs", "2", "--set", "train.max_steps_per_epoch=1"]) == 0
    printed = capsys.readouterr()
    lines = (printed.out + printed.err).splitlines()
    not_loaded = f"--weights {weights} not loaded: --resume auto continues the run from {work / 'last.pth'}"
    assert not_loaded in lines
    assert any(line.startswith(f"resumed from {work / 'last.pth'}: epoch 2") for line in lines)
    shutil.rmtree(work)


# -- outputs are never inputs -------------------------------------------------------------------------
def test_an_output_equal_to_an_input_is_refused(env, capsys):
    root = env["root"]
    refused(capsys, make_hdf5.main, ["--ann", root / "coco.json", "--images", env["images"],
                                     "--out", root / "coco.json"],
            ["--out", "is the same file as --ann"], root)
    refused(capsys, make_hdf5.main, ["--ann", root / "coco.json", "--images", env["images"],
                                     "--out", env["images"] / ".." / "images" / IMAGE],
            ["is the same file as an image of --images"], root)
    weights = env["runs"] / "done" / "last.pth"
    refused(capsys, evaluate.main, ["--weights", weights, "--h5", env["train_h5"], "--out", weights,
                                    "--device", "cpu"], ["--out", "same file as --weights"], root)


def test_an_existing_output_is_kept_unless_overwrite_is_given(env, capsys, tmp_path, synthetic_h5):
    """Every command that writes a file refuses one that is there (a user's own file, or an output of
    an earlier run) and leaves it byte-identical; --overwrite replaces it."""
    from data import preview
    import demo
    import export
    weights, picture, val_h5 = env["runs"] / "done" / "last.pth", env["images"] / IMAGE, synthetic_h5[1]
    commands = {   # the file each writes: (main, argv)
        "mine.h5": (make_hdf5.main, ["--ann", env["root"] / "coco.json", "--images", env["images"],
                                     "--quiet"]),
        "mine.json": (evaluate.main, ["--oracle", "--h5", val_h5, "--max-images", "1", "--no-progress"]),
        "mine.png": (preview.main, ["--h5", val_h5, "--n", "1"]),
        "mine.jpg": (demo.main, ["--weights", weights, "--image", picture]),
        "mine.avi": (demo.main, ["--weights", weights, "--video", env["root"] / "no_video_needed.avi"]),
        "mine.onnx": (export.main, ["--weights", weights]),
    }
    for name, (main, argv) in commands.items():
        (tmp_path / name).write_bytes(b"a file the user has")
        refused(capsys, main, argv + ["--out", tmp_path / name],
                [f"--out {tmp_path / name} already exists", "pass --overwrite to replace it"], tmp_path)
    for name in ("mine.h5", "mine.json", "mine.png", "mine.jpg"):
        main, argv = commands[name]
        assert main([str(a) for a in argv + ["--out", tmp_path / name, "--overwrite"]]) == 0, name
        assert (tmp_path / name).read_bytes() != b"a file the user has", name
    assert KeypointH5(tmp_path / "mine.h5").num_images == 4
    assert cv2.imread(str(tmp_path / "mine.jpg")) is not None


# -- COCO JSON, field by field ------------------------------------------------------------------------
def _first_ann(coco):
    return next(a for a in coco["annotations"] if a["num_keypoints"] > 0)


def _edit(change):
    def apply(coco):
        change(coco)
        return coco
    return apply


COCO_CASES = {
    "NaN keypoint": (_edit(lambda c: _first_ann(c)["keypoints"].__setitem__(0, float("nan"))),
                     ["annotation", "keypoints holds nan, not a finite number"]),
    "visibility 3": (_edit(lambda c: _first_ann(c)["keypoints"].__setitem__(
        next(i for i in range(2, 51, 3) if _first_ann(c)["keypoints"][i]), 3)),
        ["visibility 3, not 0, 1 or 2"]),
    "zero box": (_edit(lambda c: _first_ann(c).__setitem__("bbox", [1, 1, 0, 5])), ["has no positive width"]),
    "negative box": (_edit(lambda c: _first_ann(c).__setitem__("bbox", [1, 1, -4, 5])),
                     ["no positive width"]),
    "keypoint far outside": (_edit(lambda c: _first_ann(c)["keypoints"].__setitem__(
        next(i - 2 for i in range(2, 51, 3) if _first_ann(c)["keypoints"][i]), 1e6)), ["lies far outside"]),
    "absolute file_name": (_edit(lambda c: c["images"][0].__setitem__(
        "file_name", str(COCO4_DIR / c["images"][0]["file_name"]))), ["must be a path inside --images"]),
    "file_name with ..": (_edit(lambda c: c["images"][0].__setitem__(
        "file_name", "../images/" + c["images"][0]["file_name"])), ["must be a path inside --images"]),
    "duplicate image id": (_edit(lambda c: c["images"].append(dict(c["images"][0]))),
                           ["appears twice in images"]),
    "category matching nothing": (_edit(lambda c: [a.__setitem__("category_id", 7)
                                                   for a in c["annotations"]]),
                                  ["no annotation has the person category's id 1", "category ids 7"]),
    "negative area": (_edit(lambda c: _first_ann(c).__setitem__("area", -5)),
                      ["area -5 is not a finite number >= 0"]),
    "missing bbox": (_edit(lambda c: _first_ann(c).pop("bbox")), ["bbox None is not a list of 4 numbers"]),
    "missing file_name": (_edit(lambda c: c["images"][0].pop("file_name")), ["file_name None"]),
    "float height": (_edit(lambda c: c["images"][0].__setitem__("height", 425.5)), ["height 425.5"]),
    "string id": (_edit(lambda c: c["images"][0].__setitem__("id", "785")), ["image id '785'"]),
    "huge id": (_edit(lambda c: c["images"][0].__setitem__("id", 2 ** 70)), ["from 0 to 2^63-1"]),
    "images not a list": (_edit(lambda c: c.__setitem__("images", {"a": 1})),
                          ["'images' is a dict, not a list"]),
    "bad RLE": (_edit(lambda c: _first_ann(c).__setitem__("segmentation", {"size": [1, 1], "counts": [1]})),
                ["segmentation size [1, 1] is not the image's"]),
    "bad compressed RLE": (_edit(lambda c: _first_ann(c).__setitem__(
        "segmentation", {"size": [c["images"][0]["height"], c["images"][0]["width"]], "counts": "!!!!"})),
        ["not a valid compressed RLE"]),
}


@pytest.mark.parametrize("case", sorted(COCO_CASES))
def test_a_bad_coco_field_names_the_item_and_writes_nothing(env, capsys, tmp_path, case):
    change, says = COCO_CASES[case]
    coco = change(json.loads(json.dumps(env["coco"])))
    ann = tmp_path / "bad.json"
    ann.write_text(json.dumps(coco))
    refused(capsys, make_hdf5.main, ["--ann", ann, "--images", env["images"], "--out", tmp_path / "out.h5",
                                     "--quiet"], [str(ann)] + says, tmp_path)
    assert not (tmp_path / "out.h5").exists()


def test_skip_bad_skips_and_lists_bad_images_and_bad_annotations(env, capsys, tmp_path):
    coco = json.loads(json.dumps(env["coco"]))
    bad_ann = _first_ann(coco)
    bad_ann["keypoints"][2] = 7
    broken = coco["images"][-1]["file_name"]
    images = tmp_path / "images"
    shutil.copytree(env["images"], images)
    (images / broken).write_bytes(b"")                               # the most common broken download
    (tmp_path / "a.json").write_text(json.dumps(coco))
    out = tmp_path / "out.h5"
    assert make_hdf5.main([str(a) for a in ("--ann", tmp_path / "a.json", "--images", images, "--out", out,
                                            "--split", "val", "--skip-bad", "--quiet")]) == 0
    printed = capsys.readouterr().out
    assert f"annotation {bad_ann['id']} (image {bad_ann['image_id']}): keypoint 0 has visibility 7" in printed
    assert f"{images / broken}: image" in printed and "is an empty file (0 bytes)" in printed
    kept = KeypointH5(out)
    assert kept.num_images == len(coco["images"]) - 2
    assert bad_ann["image_id"] not in [kept.image_info(i)["id"] for i in range(kept.num_images)]
    one = dict(coco, images=[coco["images"][-1]], annotations=[])     # only the empty image
    (tmp_path / "b.json").write_text(json.dumps(one))
    refused(capsys, make_hdf5.main, ["--ann", tmp_path / "b.json", "--images", images, "--out",
                                     tmp_path / "none.h5", "--skip-bad", "--quiet"],
            ["no image was kept (1 bad image)", "nothing written"], tmp_path)


def exif_jpeg(pixels: np.ndarray, orientation: int) -> bytes:
    """A JPEG of `pixels` with an EXIF orientation tag, the APP1 segment crafted by hand: TIFF
    header (big-endian), one IFD entry 0x0112 SHORT = orientation."""
    jpeg = cv2.imencode(".jpg", pixels, [cv2.IMWRITE_JPEG_QUALITY, 100])[1].tobytes()
    tiff = b"MM\x00\x2a" + struct.pack(">I", 8) + struct.pack(">H", 1)
    tiff += struct.pack(">HHIHH", 0x0112, 3, 1, orientation, 0) + struct.pack(">I", 0)
    body = b"Exif\x00\x00" + tiff
    return jpeg[:2] + b"\xff\xe1" + struct.pack(">H", len(body) + 2) + body + jpeg[2:]


@pytest.mark.parametrize("orientation", [3, 6])
def test_exif_orientation_is_ignored_everywhere(tmp_path, orientation):
    """COCO's labels are on the stored pixels: the converter and every decoder ignore the tag."""
    pixels = np.zeros((40, 64, 3), np.uint8)
    pixels[:10, :20] = 255                                           # a white corner, top left
    data = exif_jpeg(pixels, orientation)
    shown = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)    # the tag applied
    assert shown.shape[:2] == (64, 40) if orientation == 6 else shown[2, 2, 0] < 50
    (tmp_path / "a.jpg").write_bytes(data)
    coco = {"images": [{"id": 1, "file_name": "a.jpg", "width": 64, "height": 40}],
            "annotations": [], "categories": [dict(COCO_CATEGORY)]}
    (tmp_path / "a.json").write_text(json.dumps(coco))
    make_hdf5.convert(tmp_path / "a.json", tmp_path, tmp_path / "a.h5", split="val", progress=False)
    image = KeypointH5(tmp_path / "a.h5").decode_image(0)
    assert image.shape[:2] == (40, 64) and image[2, 2, 0] > 200 and image[-2, -2, 0] < 50


COCO_CATEGORY = json.loads((COCO4_DIR / "test_coco.json").read_text())["categories"][0]


# -- our own files: nothing stored is trusted -----------------------------------------------------------
def _damaged_h5(env, tmp_path, change) -> Path:
    path = tmp_path / "damaged.h5"
    shutil.copy(env["train_h5"], path)
    with h5py.File(path, "r+") as f:
        change(f)
    return path


def _set(name, value):
    def change(f):
        del f[name]
        f[name] = value
    return change


H5_CASES = {
    "split test": (lambda f: f.attrs.__setitem__("split", "test"), "split 'test' is not train or val"),
    "string version": (lambda f: f.attrs.__setitem__("version", "one"),
                       "format version 'one' is not a number"),
    "bad categories JSON": (lambda f: f.attrs.__setitem__("categories", "{oops"), "damaged keypoint dataset"),
    "sample out of range": (lambda f: _set("samples", np.array([[10 ** 6, 0]]))(f), "samples refer to"),
    "no images": (lambda f: [f[name].resize((0,) + f[name].shape[1:]) for name in (
        "images/encoded", "images/file_name", "images/annotations", "images/masks")] and [
        _set(name, np.zeros((0,) + f[name].shape[1:], f[name].dtype))(f) for name in (
            "images/id", "images/size", "images/people", "samples")], "it holds no images"),
    "huge stored size": (lambda f: _set("images/size", np.full(f["images/size"].shape, 10 ** 9, np.int32))(f),
                         "an image size is outside 1..65535"),
}


@pytest.mark.parametrize("case", sorted(H5_CASES))
def test_damaged_hdf5_metadata_is_one_line_naming_the_file(env, capsys, tmp_path, case):
    change, says = H5_CASES[case]
    path = _damaged_h5(env, tmp_path, change)
    refused(capsys, train_cli, ["--config", env["preset"], "--out-dir", tmp_path / "runs",
                                "--train-h5", path],
            [str(path), says], tmp_path)


def test_damaged_masks_and_image_bytes_name_the_file(env, tmp_path):
    from common.errors import DataError
    path = _damaged_h5(env, tmp_path, lambda f: None)
    with h5py.File(path, "r+") as f:
        f["images/masks"][0] = np.zeros(7, np.uint8)                 # not (length, value) triples
        f["images/encoded"][1] = np.zeros(0, np.uint8)
    h5 = KeypointH5(path)
    with pytest.raises(DataError, match=f"{path}: image 0: damaged masks"):
        h5.masks(0)
    with pytest.raises(DataError, match=f"{path}: image 1 .* cannot be decoded"):
        h5.decode_image(1)


@pytest.mark.parametrize("change,says", [
    (lambda s: s.pop("optimizer"), "it has no 'optimizer'"),
    (lambda s: s.__setitem__("epoch", "1"), "epoch is str"),
])
def test_a_damaged_checkpoint_to_resume_is_one_line(env, capsys, tmp_path, change, says):
    state = load_checkpoint(env["runs"] / "done" / "last.pth")
    change(state)
    (tmp_path / "run").mkdir()
    save_checkpoint(tmp_path / "run" / "last.pth", state)
    refused(capsys, train_cli, ["--config", env["preset"], "--resume", tmp_path / "run" / "last.pth",
                                "--train-h5", env["train_h5"]],
            [str(tmp_path / "run" / "last.pth"), says], tmp_path)


def test_a_saved_config_that_no_longer_fits_names_the_file_and_the_way_on(env, capsys, tmp_path):
    state = load_checkpoint(env["runs"] / "done" / "last.pth")
    state["config"]["model"]["old_width"] = 3                         # a field renamed since
    (tmp_path / "run").mkdir()
    save_checkpoint(tmp_path / "run" / "last.pth", state)
    refused(capsys, train_cli, ["--resume", tmp_path / "run" / "last.pth", "--train-h5", env["train_h5"]],
            [f"the config saved in checkpoint {tmp_path / 'run' / 'last.pth'}", "'model.old_width'",
             "--config PRESET"], tmp_path)
    state["config"]["model"].pop("old_width")
    save_checkpoint(tmp_path / "run" / "last.pth", state)
    line = refused(capsys, train_cli, ["--resume", tmp_path / "run" / "last.pth", "--train-h5",
                                       env["train_h5"], "--lr", "nan"], ["option optim.lr"], tmp_path)
    assert "saved in checkpoint" not in line                          # the flag is wrong, not the file
    state["config"]["model"]["stacks"] = 10 ** 9                      # would build forever
    save_checkpoint(tmp_path / "run" / "last.pth", state)
    refused(capsys, evaluate.main, ["--weights", tmp_path / "run" / "last.pth", "--h5", env["train_h5"],
                                    "--device", "cpu", "--out", tmp_path / "r.json"],
            ["the config saved in checkpoint", "option model.stacks"], tmp_path)


# -- the environment -------------------------------------------------------------------------------
def test_a_file_or_read_only_out_dir_is_one_line(env, capsys, tmp_path, monkeypatch):
    import errno
    (tmp_path / "file").write_text("not a folder")
    refused(capsys, train_cli, env["trainer"] + ["--out-dir", tmp_path / "file"],
            ["--out-dir", "a file, not a folder"], tmp_path)
    refused(capsys, train_cli, ["--config", env["preset"], "--out-dir", tmp_path / "runs",
                                "--set", f"data.synthetic_dir={tmp_path / 'file'}"],
            ["option data.synthetic_dir", "cannot make the synthetic dataset there"], tmp_path)
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o555)
    if os.geteuid() == 0:                 # root writes anywhere: the refusal it would get, faked
        mkdir = Path.mkdir

        def refuse(self, *args, **kwargs):
            if self.parent == read_only:
                raise PermissionError(errno.EACCES, "Permission denied")
            return mkdir(self, *args, **kwargs)
        monkeypatch.setattr(Path, "mkdir", refuse)
    refused(capsys, train_cli, env["trainer"] + ["--out-dir", read_only],
            ["cannot create the run directory there", "Permission denied"], tmp_path)


def test_full_disk_while_writing_curves_and_out_of_memory_are_one_line(env, capsys, tmp_path, monkeypatch):
    import errno
    from engine.model_with_loss import ModelWithLoss

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr("matplotlib.figure.Figure.savefig", full)
    args = ["--config", env["preset"], "--out-dir", tmp_path, "--train-h5", env["train_h5"], "--epochs", "1",
            "--set", "train.max_steps_per_epoch=1"]
    capsys.readouterr()
    assert train_cli(args + ["--run-name", "disk"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"cannot write {tmp_path / 'disk' / 'curves.png'}: no space left on device" in line
    assert f"the last good checkpoint {tmp_path / 'disk' / 'last.pth'} is intact" in line
    assert load_checkpoint(tmp_path / "disk" / "last.pth")["epoch"] == 1
    monkeypatch.undo()

    def oom(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr(ModelWithLoss, "forward", oom)
    kept = (tmp_path / "disk" / "last.pth").read_bytes()
    assert train_cli(args + ["--run-name", "disk", "--resume", "auto", "--epochs", "2"]) == 2
    line = one_error_line(capsys.readouterr().err)
    for text in ("out of memory on cpu", "lower --batch-size", "--input-size",
                 f"the last good checkpoint {tmp_path / 'disk' / 'last.pth'} is intact"):
        assert text in line, line
    assert (tmp_path / "disk" / "last.pth").read_bytes() == kept


# -- one of each class in a real process ------------------------------------------------------------------
def test_one_case_per_class_in_a_real_process(env, tmp_path):
    root = env["root"]
    (env["images"] / "empty.jpg").write_bytes(b"")
    coco = json.loads(json.dumps(env["coco"]))
    coco["images"] = [dict(coco["images"][0], id=9, file_name="empty.jpg")]
    coco["annotations"] = []
    (tmp_path / "empty.json").write_text(json.dumps(coco))
    nan = json.loads(json.dumps(env["coco"]))
    _first_ann(nan)["bbox"][0] = float("nan")
    (tmp_path / "nan.json").write_text(json.dumps(nan))
    py = sys.executable
    trainer = [py, "train.py"] + [str(a) for a in env["trainer"]]
    make = [py, "-m", "data.make_hdf5", "--images", str(env["images"]), "--quiet"]
    cases = {   # class: (command, texts of the error line)
        "data lost": (trainer + ["--run-name", "..", "--overwrite"], ["option train.run_name"]),
        "silently wrong": (make + ["--ann", str(tmp_path / "nan.json"), "--out", str(tmp_path / "o.h5")],
                           ["bbox holds nan"]),
        "hang": (trainer + ["--set", "model.stacks=1000000000"], ["option model.stacks"]),
        "traceback": (make + ["--ann", str(tmp_path / "empty.json"), "--out", str(tmp_path / "e.h5"),
                              "--skip-bad"], ["no image was kept"]),
        "unclear": (trainer + ["--device", "tpu"], ["option train.device", "'tpu'"]),
        "command line": (trainer + ["--epochs", "ten"], ["argument --epochs", "invalid int value: 'ten'",
                                                         "(see train.py --help)"]),
        "environment variable": ([py, "train_distributed.py", "--device", "cpu"] + trainer[2:],
                                 ["MASTER_PORT 99999 is not a port"]),
    }
    envs = {"environment variable": dict(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                         MASTER_PORT="99999")}
    before = snapshot(root)
    procs = {name: subprocess.Popen(command, cwd=REPO, env=child_env(**envs.get(name, {})),
                                    stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
             for name, (command, _) in cases.items()}
    for name, proc in procs.items():
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 2, (name, stderr[-2000:])
        line = one_error_line(stderr)
        assert all(text in line for text in cases[name][1]), (name, line)
    assert snapshot(root) == before
    (env["images"] / "empty.jpg").unlink()
