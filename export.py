"""Export a trained network for deployment runtimes, checked against PyTorch.

    python export.py --weights best.pth --format onnx --out pose.onnx [--opset 17]

The file holds the network (grouping stays in Python) and its config; onnxruntime runs it on the
--check-images first, and nothing is written (exit code 1) unless its maps are within --tolerance of
PyTorch's. Needs onnx and onnxruntime (pip install -r requirements-export.txt).
"""
from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import numpy as np
import torch

from common.errors import ArgumentParser, ConfigError, DataError, UserError, chained_os_reason
from common.paths import refuse_clashes, refuse_existing, written_whole
from config.loader import to_dict
from data.picture_files import read_picture
from data.preprocess import padded_size, pictures_to_batch
from inference.command_line import command_main, weights_options
from inference.estimator import PoseEstimator
from inference.onnx_network import (CONFIG_KEY, INPUT_NAME, KEYPOINTS_KEY, OUTPUT_NAME, SKELETON_KEY,
                                    OnnxNetwork, need)
from inference.predict import TorchNetwork, resize_for_scale

FORMATS = ("onnx",)
MIN_OPSET = 9      # the network's upsampling needs it from the TorchScript exporter
CHECK_PICTURES = Path(__file__).resolve().parent / "tests" / "data" / "coco4"


class ExportMismatch(UserError):
    """The exported file's maps differ from PyTorch's beyond the tolerance."""

    exit_code = 1


def build_parser() -> ArgumentParser:
    p = weights_options(__doc__, "checkpoint of this trainer or bare state dict",
                        preset_help=" (default: imhn512)",
                        set_example="inference.flip=true (stored in the file)", decoding=False)
    p.add_argument("--format", default="onnx", help="what to write: onnx (the only one so far)")
    p.add_argument("--out", required=True, help="the file to write (an existing one only with --overwrite)")
    p.add_argument("--opset", type=int, default=17,
                   help=f"ONNX opset, {MIN_OPSET} to {max_opset()} with this torch (default 17)")
    p.add_argument("--check-images", default=str(CHECK_PICTURES),
                   help="folder of .jpg/.png pictures to compare the maps on (default: tests/data/coco4)")
    p.add_argument("--tolerance", type=float, default=1e-4,
                   help="largest map difference allowed, as a share (0 to 1) of the maps' largest magnitude")
    return p


def max_opset() -> int:
    """The newest opset this torch's ONNX exporter writes."""
    from torch.onnx import _constants
    return int(getattr(_constants, "ONNX_MAX_OPSET", 20))


class LastStackMaps(torch.nn.Module):
    """The model with one output: the last stack's stride-4 maps."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return self.model(batch)[-1][0]


def write_onnx(model: torch.nn.Module, cfg, path: Path, opset: int) -> None:
    """The network as ONNX at `path` with dynamic batch and size, the config in its metadata."""
    onnx = need("onnx")
    network = LastStackMaps(model).eval()        # export restores this mode afterwards
    size = cfg.data.input_size
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # the TorchScript exporter's deprecation notice
        torch.onnx.export(network, (torch.zeros(1, 3, size, size),), str(path), dynamo=False,
                          input_names=[INPUT_NAME], output_names=[OUTPUT_NAME], opset_version=opset,
                          dynamic_axes={INPUT_NAME: {0: "batch", 2: "height", 3: "width"},
                                        OUTPUT_NAME: {0: "batch", 2: "height_4", 3: "width_4"}})
    graph = onnx.load(str(path))
    for key, value in ((CONFIG_KEY, json.dumps(to_dict(cfg))),
                       (KEYPOINTS_KEY, json.dumps(list(model.skeleton.keypoints))),
                       (SKELETON_KEY, json.dumps(model.skeleton.to_spec()))):
        graph.metadata_props.add(key=key, value=value)
    onnx.save(graph, str(path))


def compare_maps(model, cfg, path: Path, pictures: list[Path], tolerance: float, name: Path) -> list[float]:
    """Relative map differences ONNX (`path`) vs PyTorch per picture; ExportMismatch beyond `tolerance`."""
    exported, reference = OnnxNetwork(path), TorchNetwork(model)
    errors = []
    for picture_path in pictures:
        resized = resize_for_scale(read_picture(picture_path), 1.0, cfg.data.input_size)
        batch = pictures_to_batch([resized], padded_size(*resized.shape[:2], reference.size_multiple),
                                  torch.device("cpu"))
        want, got = reference(batch).numpy(), exported(batch).numpy()
        error = float(np.abs(got - want).max() / max(float(np.abs(want).max()), 1e-30))
        print(f"{picture_path.name} {tuple(batch.shape[2:])}: max |onnx - torch| = {error:.2e} of the "
              f"largest map value", flush=True)
        if not error <= tolerance:
            raise ExportMismatch(f"{name}: onnxruntime's maps of {picture_path} differ from PyTorch's by "
                                 f"{error:.2e} of their largest value (tolerance {tolerance:g}); "
                                 "the file was not written")
        errors.append(error)
    return errors


def run(args) -> Path:
    if args.format not in FORMATS:
        raise ConfigError(f"--format {args.format}: unknown format; this exporter writes "
                          f"{', '.join(FORMATS)}")
    if not MIN_OPSET <= args.opset <= max_opset():
        raise ConfigError(f"--opset {args.opset}: this export needs an opset from {MIN_OPSET} to "
                          f"{max_opset()} (torch {torch.__version__} writes up to {max_opset()})")
    if not 0 <= args.tolerance <= 1:        # beyond 1, maps of any value pass: no check at all
        raise ConfigError(f"--tolerance {args.tolerance}: must be from 0 to 1 (a share of the maps' "
                          "largest magnitude)")
    out, folder = Path(args.out), Path(args.check_images)
    pictures = sorted(p for p in folder.glob("*") if p.suffix.lower() in (".jpg", ".jpeg", ".png")) \
        if folder.is_dir() else []
    if not pictures:
        raise DataError(f"--check-images {folder}: no .jpg or .png pictures there to check the export on")
    refuse_clashes({"--weights": args.weights, "--check-images": pictures, "--preset": args.preset},
                   {"--out": out})
    refuse_existing("--out", out, args.overwrite)
    estimator = PoseEstimator.from_checkpoint(args.weights, "cpu", args.preset, args.set)
    model, cfg = estimator.network.model, estimator.config
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with written_whole(out, args.overwrite) as temp:
            write_onnx(model, cfg, temp, args.opset)
            errors = compare_maps(model, cfg, temp, pictures, args.tolerance, out)
    except OSError as exc:           # the output side: folder not writable, disk full, ...
        raise DataError(f"--out {out}: cannot write the file there ({chained_os_reason(exc)}); "
                        "nothing was written") from None
    print(f"written {out} ({out.stat().st_size / 2 ** 20:.1f} MiB): onnxruntime's maps agree with "
          f"PyTorch's on {len(errors)} pictures within {max(errors):.1e} of their largest value "
          f"(tolerance {args.tolerance:g})", flush=True)
    return out


main = command_main(build_parser, run, "the ONNX file was not written (its partial copy is removed); an "
                    "existing --out is as it was")


if __name__ == "__main__":
    sys.exit(main())
