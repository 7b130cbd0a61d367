"""Every command checks every file it writes against every file and folder it reads and against its
other outputs, with --overwrite or without (`common.paths.refuse_clashes`, one mechanism): each
refusal is one `error:` line, exit 2, and every file under the test's folder left as it was. The
commands run in this process, through their `main(argv)`."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

import demo
import evaluate
import export
from common.errors import run_cli
from data import make_hdf5, preview
from engine import convert_reference
from runtime.checkpoint import save_checkpoint
from bad_inputs import refused

from conftest import COCO4_DIR

IMAGE = "000000000785.jpg"


@pytest.fixture
def files(tmp_path):
    """A COCO JSON of one picture, its pictures folder, a skeleton YAML, a preset YAML, weights, an
    HDF5 file and a run directory: what the commands read."""
    coco = json.loads((COCO4_DIR / "test_coco.json").read_text())
    coco["images"] = [i for i in coco["images"] if i["file_name"] == IMAGE]
    coco["annotations"] = [a for a in coco["annotations"] if a["image_id"] == coco["images"][0]["id"]]
    (tmp_path / "ann.json").write_text(json.dumps(coco))
    (tmp_path / "images").mkdir()
    shutil.copy(COCO4_DIR / IMAGE, tmp_path / "images" / IMAGE)
    shutil.copy(COCO4_DIR / IMAGE, tmp_path / "images" / "pose_pose.png")   # what demo draws for pose.png
    shutil.copy(COCO4_DIR / IMAGE, tmp_path / "images" / "pose.png")
    (tmp_path / "skeleton.yaml").write_text("keypoints: [a, b]\nlimbs: [[a, b]]\n")
    (tmp_path / "preset.yaml").write_text("train:\n  epochs: 1\n")
    save_checkpoint(tmp_path / "weights.pth", {"model": {"w": torch.zeros(1)}})
    (tmp_path / "data.h5").write_bytes(b"an HDF5 file")
    run = tmp_path / "runs" / "run"
    run.mkdir(parents=True)
    save_checkpoint(run / "last.pth", {"model": {"w": torch.zeros(1)}})
    (run / "config.yaml").write_text("preset: tiny\n")
    return tmp_path


def train_main(argv):
    import train
    return run_cli(train.main, argv)


# (command, its arguments, what the one line says); T: the test's folder
HDF5 = ["--ann", "T/ann.json", "--images", "T/images", "--quiet"]
CASES = {
    "make_hdf5 --out is --skeleton": (make_hdf5.main, HDF5 + ["--skeleton", "T/skeleton.yaml",
                                                            "--out", "T/skeleton.yaml"],
                                      "--out T/skeleton.yaml is the same file as --skeleton T/skeleton.yaml"),
    "make_hdf5 --skipped is --skeleton": (make_hdf5.main, HDF5 + ["--out", "T/o.h5", "--skip-bad",
                                                                "--skeleton", "T/skeleton.yaml",
                                                                "--skipped", "T/skeleton.yaml"],
                                          "--skipped T/skeleton.yaml is the same file as --skeleton"),
    "make_hdf5 --dump-skeleton is --skeleton": (make_hdf5.main, HDF5[:4] + [     # no --quiet: no conversion
        "--skeleton", "T/skeleton.yaml", "--dump-skeleton", "T/./skeleton.yaml"],
        "--dump-skeleton T/skeleton.yaml is the same file as --skeleton"),
    "make_hdf5 --skipped is a picture": (make_hdf5.main, HDF5 + ["--out", "T/o.h5", "--skip-bad",
                                                               "--skipped", f"T/images/{IMAGE}"],
                                         f"--skipped T/images/{IMAGE} is the same file as --images"),
    "make_hdf5 --out is a picture": (make_hdf5.main, HDF5 + ["--out", f"T/images/{IMAGE}"],
                                     f"--out T/images/{IMAGE} is the same file as --images"),
    "make_hdf5 --dump-skeleton is a picture": (make_hdf5.main, HDF5[:4] + [
        "--dump-skeleton", f"T/images/{IMAGE}"],
                                               f"--dump-skeleton T/images/{IMAGE} is the same file as --images"),
    "make_hdf5 two outputs, one file": (make_hdf5.main, HDF5 + ["--out", "T/o.h5", "--skip-bad",
                                                              "--skipped", "T/both", "--dump-skeleton", "T/both"],
                                        "--dump-skeleton T/both and --skipped T/both are the same file"),
    "make_hdf5 --out and --skipped, one file": (make_hdf5.main, HDF5 + ["--out", "T/o.h5", "--skip-bad",
                                                                      "--skipped", "T/o.h5"],
                                                "--skipped T/o.h5 and --out T/o.h5 are the same file"),
    "evaluate --out is --weights": (evaluate.main, ["--weights", "T/weights.pth", "--h5", "T/data.h5",
                                                    "--device", "cpu", "--out", "T/weights.pth"],
                                    "--out T/weights.pth is the same file as --weights"),
    "evaluate --out is a picture": (evaluate.main, ["--oracle", "--ann", "T/ann.json", "--images", "T/images",
                                                    "--out", f"T/images/{IMAGE}"],
                                    f"--out T/images/{IMAGE} is inside --images T/images"),
    "evaluate --out is --preset": (evaluate.main, ["--weights", "T/weights.pth", "--h5", "T/data.h5",
                                                   "--preset", "T/preset.yaml", "--out", "T/preset.yaml"],
                                   "--out T/preset.yaml is the same file as --preset"),
    "demo --out is --image": (demo.main, ["--weights", "T/weights.pth", "--image", f"T/images/{IMAGE}",
                                          "--out", f"T/images/../images/{IMAGE}"],
                              f"--out T/images/../images/{IMAGE} is the same file as --image"),
    "demo --out over a picture of the folder": (demo.main, ["--weights", "T/weights.pth", "--image", "T/images",
                                                            "--out", "T/images"],
                                                "--out T/images/pose_pose.png is the same file as --image"),
    "export --out is --weights": (export.main, ["--weights", "T/weights.pth", "--out", "T/weights.pth"],
                                  "--out T/weights.pth is the same file as --weights"),
    "export --out is a picture of --check-images": (export.main, ["--weights", "T/weights.pth", "--check-images",
                                                                  "T/images", "--out", f"T/images/{IMAGE}"],
                                                    f"--out T/images/{IMAGE} is the same file as --check-images"),
    "preview --out is --h5": (preview.main, ["--h5", "T/data.h5", "--out", "T/data.h5"],
                              "--out T/data.h5 is the same file as --h5"),
    "preview --out is --config": (preview.main, ["--h5", "T/data.h5", "--config", "T/preset.yaml",
                                                 "--out", "T/preset.yaml"],
                                  "--out T/preset.yaml is the same file as --config"),
    "convert_reference OUT is IN": (convert_reference.main, ["T/weights.pth", "T/weights.pth"],
                                    "OUT.pth T/weights.pth is the same file as IN.pth"),
}


def _argv(argv, root, overwrite: bool) -> list[str]:
    argv = [str(a).replace("T/", f"{root}/") for a in argv]
    return argv + ["--overwrite"] * overwrite


@pytest.mark.parametrize("overwrite", [False, True], ids=["", "overwrite"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_an_output_that_would_destroy_an_input_or_another_output_is_refused(case, overwrite, files, capsys):
    main, argv, says = CASES[case]
    refused(capsys, main, _argv(argv, files, overwrite), [says.replace("T/", f"{files}/")], files)


@pytest.mark.parametrize("overwrite", [False, True], ids=["", "overwrite"])
@pytest.mark.parametrize("option", ["--weights", "--train-h5", "--config"])
def test_a_run_never_writes_over_what_it_reads(option, overwrite, files, capsys):
    """A run writes (and with --overwrite first removes) its files in the run directory: one of
    them given as an input is refused, resumed or not."""
    run = files / "runs" / "run"
    read = run / ("config.yaml" if option == "--config" else "last.pth")
    argv = ["--out-dir", files / "runs", "--run-name", "run", option, read,
            *(["--overwrite"] if overwrite else ["--resume", "auto"])]
    refused(capsys, train_main, [str(a) for a in argv],
            [f"--run-name/--out-dir {read} is the same file as {option} {read}"], files)
