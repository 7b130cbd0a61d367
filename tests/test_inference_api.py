"""The inference API (inference.PoseEstimator): its docstring example, people records, the same
people as evaluate.py, batched equal to one by one, an ONNX export with the same maps and people,
a video through demo.py, and one error line for bad inputs."""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

import demo
import evaluate
import export
import inference.estimator
from child_env import child_env
from data.skeleton import builtin
from config.loader import build_config, to_dict
from config.views import PredictSettings
from runtime.checkpoint import save_checkpoint
from inference import Person, PoseEstimator, Prediction
from inference.grouping import to_coco_results

COCO = builtin("coco")

REPO = Path(__file__).resolve().parent.parent
# Loose grouping, so that the untrained network's small, random maps give people to compare.
# Loose grouping finds many people on an untrained network's maps, so the comparisons below are
# not trivial; joining partial people (bridge_ratio) would merge those fragments and is tested on
# ground truth in test_grouping_dense.py.
LOOSE = ["inference.peak_threshold=0.0003", "inference.max_peaks=6", "inference.limb_threshold=-1",
         "inference.min_mean_score=0", "inference.scales=[1.0]", "inference.flip=true",
         "inference.bridge_ratio=0"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_network) -> Path:
    """A tiny checkpoint whose saved config has the loose grouping and flip on."""
    cfg = build_config("tiny", sets=LOOSE)
    path = tmp_path_factory.mktemp("weights") / "best.pth"
    save_checkpoint(path, {"model": tiny_network.state_dict(), "config": to_dict(cfg)})
    return path


@pytest.fixture(scope="module")
def estimator(checkpoint) -> PoseEstimator:
    return PoseEstimator.from_checkpoint(checkpoint, device="cpu")


@pytest.fixture(scope="module")
def pictures(coco4_dir) -> list[np.ndarray]:
    """The coco4 pictures at 0.4 of their size (the same heights at scale 1: faster grouping)."""
    return [cv2.resize(cv2.imread(str(p)), None, fx=0.4, fy=0.4, interpolation=cv2.INTER_AREA)
            for p in sorted(coco4_dir.glob("*.jpg"))]


def one_error_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), text
    return lines[0]


def test_docstring_example_runs(checkpoint, coco4_dir, tmp_path, monkeypatch):
    code = [line[4:] for line in inference.estimator.__doc__.splitlines() if line.startswith("    ")]
    assert len(code) == 5
    shutil.copy(checkpoint, tmp_path / "best.pth")
    shutil.copy(coco4_dir / "000000000785.jpg", tmp_path / "photo.jpg")
    monkeypatch.chdir(tmp_path)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec("\n".join(code), {})
    found = re.findall(r"\((-?[\d.]+), \(([-\d., ]+)\)\)", printed.getvalue())
    assert len(found) >= 1 and all(len(box.split(",")) == 4 for _, box in found)


@pytest.mark.slow
def test_docstring_example_runs_from_another_folder_with_the_clone_on_pythonpath(
        checkpoint, coco4_dir, tmp_path):
    """A user's program in a folder of its own (README.md, "From your own program")."""
    code = [line[4:] for line in inference.estimator.__doc__.splitlines() if line.startswith("    ")]
    (tmp_path / "mine.py").write_text("\n".join(code) + "\n")
    shutil.copy(checkpoint, tmp_path / "best.pth")
    shutil.copy(coco4_dir / "000000000785.jpg", tmp_path / "photo.jpg")
    runs = {path: subprocess.run([sys.executable, "mine.py"], cwd=tmp_path, capture_output=True, text=True,
                                 env=child_env(PYTHONPATH=path), timeout=300) for path in (str(REPO), "")}
    assert runs[str(REPO)].returncode == 0, runs[str(REPO)].stderr
    assert re.search(r"\((-?[\d.]+), \(([-\d., ]+)\)\)", runs[str(REPO)].stdout)
    assert "No module named 'inference'" in runs[""].stderr       # without it: what the docs warn of


def test_settings_come_from_the_checkpoint_and_people_are_plain_records(estimator, pictures):
    assert estimator.settings.inference.flip is True and estimator.settings.inference.peak_threshold == 0.0003
    assert estimator.config.model == build_config("tiny").model and estimator.device == torch.device("cpu")
    people = estimator(pictures[0])
    assert people and all(isinstance(p, Person) for p in people)
    assert [p.score for p in people] == sorted((p.score for p in people), reverse=True)
    for person in people:
        assert person.keypoints.shape == (len(estimator.skeleton.keypoints), 3)
        found = person.keypoints[person.keypoints[:, 2] > 0]
        x0, y0, x1, y1 = person.box
        assert found[:, 0].min() == x0 and found[:, 0].max() == x1
        assert found[:, 1].min() == y0 and found[:, 1].max() == y1
    prediction = estimator(pictures[0], maps=True)
    assert isinstance(prediction, Prediction)
    assert prediction.maps.shape == (estimator.skeleton.num_channels, *pictures[0].shape[:2])
    assert [p.score for p in prediction.people] == [p.score for p in people]


@pytest.mark.slow         # many CPU-seconds
@pytest.mark.parametrize("max_side", [None, 320], ids=["as they are", "shrunk to 320 px"])
def test_the_api_finds_the_people_of_evaluate_py(max_side, estimator, checkpoint, coco4_dir, tmp_path, capsys,
                                                 monkeypatch):
    """Pictures over the largest side run shrunk, and evaluation scores people in their own pixels."""
    if max_side:
        monkeypatch.setattr(inference.estimator, "MAX_SIDE", max_side)
        monkeypatch.setattr(estimator, "max_side", max_side)
    out = tmp_path / "results.json"
    code = evaluate.main(["--weights", str(checkpoint), "--ann", str(coco4_dir / "test_coco.json"),
                          "--images", str(coco4_dir), "--out", str(out), "--no-progress", "--device", "cpu"])
    assert code == 0, capsys.readouterr().err
    by_evaluate = json.loads(out.read_text())
    image_ids = [img["id"] for img in json.loads((coco4_dir / "test_coco.json").read_text())["images"]]
    pictures = [cv2.imread(str(coco4_dir / f"{i:012d}.jpg")) for i in image_ids]
    by_api = [result for image_id, people in zip(image_ids, estimator(pictures))
              for result in to_coco_results(image_id, np.array([p.keypoints for p in people]),
                                            np.array([p.score for p in people]), COCO)]
    assert len(by_api) >= 40 and by_api == by_evaluate


@pytest.mark.slow         # many CPU-seconds
def test_batched_equals_one_by_one(estimator, pictures):
    calls = []
    network = estimator.network

    def counted(batch):
        calls.append(tuple(batch.shape))
        return network(batch)

    counted.device, counted.skeleton = network.device, network.skeleton   # a network's attributes
    batched = PoseEstimator(counted, estimator.settings)
    # two padded sizes among the four pictures at height 128 (widths 256 and 192): two passes of
    # two pictures, each with its mirror
    maps = batched.maps(pictures)
    assert sorted(calls) == [(4, 3, 128, 192), (4, 3, 128, 256)]
    for picture, picture_maps in zip(pictures, maps):
        alone = estimator.maps([picture])[0]
        np.testing.assert_allclose(picture_maps, alone, rtol=1e-5, atol=1e-6 * np.abs(alone).max())
    together, apart = batched(pictures), [estimator(p) for p in pictures]
    assert [len(p) for p in together] == [len(p) for p in apart] and sum(map(len, apart)) >= 20
    for people_together, people_apart in zip(together, apart):
        for a, b in zip(people_together, people_apart):
            np.testing.assert_allclose(a.keypoints, b.keypoints, atol=1e-3)


@pytest.mark.slow         # many CPU-seconds
def test_a_stream_runs_batches_of_equal_padded_size_with_the_people_of_one_by_one(estimator, pictures):
    """Square and 3:2 pictures in turn, 4 a batch: the window batches the four squares in one pass
    and the 3:2 ones two a pass (consecutive batches of 4 held two of each, four passes); each
    picture's maps and people are those of the picture alone."""
    mixed = [p[:, : p.shape[0] * (2 + k % 2) // 2] for k, p in enumerate(pictures * 2)]
    runs = []
    network = estimator.network

    def counted(batch):
        runs.append(tuple(batch.shape))
        return network(batch)
    counted.device, counted.skeleton = network.device, network.skeleton
    settings = dataclasses.replace(estimator.settings, inference=dataclasses.replace(
        estimator.settings.inference, batch_size=4))
    streamed = list(PoseEstimator(counted, settings).stream(mixed, maps=True))
    assert sorted(runs) == [(4, 3, 128, 192), (4, 3, 128, 192), (8, 3, 128, 128)]     # with mirrors
    for picture, together in zip(mixed, streamed):        # identical (on this CPU's kernels)
        alone = estimator(picture, maps=True)
        np.testing.assert_array_equal(together.maps, alone.maps)
        assert [(p.score, p.box, p.keypoints.tolist()) for p in together.people] == [
            (p.score, p.box, p.keypoints.tolist()) for p in alone.people]
    assert sum(len(p.people) for p in streamed) >= 20


@pytest.mark.slow         # many CPU-seconds
def test_onnx_export_agrees_with_pytorch_and_gives_the_same_people(checkpoint, estimator, pictures,
                                                                   tmp_path, capsys):
    out = tmp_path / "pose.onnx"
    assert export.main(["--weights", str(checkpoint), "--format", "onnx", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "agree with PyTorch's on 4 pictures" in printed and out.is_file()
    assert {"(128, 256)", "(128, 192)"} <= set(re.findall(r"\(\d+, \d+\)", printed))   # dynamic size
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pose.onnx"]                # no temp left
    exported = PoseEstimator.from_onnx(out)
    assert exported.config == estimator.config and exported.settings == estimator.settings
    from_onnx, from_torch = exported(pictures), estimator(pictures)
    assert [len(p) for p in from_onnx] == [len(p) for p in from_torch]
    for people_onnx, people_torch in zip(from_onnx, from_torch):
        for a, b in zip(people_onnx, people_torch):
            np.testing.assert_allclose(a.keypoints[:, :2], b.keypoints[:, :2], atol=0.01)
    # the check can fail: with a tolerance nothing meets, no file is written
    strict, one_picture = tmp_path / "strict.onnx", tmp_path / "check"
    one_picture.mkdir()
    cv2.imwrite(str(one_picture / "p.png"), pictures[0])
    assert export.main(["--weights", str(checkpoint), "--out", str(strict), "--tolerance", "1e-12",
                        "--check-images", str(one_picture)]) == 1
    assert one_error_line(capsys.readouterr().err).startswith(f"error: {strict}: onnxruntime's maps of ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["check", "pose.onnx"]


def write_clip(path: Path, frames: int, fps: float) -> None:
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), fps, (96, 64))
    picture = cv2.imread(str(REPO / "tests" / "data" / "coco4" / "000000000785.jpg"))
    for k in range(frames):
        writer.write(cv2.resize(np.roll(picture, 20 * k, axis=1), (96, 64)))
    writer.release()


def test_video_round_trip_keeps_frames_and_rate(checkpoint, tmp_path, capsys):
    clip, out = tmp_path / "clip.avi", tmp_path / "clip_pose.mp4"
    write_clip(clip, frames=5, fps=8.0)
    assert demo.main(["--weights", str(checkpoint), "--video", str(clip), "--out", str(out),
                      "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert re.search(r"5 frames in [\d.]+ s: [\d.]+ frames/s; written to ", printed)
    video = cv2.VideoCapture(str(out))
    count = 0
    while video.read()[0]:
        count += 1
    assert count == 5 and video.get(cv2.CAP_PROP_FPS) == 8.0 and video.get(cv2.CAP_PROP_FRAME_WIDTH) == 96
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clip.avi", "clip_pose.mp4"]
    # an existing video is never overwritten
    before = out.read_bytes()
    assert demo.main(["--weights", str(checkpoint), "--video", str(clip), "--out", str(out)]) == 2
    assert "already exists" in one_error_line(capsys.readouterr().err) and out.read_bytes() == before


@pytest.fixture(scope="module")
def foreign_onnx(tmp_path_factory) -> Path:
    """An ONNX file of another program (no config in its metadata)."""
    path = tmp_path_factory.mktemp("foreign") / "foreign.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(torch.nn.Conv2d(3, 2, 1), (torch.zeros(1, 3, 8, 8),), str(path), dynamo=False)
    return path


@pytest.mark.parametrize("script, argv, message", [
    (export, ["--weights", "{ckpt}", "--format", "tensorrt", "--out", "{tmp}/a.trt"],
     "--format tensorrt: unknown format; this exporter writes onnx"),
    (export, ["--weights", "{foreign}", "--out", "{tmp}/b.onnx"], "is an ONNX file, not a checkpoint"),
    (export, ["--weights", "{ckpt}", "--out", "{tmp}/c.onnx", "--opset", "8"],
     "--opset 8: this export needs an opset from 9 to "),
    (export, ["--weights", "{ckpt}", "--out", "{tmp}/c.onnx", "--opset", "99"],
     "--opset 99: this export needs an opset from 9 to "),
    (export, ["--weights", "{ckpt}", "--out", "{tmp}/c.onnx", "--tolerance", "nan"],
     "--tolerance nan: must be from 0 to 1"),
    (export, ["--weights", "{ckpt}", "--out", "{tmp}/c.onnx", "--tolerance", "-1"],
     "--tolerance -1.0: must be from 0 to 1"),
    (export, ["--weights", "{ckpt}", "--out", "{tmp}/c.onnx", "--tolerance", "1e19"],
     "--tolerance 1e+19: must be from 0 to 1 (a share of the maps' largest magnitude)"),
    (demo, ["--weights", "{ckpt_as_onnx}", "--image", "{tmp}"], "is not an ONNX file onnxruntime can run"),
    (demo, ["--weights", "{foreign}", "--image", "{tmp}"], "an ONNX file but not one written by export.py"),
    (demo, ["--weights", "{ckpt}", "--video", "{tmp}/missing.mp4"],
     "--video {tmp}/missing.mp4: no such file"),
    (demo, ["--weights", "{ckpt}", "--video", "{tmp}/clip.avi", "--out", "{tmp}/x.mkv"],
     "is not a video format this demo writes"),
    (demo, ["--weights", "{ckpt}", "--camera", "0"], "--camera 0: no display here"),
])
def test_bad_inputs_give_one_error_line(script, argv, message, checkpoint, foreign_onnx, tmp_path,
                                        monkeypatch, capfd):
    monkeypatch.delenv("DISPLAY", raising=False)
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    shutil.copy(checkpoint, tmp_path / "ckpt.onnx")
    (tmp_path / "p.png").write_bytes(cv2.imencode(".png", np.zeros((8, 8, 3), np.uint8))[1].tobytes())
    write_clip(tmp_path / "clip.avi", frames=1, fps=5.0)
    names = {"ckpt": checkpoint, "tmp": tmp_path, "foreign": foreign_onnx,
             "ckpt_as_onnx": tmp_path / "ckpt.onnx"}
    argv = [a.format(**names) for a in argv]
    assert script.main(argv) == 2
    assert message.format(**names) in one_error_line(capfd.readouterr().err)


@pytest.mark.slow
def test_unreadable_video_is_one_error_line_on_the_command_line(checkpoint, tmp_path):
    """Run for real: FFmpeg's own complaints about the file must not reach the terminal either."""
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(b"\x00\x00\x00\x18ftypmp42" + os.urandom(3000))
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENCV_")}
    done = subprocess.run([sys.executable, "demo.py", "--weights", str(checkpoint), "--video", str(broken)],
                          cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 2 and done.stdout == ""
    assert one_error_line(done.stderr) == (f"error: --video {broken}: not a video OpenCV can read "
                                           "(damaged or unknown format)")


def test_large_pictures_go_in_smaller_windows(estimator, monkeypatch):
    """The network takes WINDOW batches of COCO-sized pictures at once (HD video frames: fewer)."""
    seen = []
    monkeypatch.setattr(inference.estimator, "network_maps",
                        lambda network, chunk, settings: seen.append(len(chunk)) or [[]] * len(chunk))
    assert estimator.settings.inference.batch_size == 8 and inference.estimator.WINDOW == 4
    assert len(list(estimator.network_stream([np.zeros((480, 640, 3), np.uint8)] * 40))) == 40
    assert seen == [32, 8]
    seen.clear()
    assert len(list(estimator.network_stream([np.zeros((1080, 1920, 3), np.uint8)] * 12))) == 12
    assert seen == [5, 5, 2]


def fake_network(batch_size: int, runs: list):
    """A network that gives zero maps, its batches' shapes appended to `runs`, and settings of
    `batch_size` (input 128, one scale, no flip)."""
    def network(batch):
        runs.append(tuple(batch.shape))
        return torch.zeros(batch.shape[0], COCO.num_channels, batch.shape[2] // 4, batch.shape[3] // 4)
    network.device, network.skeleton = torch.device("cpu"), COCO
    cfg = build_config("tiny", sets=[f"inference.batch_size={batch_size}", "inference.scales=[1.0]",
                                     "inference.flip=false", "inference.decode_threads=1"])
    return network, PredictSettings.of(cfg)


def test_grouping_overlaps_the_networks_next_window_and_the_network_runs_a_bounded_way_ahead(monkeypatch):
    """Grouping the first picture waits until the network has run the next window (it ran after the
    whole batch was grouped, one thread doing both), while the network runs at most two windows
    ahead of grouping however long the stream (memory stays bounded); the pictures are read in the
    caller's thread."""
    runs, ran_next, seen_ahead = [], threading.Event(), []
    network, settings = fake_network(2, runs)
    window = inference.estimator.WINDOW * 2

    def group_people(maps, cfg, skeleton):
        if not seen_ahead:
            seen_ahead.append(ran_next.wait(10))
            time.sleep(0.5)                                  # the network's chance to run further
            seen_ahead.append(sum(shape[0] for shape in runs))
        return np.zeros((0, len(COCO.keypoints), 3), np.float32), np.zeros(0, np.float32)

    def counted(batch):
        out = network(batch)
        if sum(shape[0] for shape in runs) > window:
            ran_next.set()
        return out
    counted.device, counted.skeleton = network.device, network.skeleton
    monkeypatch.setattr(inference.estimator, "group_people", group_people)
    readers = set()

    def pictures():                     # read in the caller's thread only (demo.py tees them)
        for _ in range(200):
            readers.add(threading.get_ident())
            yield np.zeros((128, 128, 3), np.uint8)
    assert len(list(PoseEstimator(counted, settings).grouped(pictures()))) == 200
    assert seen_ahead[0] is True and window < seen_ahead[1] <= 2 * window, seen_ahead
    assert readers == {threading.get_ident()}


STRIP_CAPPED = """
import resource, sys
import demo, torch
in_use = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (in_use + (2 << 30),) * 2)        # 2 GiB more than now
sys.exit(demo.main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(1, 20000), (20000, 1)], ids=["1x20000", "20000x1"])
def test_a_picture_of_any_shape_runs_in_bounded_memory(shape, checkpoint, tmp_path):
    """A 140-byte strip PNG: shrunk to 2048 on its longer side, it ran by its height at 512 x 1048576
    (gigabytes of network input); now within 2 GiB, drawn at its own size."""
    strip = tmp_path / "strip.png"
    cv2.imwrite(str(strip), np.full((*shape, 3), 200, np.uint8))
    out = tmp_path / "strip_pose.png"
    done = subprocess.run([sys.executable, "-c", STRIP_CAPPED, "--weights", str(checkpoint), "--image", str(strip),
                           "--out", str(out), "--device", "cpu"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert cv2.imread(str(out)).shape == (*shape, 3)
