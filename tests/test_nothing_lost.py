"""Nothing a user has is lost, nothing wrong is silent, on export, the Python API, the synthetic set,
resume and the long commands' signals.

Outputs: no command writes over a file it reads in any spelling of its path, a resume never writes
over another run, a second writer of the same new output fails in one line, a video is read back
and counted. Weights with NaN or integer tensors are refused where they are loaded. The Python API
converts or refuses its pictures and shrinks huge ones. SIGTERM / SIGINT sent to a long command's
process group end it within seconds, with its temporary files removed and one line saying what it
kept.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import OrderedDict
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

import demo
import evaluate
import export
from common.errors import ConfigError
from common.paths import written_whole
from data import make_hdf5
from data.synthetic import main as synthetic_main
from inference import PoseEstimator
from inference.picture_input import MAX_SIDE
from runtime.checkpoint import load_checkpoint, save_checkpoint
from child_env import child_env
import test_inference_api as api
from bad_inputs import refused, snapshot, train_cli
from bad_inputs import one_error_line as error_line          # progress bars aside
from test_inference_api import one_error_line, write_clip

# the fixtures of those modules, used here too
checkpoint, estimator, pictures = api.checkpoint, api.estimator, api.pictures

REPO = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- outputs and inputs
def test_export_never_writes_over_its_weights_in_any_spelling(checkpoint, tmp_path, capsys):
    weights = tmp_path / "w.pth"
    shutil.copy(checkpoint, weights)
    os.symlink(weights, tmp_path / "link.pth")
    os.link(weights, tmp_path / "hard.pth")
    before = weights.read_bytes()
    for out in (weights, f"./{os.path.relpath(weights)}", tmp_path / "link.pth", tmp_path / "hard.pth",
                tmp_path / "sub" / ".." / "w.pth"):
        capsys.readouterr()
        assert export.main(["--weights", str(weights), "--out", str(out), "--overwrite"]) == 2
        line = one_error_line(capsys.readouterr().err)
        assert f"--out {Path(out)} is the same file as --weights {weights}" in line, line
        assert weights.read_bytes() == before and (tmp_path / "link.pth").is_symlink()


def test_a_resume_never_writes_over_another_run(env, capsys):
    """A checkpoint of another run put into a run's folder: resuming it there would replace that
    run's last.pth, metrics.jsonl and config.yaml."""
    done = env["runs"] / "done"
    other = done / "other.pth"
    shutil.copy(done / "last.pth", other)
    try:
        refused(capsys, train_cli, ["--resume", other, "--train-h5", env["train_h5"], "--epochs", "2",
                                    "--set", "train.max_steps_per_epoch=1"],
                [f"--resume {other}", "holds another run", "last.pth", "metrics.jsonl"], env["root"])
    finally:
        other.unlink()


def test_the_synthetic_set_is_not_drawn_over_an_existing_one(tmp_path, capsys):
    argv = ["--out", str(tmp_path), "--train-images", "2", "--val-images", "1", "--size", "64"]
    assert synthetic_main(argv) == 0
    before = snapshot(tmp_path)
    for seed in ("1", "2"):
        capsys.readouterr()
        assert synthetic_main(argv + ["--seed", seed]) == 2
        line = one_error_line(capsys.readouterr().err)
        assert f"--out {tmp_path / 'train.json'} already exists" in line and "--overwrite" in line
        assert snapshot(tmp_path) == before
    (tmp_path / "train.json").unlink()
    (tmp_path / "val.json").unlink()
    assert synthetic_main(argv) == 2 and "train/ already holds files" in capsys.readouterr().err
    assert synthetic_main(argv + ["--seed", "3", "--overwrite"]) == 0
    assert json.loads((tmp_path / "train.json").read_text())["images"]
    first = tmp_path / "train" / "000000000001.jpg"
    assert snapshot(tmp_path)[first] != before[first]


REAL_VIDEO_WRITER = cv2.VideoWriter


class DroppingWriter:
    """cv2.VideoWriter on a disk that fills after the first frame: later frames vanish, no error."""

    def __init__(self, *args):
        self.writer, self.frames = REAL_VIDEO_WRITER(*args), 0

    def isOpened(self):
        return self.writer.isOpened()

    def write(self, frame):
        self.frames += 1
        if self.frames == 1:
            self.writer.write(frame)

    def release(self):
        self.writer.release()


def test_a_video_missing_frames_when_read_back_is_not_reported_written(checkpoint, tmp_path, capsys,
                                                                       monkeypatch):
    import inference.video

    clip, out = tmp_path / "clip.avi", tmp_path / "clip_pose.mp4"
    write_clip(clip, frames=4, fps=8.0)
    monkeypatch.setattr(inference.video.cv2, "VideoWriter", DroppingWriter)
    assert demo.main(["--weights", str(checkpoint), "--video", str(clip), "--out", str(out),
                      "--device", "cpu"]) == 2
    captured = capsys.readouterr()
    assert error_line(captured.err) == (f"error: --out {out}: the video written holds 1 of its 4 frames "
                                            "when read back (full disk?); nothing was written")
    assert "written to" not in captured.out and sorted(p.name for p in tmp_path.iterdir()) == ["clip.avi"]


# ------------------------------------------------------------------------------- exclusive outputs
def test_a_second_writer_of_a_new_output_fails_and_keeps_the_first(tmp_path):
    out = tmp_path / "out.h5"
    with pytest.raises(ConfigError, match="was created by another command while this one wrote it"):
        with written_whole(out, overwrite=False) as temp:
            temp.write_bytes(b"second")
            out.write_bytes(b"first")            # the other command finished first
    assert out.read_bytes() == b"first" and sorted(tmp_path.iterdir()) == [out]
    with written_whole(out, overwrite=True) as temp:
        temp.write_bytes(b"asked")
    assert out.read_bytes() == b"asked"
    with pytest.raises(ConfigError, match="the file written is empty"):
        with written_whole(tmp_path / "empty.json") as temp:
            temp.write_bytes(b"")
    assert sorted(tmp_path.iterdir()) == [out]


def another_command_finishes_first(monkeypatch, module, writer: str, out: Path, text: bytes) -> None:
    """`module.writer` writes its temporary file, then another command gives `out` its own bytes."""
    real_write = getattr(module, writer)

    def write_then_the_other(*args, **kwargs):
        real_write(*args, **kwargs)
        out.write_bytes(text)

    monkeypatch.setattr(module, writer, write_then_the_other)


def test_two_conversions_to_one_new_file_do_not_both_succeed(coco4_dir, tmp_path, capsys, monkeypatch):
    out = tmp_path / "val.h5"
    another_command_finishes_first(monkeypatch, make_hdf5, "_write", out, b"the other conversion")
    assert make_hdf5.main(["--ann", str(coco4_dir / "test_coco.json"), "--images", str(coco4_dir),
                           "--out", str(out), "--split", "val", "--quiet"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line == (f"error: --out {out} was created by another command while this one wrote it; that file "
                    "is kept as it is: choose another --out, or pass --overwrite to replace it")
    assert out.read_bytes() == b"the other conversion" and sorted(tmp_path.iterdir()) == [out]


@pytest.mark.slow         # many CPU-seconds
def test_two_exports_to_one_new_file_do_not_both_succeed(checkpoint, tmp_path, capsys, monkeypatch):
    out = tmp_path / "pose.onnx"
    another_command_finishes_first(monkeypatch, export, "write_onnx", out, b"the other export")
    assert export.main(["--weights", str(checkpoint), "--out", str(out)]) == 2
    assert "was created by another command" in one_error_line(capsys.readouterr().err)
    assert out.read_bytes() == b"the other export" and sorted(tmp_path.iterdir()) == [out]


def test_two_evaluations_to_one_new_results_file_do_not_both_succeed(coco4_dir, tmp_path, capsys,
                                                                     monkeypatch):
    out = tmp_path / "results.json"
    real_dumps = json.dumps

    def other_command_finishes_first(obj, *args, **kwargs):
        if isinstance(obj, list) and not out.exists():     # the results, while this one writes them
            out.write_text("the other evaluation")
        return real_dumps(obj, *args, **kwargs)

    monkeypatch.setattr(json, "dumps", other_command_finishes_first)
    assert evaluate.main(["--oracle", "--ann", str(coco4_dir / "test_coco.json"), "--images", str(coco4_dir),
                          "--out", str(out), "--no-progress"]) == 2
    assert "was created by another command" in error_line(capsys.readouterr().err)
    assert out.read_text() == "the other evaluation" and sorted(tmp_path.iterdir()) == [out]


@pytest.mark.slow         # many CPU-seconds
def test_export_on_a_full_disk_or_read_only_folder_is_one_line(checkpoint, tmp_path, capsys,
                                                              monkeypatch):
    import errno
    import onnx

    out = tmp_path / "pose.onnx"
    for code in (errno.ENOSPC, errno.EROFS):
        def failing_save(*args, code=code, **kwargs):
            raise OSError(code, os.strerror(code))

        monkeypatch.setattr(onnx, "save", failing_save)
        assert export.main(["--weights", str(checkpoint), "--out", str(out)]) == 2
        assert one_error_line(capsys.readouterr().err) == (
            f"error: --out {out}: cannot write the file there ({os.strerror(code).lower()}); "
            "nothing was written")
        assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------ weights
def damaged(checkpoint: Path, folder: Path, how: str) -> tuple[Path, str]:
    """A copy of `checkpoint` with one tensor made NaN or int32; (its path, that tensor's name)."""
    state = load_checkpoint(checkpoint)
    weights = OrderedDict(state["model"])
    name = next(k for k, v in weights.items() if v.is_floating_point() and v.numel() > 1)
    weights[name] = weights[name].clone()
    if how == "nan":
        weights[name].view(-1)[1] = float("nan")
    else:
        weights = OrderedDict((k, v.to(torch.int32) if v.is_floating_point() else v)
                              for k, v in weights.items())
    path = folder / f"{how}.pth"
    save_checkpoint(path, dict(state, model=weights))
    return path, name


@pytest.mark.parametrize("how, says", [("nan", "holds 1 NaN or infinite values of"),
                                       ("int", "holds int32 values where the model has float32")])
def test_weights_with_nan_or_integer_tensors_are_refused_where_loaded(how, says, checkpoint, tmp_path,
                                                                      capsys, coco4_dir):
    path, name = damaged(checkpoint, tmp_path, how)
    with pytest.raises(Exception, match=f"{path}: tensor {name} {says}"):
        PoseEstimator.from_checkpoint(path, device="cpu")
    for main, argv in ((demo.main, ["--weights", path, "--image", coco4_dir / "000000000785.jpg",
                                    "--out", tmp_path / "drawn.png"]),
                       (evaluate.main, ["--weights", path, "--h5", tmp_path / "none.h5",
                                        "--out", tmp_path / "results.json"]),
                       (export.main, ["--weights", path, "--out", tmp_path / "pose.onnx"])):
        assert main([str(a) for a in argv]) == 2
        assert f"error: {path}: tensor {name} {says}" in one_error_line(capsys.readouterr().err)
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_a_resume_of_integer_weights_is_refused(env, capsys):
    work = env["root"] / "ints"
    work.mkdir()
    try:
        path, name = damaged(env["runs"] / "done" / "last.pth", work, "int")
        shutil.move(path, work / "last.pth")
        refused(capsys, train_cli, ["--resume", work / "last.pth", "--train-h5", env["train_h5"],
                                    "--epochs", "2"],
                [f"checkpoint {work / 'last.pth'}: tensor {name} holds int32 values"], env["root"])
    finally:
        shutil.rmtree(work)


# ------------------------------------------------------------------------------ the Python API
@pytest.mark.parametrize("picture, kind, says", [
    (None, TypeError, "picture 0 is None, not a picture"),
    ("photo.jpg", TypeError, "picture 0 is a path ('photo.jpg'), not a picture"),
    ([[0, 1]], TypeError, "picture 0 is a list, not a numpy array"),
    (np.zeros((64, 64, 3), bool), TypeError, "picture 0 has dtype bool"),
    (np.zeros((64, 64, 3), np.int64), TypeError, "picture 0 has dtype int64"),
    (np.zeros((64, 64, 5), np.uint8), ValueError, "picture 0 has shape (64, 64, 5)"),
    (np.zeros((3, 64, 48), np.uint8), ValueError, "picture 0 has shape (3, 64, 48), channels first"),
    (np.zeros((0, 0, 3), np.uint8), ValueError, "picture 0 is empty (shape (0, 0, 3))"),
    (np.zeros((2, 64, 64, 3), np.uint8), ValueError, "picture 0 has shape (2, 64, 64, 3)"),
    (np.full((64, 64, 3), np.nan, np.float32), ValueError, "picture 0 holds NaN or infinite values"),
    (np.full((64, 64, 3), 300.0, np.float32), ValueError, "picture 0 holds values from 300 to 300"),
])
def test_the_api_refuses_what_is_not_a_picture_naming_it(estimator, picture, kind, says):
    with pytest.raises(kind, match=re.escape(says)):
        estimator([picture])
    with pytest.raises(kind, match=re.escape(says)):
        estimator.maps([picture])


def test_a_single_path_or_none_is_refused_as_the_picture(estimator):
    with pytest.raises(TypeError, match="the picture is a path"):
        estimator("photo.jpg")
    with pytest.raises(TypeError, match="the picture is None"):
        estimator(None)
    for picture, kind in ((5, "int"), (2.5, "float"), (Path("photo.jpg"), "path")):   # numpy's own
        with pytest.raises(TypeError, match=f"^the picture is a {kind}"):              # TypeError before
            estimator(picture)


def same_people(a, b, tolerance: float = 0.0) -> bool:
    return len(a) == len(b) and all(np.abs(p.keypoints - q.keypoints).max() <= tolerance
                                    for p, q in zip(a, b))


@pytest.mark.slow         # many CPU-seconds
def test_grey_bgra_float_and_16_bit_pictures_are_converted_not_blackened(estimator, pictures):
    picture = pictures[0]
    grey = cv2.cvtColor(picture, cv2.COLOR_BGR2GRAY)
    as_grey = estimator(cv2.cvtColor(grey, cv2.COLOR_GRAY2BGR))
    assert len(as_grey) > 0
    assert same_people(estimator(grey), as_grey) and same_people(estimator(grey[:, :, None]), as_grey)
    found = estimator(picture)
    assert len(found) > 0
    bgra = cv2.cvtColor(picture, cv2.COLOR_BGR2BGRA)
    bgra[..., 3] = 7
    assert same_people(estimator(bgra), found)
    assert same_people(estimator(picture.astype(np.float32) / 255), found)    # 0-1: scaled, not black
    assert same_people(estimator(picture.astype(np.float64)), found)          # 0-255: as it is
    assert same_people(estimator(picture.astype(np.uint16) * 257), found)     # 16 bits: not wrapped


def test_a_huge_picture_runs_shrunk_and_its_people_are_in_its_pixels(estimator, pictures):
    wide = np.zeros((2000, 10000, 3), np.uint8)
    (prediction,) = estimator([wide], maps=True)
    assert prediction.maps.shape[1:] == (410, MAX_SIDE)
    picture = pictures[0][:, :pictures[0].shape[1] // 2 * 2][:pictures[0].shape[0] // 2 * 2]   # even sides
    side = max(picture.shape[:2]) // 2
    estimator.max_side = side
    try:
        shrunk_people = estimator(picture)
    finally:
        estimator.max_side = MAX_SIDE
    half = cv2.resize(picture, (picture.shape[1] // 2, picture.shape[0] // 2), interpolation=cv2.INTER_AREA)
    direct = estimator(half)
    factor = picture.shape[1] / half.shape[1]
    assert len(shrunk_people) == len(direct) > 0
    for got, want in zip(shrunk_people, direct):
        found = want.keypoints[:, 2] > 0
        mapped = (want.keypoints[found, :2] + 0.5) * factor - 0.5
        assert np.allclose(got.keypoints[found, :2], mapped, atol=1e-3)
        assert np.all(got.keypoints[~found] == 0)


# ------------------------------------------------------------------------------------- signals
def started(argv: list, cwd: Path, ready, env: dict | None = None) -> subprocess.Popen:
    """A command in its own process group, once `ready()` says it is in its long part."""
    proc = subprocess.Popen([sys.executable, *map(str, argv)], cwd=cwd, start_new_session=True, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env or child_env())
    deadline = time.monotonic() + 240
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"the command ended or never got to its long part: {err[-2000:]}")
        time.sleep(0.05)
    return proc


def stopped(proc: subprocess.Popen, sig: int) -> tuple[int, str, float]:
    """Send `sig` to the process group as a terminal or `timeout` does; (exit code, stderr, seconds)."""
    start = time.monotonic()
    os.killpg(proc.pid, sig)
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, err, time.monotonic() - start


def stop_line(err: str) -> str:
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.strip().splitlines() if line.startswith(("stopped", "interrupted"))]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


def many_images(coco4_dir: Path, folder: Path, count: int) -> Path:
    """A COCO JSON of `count` images (hard links of coco4's), for a conversion that takes a while."""
    coco = json.loads((coco4_dir / "test_coco.json").read_text())
    images, annotations = [], []
    for n in range(count):
        info = dict(coco["images"][n % 4], id=n + 1, file_name=f"{n:06d}.jpg")
        os.link(coco4_dir / coco["images"][n % 4]["file_name"], folder / info["file_name"])
        images.append(info)
        own = [a for a in coco["annotations"] if a["image_id"] == coco["images"][n % 4]["id"]]
        annotations += [dict(a, id=len(annotations) + 1 + k, image_id=n + 1) for k, a in enumerate(own)]
    path = folder / "many.json"
    path.write_text(json.dumps(dict(coco, images=images, annotations=annotations)))
    return path


def temporaries(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if p.name.startswith(".") and ".tmp" in p.name]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_conversion_stopped_by_a_signal_keeps_the_old_file_and_no_temporary(sig, coco4_dir, tmp_path):
    ann = many_images(coco4_dir, tmp_path, 3000)
    out = tmp_path / "out.h5"
    out.write_bytes(b"the user's earlier conversion")
    proc = started(["-m", "data.make_hdf5", "--ann", ann, "--images", tmp_path, "--out", out,
                    "--split", "val", "--overwrite"], REPO, lambda: bool(temporaries(tmp_path)))
    code, err, seconds = stopped(proc, sig)
    assert code == (143 if sig == signal.SIGTERM else 130) and seconds < 20, (code, seconds, err[-2000:])
    assert stop_line(err).endswith("the HDF5 file was not written (its partial copy is removed); an existing "
                                   "--out is as it was")
    assert out.read_bytes() == b"the user's earlier conversion" and temporaries(tmp_path) == []


@pytest.mark.slow
def test_a_ctrl_c_that_lands_in_code_run_by_exec_still_ends_a_python_m_command_with_130(tmp_path):
    """CPython 3.10-3.13 remember a KeyboardInterrupt that left code run by `exec(str)` (as namedtuple and
    dataclass creation do) and kill a `python -m` command by SIGINT at exit, though it was handled."""
    (tmp_path / "stopped_in_exec.py").write_text(
        "import sys, tqdm\n"          # imported, as in the commands: importing it later clears the flag
        "from common.errors import run_cli\n"
        "def main(argv):\n"
        "    exec('open(\"ready\", \"w\").close()\\nwhile True: pass')\n"
        "sys.exit(run_cli(main, [], kept='nothing was written'))\n")
    proc = started(["-m", "stopped_in_exec"], tmp_path, lambda: (tmp_path / "ready").exists(),
                   env=child_env(PYTHONPATH=os.pathsep.join([str(REPO), str(tmp_path)])))
    code, err, seconds = stopped(proc, signal.SIGINT)
    assert code == 130 and stop_line(err) == "interrupted (Ctrl-C); nothing was written", (code, err[-2000:])


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_video_stopped_by_a_signal_leaves_no_video_and_no_temporary(sig, checkpoint, tmp_path):
    clip, out = tmp_path / "clip.avi", tmp_path / "clip_pose.mp4"
    write_clip(clip, frames=3000, fps=25.0)
    proc = started(["demo.py", "--weights", checkpoint, "--video", clip, "--out", out, "--device", "cpu"],
                   REPO, lambda: bool(temporaries(tmp_path)))
    code, err, seconds = stopped(proc, sig)
    assert code == (143 if sig == signal.SIGTERM else 130) and seconds < 20, (code, seconds, err[-2000:])
    assert "a video being written is removed" in stop_line(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clip.avi"]


@pytest.mark.slow
def test_an_export_stopped_by_a_signal_leaves_no_file(checkpoint, coco4_dir, tmp_path):
    check = tmp_path / "check"
    check.mkdir()
    for n in range(400):
        os.link(coco4_dir / "000000000785.jpg", check / f"{n:04d}.jpg")
    out = tmp_path / "pose.onnx"
    proc = started(["export.py", "--weights", checkpoint, "--out", out, "--check-images", check], REPO,
                   lambda: bool(temporaries(tmp_path)))
    code, err, seconds = stopped(proc, signal.SIGTERM)
    assert code == 143 and seconds < 20, (code, seconds, err[-2000:])
    assert stop_line(err) == ("stopped by SIGTERM; the ONNX file was not written (its partial copy is "
                              "removed); an existing --out is as it was")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["check"]


@pytest.mark.slow
def test_an_evaluation_stopped_by_a_signal_removes_its_conversion(checkpoint, coco4_dir, tmp_path):
    work = tmp_path / "tmp"
    work.mkdir()
    ann = many_images(coco4_dir, tmp_path, 3000)
    out = tmp_path / "results.json"
    proc = started(["evaluate.py", "--weights", checkpoint, "--ann", ann, "--images", tmp_path, "--out", out,
                    "--device", "cpu"], REPO, lambda: any(work.iterdir()), env=child_env(TMPDIR=str(work)))
    code, err, seconds = stopped(proc, signal.SIGINT)
    assert code == 130 and seconds < 20, (code, seconds, err[-2000:])
    assert stop_line(err) == "interrupted (Ctrl-C); no results were written (an existing --out is as it was)"
    assert list(work.iterdir()) == [] and not out.exists()
