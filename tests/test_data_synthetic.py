"""The synthetic dataset (every annotation path present, splits differ, cached once, safe when
built concurrently), the preview tool and the pipeline benchmark's output."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import cv2
import numpy as np
import pytest

from data.h5format import KeypointH5
from data.preview import main as preview_main
from data.synthetic import ensure_synthetic_h5, main as synthetic_main, write_dataset

ROOT = Path(__file__).resolve().parents[1]


def test_dataset_exercises_every_annotation_path(tmp_path):
    paths = write_dataset(tmp_path, train_images=40, val_images=3, size=160, seed=1)
    coco = json.loads(paths["train"].read_text())
    assert len(coco["images"]) == 40 and coco["categories"][0]["name"] == "person"
    anns = coco["annotations"]
    crowds = [a for a in anns if a["iscrowd"]]
    assert crowds and all(isinstance(a["segmentation"], dict) for a in crowds)
    assert any(not a["iscrowd"] and a["num_keypoints"] == 0 for a in anns)
    keyed = [a for a in anns if a["num_keypoints"] > 0]
    vis = np.array([a["keypoints"][2::3] for a in keyed])
    assert (vis == 1).any() and (vis == 0).any() and (vis == 2).any()
    assert all(a["num_keypoints"] == int((np.array(a["keypoints"][2::3]) > 0).sum()) for a in keyed)
    per_image = np.bincount([a["image_id"] for a in keyed])
    assert per_image.max() >= 2
    cut = [a for a in keyed if a["bbox"][0] <= 0 or a["bbox"][1] <= 0
           or a["bbox"][0] + a["bbox"][2] >= 160 or a["bbox"][1] + a["bbox"][3] >= 160]
    assert cut
    image = cv2.imread(str(tmp_path / "train" / coco["images"][0]["file_name"]))
    assert image.shape == (160, 160, 3)
    val = json.loads(paths["val"].read_text())
    first_val = cv2.imread(str(tmp_path / "val" / val["images"][0]["file_name"]))
    assert not np.array_equal(first_val, image)                     # different seeds per split


def test_cached_h5_files_are_split_and_reused(synthetic_h5, tmp_path):
    train, val = synthetic_h5
    assert KeypointH5(train).split == "train" and KeypointH5(val).split == "val"
    assert KeypointH5(train).num_samples > 0 and KeypointH5(val).num_images == 8
    stamp = train.stat().st_mtime_ns
    assert ensure_synthetic_h5(train.parent, train_images=24, val_images=8) == (train, val)
    assert train.stat().st_mtime_ns == stamp                        # reused, not rebuilt


def test_concurrent_builds_and_damaged_cache_rebuild(tmp_path):
    results = []
    threads = [threading.Thread(target=lambda: results.append(
        ensure_synthetic_h5(tmp_path, train_images=6, val_images=2, size=160))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and results[0] == results[1]
    train, _ = results[0]
    assert KeypointH5(train).num_images > 0
    train.write_bytes(b"broken")
    ensure_synthetic_h5(tmp_path, train_images=6, val_images=2, size=160)
    assert KeypointH5(train).num_images > 0
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("draw-")]


def test_synthetic_cli_writes_coco_files(tmp_path, capsys):
    assert synthetic_main(["--out", str(tmp_path), "--train-images", "3", "--val-images", "2",
                           "--size", "96"]) == 0
    for split, count in (("train", 3), ("val", 2)):
        coco = json.loads((tmp_path / f"{split}.json").read_text())
        assert len(coco["images"]) == count
        assert len(list((tmp_path / split).glob("*.jpg"))) == count


def test_preview_writes_a_grid(synthetic_h5, tmp_path, capsys):
    out = tmp_path / "preview.png"
    assert preview_main(["--h5", str(synthetic_h5[0]), "--out", str(out), "--n", "3",
                         "--config", "tiny"]) == 0
    grid = cv2.imread(str(out))
    assert grid.shape == (128, 3 * 2 * 128, 3)
    assert preview_main(["--h5", str(tmp_path / "none.h5"), "--out", str(out)]) == 2
    assert capsys.readouterr().err.startswith("error: ")



def test_preview_refuses_no_samples_and_a_non_picture_name(synthetic_h5, tmp_path, capsys):
    h5 = str(synthetic_h5[0])
    assert preview_main(["--h5", h5, "--out", str(tmp_path / "p.png"), "--n", "0"]) == 2
    assert "option --n: 0 must be at least 1" in capsys.readouterr().err
    assert preview_main(["--h5", h5, "--out", str(tmp_path / "p.txt"), "--n", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --out ") and ".txt is not a picture format" in err
    assert err.count("\n") == 1
    out = tmp_path / "new" / "folder" / "p.png"           # missing folders are made
    assert preview_main(["--h5", h5, "--out", str(out), "--n", "1", "--config", "tiny"]) == 0
    assert cv2.imread(str(out)).shape == (128, 2 * 128, 3)

@pytest.mark.slow
def test_benchmark_prints_table_and_json_last():
    proc = subprocess.run([sys.executable, "bench/data_pipeline.py", "--samples", "12",
                           "--input-size", "256"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    figures = json.loads(lines[-1])
    assert {"read_per_s", "augment_per_s", "targets_per_s", "total_per_s", "h5_bytes_per_image",
            "raw_bytes_per_image", "size_ratio", "device_targets_cpu_ms_per_batch",
            "host_targets_cpu_ms_per_batch"} <= set(figures)
    assert figures["total_per_s"] > 0 and figures["size_ratio"] < 0.2
    # the total is the fastest of the passes, never slower than their median
    assert figures["repeats"] == 3 and figures["total_per_s"] >= figures["total_median_per_s"] > 0
    assert any(line.startswith("targets") for line in lines)


@pytest.mark.slow
@pytest.mark.parametrize("extra, data, workers", [
    (["--profile", "1"], "synthetic", 0),
    (["--h5", "coco4", "--repeat", "2", "--workers", "1"], "coco4 x2", 1)])   # a worker: a process
def test_training_throughput_benchmark_times_the_engine_step_with_synthetic_and_loaded_batches(
        extra, data, workers, capsys):
    from bench import train_throughput

    assert train_throughput.main(["--preset", "tiny", "--input", "64", "--batch", "4", "--steps", "2",
                                  "--warmup", "1", "--device", "cpu", "--channels-last", "both",
                                  "--configs", "O0 fp32", *extra]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # coco4 comes with the repository (tests/data/coco4), so the real images are what loads
    assert (result["data"], result["workers"], result["batch"]) == (data, workers, 4)
    assert [row["config"] for row in result["rows"]] == ["O0 fp32", "O0 fp32 +cl"]
    for row in result["rows"]:
        assert row["images_per_s"] > 0 and row["skipped_steps"] == 0
        assert 0 <= row["data_wait_share"] < 1
        if extra[0] == "--profile":   # op time by kind: shares of one whole, convolutions among them
            shares = row["time_by_op"]     # (how large each is depends on the machine's load)
            assert set(shares) <= {kind for kind, _ in train_throughput.OP_KINDS} | {"other"}
            assert abs(sum(shares.values()) - 1) < 0.01 and min(shares.values()) >= 0
            assert shares["convolution"] > 0 and shares["batch_norm"] > 0
