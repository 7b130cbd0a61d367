"""A short CPU training run ends with exactly the weights stored in tests/data/run_digests.json.

This guards behaviour while the code is reorganised: the same command, on the same data, seed and
versions, must give the same weights bit for bit. Each run is `python train.py` on the four COCO
pictures of tests/data/coco4 (converted here; the HDF5 file keeps their JPEG bytes), seed 0, no
DataLoader workers, one thread, and every library that picks its CPU kernels by the processor pinned
to code any x86-64 machine runs (`PINNED`): ATen and oneDNN to AVX2, MKL to its COMPATIBLE branch,
so that the sums are done the same way with or without AVX-512. MKL ignores `MKL_CBWR=AVX2` on an
AMD Zen 4 (its SGEMM still ran AVX-512 code there: the float32 digest differed from an AVX2
machine's), while `COMPATIBLE` is honoured everywhere; NumPy's and OpenCV's own AVX-512 paths were
turned off one at a time on that machine and changed no weight. The digest is the SHA-256 of every tensor of the
checkpoint's weights (and its EMA weights when there are some), by sorted name, with its dtype and
shape.

The same file holds the digest of a small draw of the project's synthetic dataset (the main job's
data): the pixels of its pictures as OpenCV writes and reads them back (JPEG) and its annotations,
with the versions that drew it. A release of OpenCV or NumPy that changes what the dataset holds
fails `test_the_synthetic_dataset_draws_what_it_drew` (an OpenCV release once moved the main job's
AP from 0.5746 to 0.5206 without a word); requirements-lock.txt holds the set the digests were
recorded with.

A change that is meant to change the numbers (code, or a new package set in
requirements-lock.txt) records new digests with `python tests/test_run_digest.py` (it rewrites
tests/data/run_digests.json) and says why in its commit.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
DIGESTS = Path(__file__).resolve().parent / "data" / "run_digests.json"
COCO4 = Path(__file__).resolve().parent / "data" / "coco4"

QUICK = ["--epochs", "2", "--set", "train.max_steps_per_epoch=2", "--batch-size", "2", "--workers", "0",
         "--seed", "0", "--device", "cpu", "--set", "train.val_every=0", "--set", "train.ap_every=0",
         "--set", "train.tensorboard=false",
         "--set", "optim.milestones=[7,9]"]   # the epochs the tiny preset's shares [0.7, 0.9] name at 10
RUNS = {
    "float32": [],
    "bfloat16_accumulate_ema_clip": ["--opt-level", "O1", "--accumulate", "2", "--ema", "0.9",
                                     "--clip-grad", "1.0"],
}
PINNED = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "ATEN_CPU_CAPABILITY": "avx2",
          "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_CBWR": "COMPATIBLE"}


def weights_digest(checkpoint: dict) -> str:
    """SHA-256 over the weights (and EMA weights) by sorted name: name, dtype, shape, bytes."""
    tensors = {f"model.{k}": v for k, v in checkpoint["model"].items()}
    if checkpoint.get("ema"):
        tensors.update({f"ema.{k}": v for k, v in checkpoint["ema"]["model"].items()})
    sha = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        sha.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        sha.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


def synthetic_digest(folder: Path) -> str:
    """SHA-256 of a small draw of the synthetic dataset: each split's annotations, then each
    picture's pixels as read back from its JPEG file."""
    import cv2
    import numpy as np
    from data.synthetic import write_dataset

    sha = hashlib.sha256()
    for split, path in write_dataset(folder, train_images=3, val_images=2).items():
        coco = json.loads(path.read_text())
        sha.update(json.dumps(coco, sort_keys=True).encode())
        for image in coco["images"]:
            pixels = cv2.imread(str(folder / split / image["file_name"]), cv2.IMREAD_COLOR)
            sha.update(np.ascontiguousarray(pixels).tobytes())
    return sha.hexdigest()


def versions() -> dict:
    """The versions of the libraries the synthetic dataset is drawn with."""
    import cv2
    import numpy as np
    return {"opencv": cv2.__version__, "numpy": np.__version__}


def test_the_synthetic_dataset_draws_what_it_drew(tmp_path):
    stored = json.loads(DIGESTS.read_text())["synthetic"]
    assert synthetic_digest(tmp_path) == stored["digest"], (
        f"the synthetic dataset's pictures or annotations differ from those drawn with {stored['versions']}; "
        f"this is {versions()}: a library release changed what the main job trains on (and its AP). "
        "Install requirements-lock.txt, or, if the change is meant, record new digests with "
        "python tests/test_run_digest.py and a new requirements-lock.txt")


def coco4_h5(folder: Path) -> Path:
    from data import make_hdf5

    out = folder / "coco4.h5"
    assert make_hdf5.main(["--ann", str(COCO4 / "test_coco.json"), "--images", str(COCO4),
                           "--out", str(out)]) == 0
    return out


def run_digest(name: str, h5: Path, runs: Path) -> str:
    from runtime.checkpoint import load_checkpoint

    env = {**os.environ, **PINNED}
    cmd = [sys.executable, "train.py", "--train-h5", str(h5), "--out-dir", str(runs), "--run-name", name,
           *QUICK, *RUNS[name]]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return weights_digest(load_checkpoint(runs / name / "last.pth"))


@pytest.fixture(scope="module")
def digests(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("digest")
    h5 = coco4_h5(folder)
    return {name: run_digest(name, h5, folder / "runs") for name in RUNS}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RUNS))
def test_a_short_run_ends_with_the_stored_weights(digests, name):
    stored = json.loads(DIGESTS.read_text())
    if torch.__version__ != stored["torch"]:
        pytest.skip(f"digests were made with torch {stored['torch']} (requirements.txt); this is "
                    f"{torch.__version__}, whose kernels may round differently")
    capability = torch.backends.cpu.get_cpu_capability()
    # a processor whose float32 sums PINNED does not make equal to the AVX-512 machine's has its own
    expected = stored.get("runs_by_capability", {}).get(capability, {}).get(name, stored["runs"][name])
    assert digests[name] == expected, (
        f"run {name!r}: its weights differ from the stored digest (CPU capability "
        f"{capability}); a change meant to change the numbers records "
        "new digests with python tests/test_run_digest.py")


if __name__ == "__main__":
    import tempfile

    sys.path.insert(0, str(REPO))
    with tempfile.TemporaryDirectory() as tmp:
        h5 = coco4_h5(Path(tmp))
        made = {name: run_digest(name, h5, Path(tmp) / "runs") for name in RUNS}
        synthetic = {"versions": versions(), "digest": synthetic_digest(Path(tmp) / "synthetic")}
    # a processor with its own entry records there; the others' entries are kept as they were
    old = json.loads(DIGESTS.read_text()) if DIGESTS.exists() else {}
    by_capability = old.get("runs_by_capability", {})
    capability = torch.backends.cpu.get_cpu_capability()
    if capability in by_capability:
        by_capability[capability].update({k: made[k] for k in by_capability[capability]})
        made = {k: old["runs"].get(k, v) for k, v in made.items()}
    DIGESTS.write_text(json.dumps({"torch": torch.__version__, "pinned": PINNED, "runs": made,
                                   "synthetic": synthetic, "runs_by_capability": by_capability},
                                  indent=2) + "\n")
    print(f"wrote {DIGESTS}")
