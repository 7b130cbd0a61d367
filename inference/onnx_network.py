"""An ONNX file written by export.py (its config and skeleton in its metadata), run by onnxruntime as a
network of `inference.predict`."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from common.errors import CheckpointError, ConfigError
from config.loader import input_multiple
from config.schema import Config
from data.skeleton import from_checkpoint

CONFIG_KEY = "simplepose.config"          # the checkpoint's config, JSON
KEYPOINTS_KEY = "simplepose.keypoints"    # names of the keypoint rows, JSON (for other runtimes)
SKELETON_KEY = "simplepose.skeleton"      # `data.skeleton.Skeleton.to_spec()`, JSON
INPUT_NAME, OUTPUT_NAME = "input", "maps"


def need(module: str):
    """Import an optional export dependency, or ConfigError saying how to install it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"ONNX files need the optional package {module}: "
                          "pip install -r requirements-export.txt") from None


class OnnxNetwork:
    """`path` in an onnxruntime session (CUDA when onnxruntime has it, else CPU)."""

    def __init__(self, path):
        ort = need("onnxruntime")
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: no such file")
        providers = [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider")
                     if p in ort.get_available_providers()]
        try:
            self.session = ort.InferenceSession(str(self.path), providers=providers)
        except Exception as exc:          # onnxruntime's errors have no common base class
            reason = str(exc).strip().splitlines()[0][:160]
            raise CheckpointError(f"{self.path} is not an ONNX file onnxruntime can run ({reason})") from None
        self.metadata = self.session.get_modelmeta().custom_metadata_map
        if CONFIG_KEY not in self.metadata:
            raise CheckpointError(f"{self.path} is an ONNX file but not one written by export.py "
                                  f"(no {CONFIG_KEY} in its metadata)")
        self.device = torch.device("cpu")        # where the input batch is made
        spec = self.metadata.get(SKELETON_KEY)
        self.skeleton = from_checkpoint({"skeleton": json.loads(spec)} if spec else None)
        self.size_multiple = input_multiple(self.config().model.depth)

    def config(self, sets=(), scales=None, flip: bool | None = None) -> Config:
        """The config stored in the file, with `sets`, `scales` and `flip` applied on top."""
        from inference.loading import inference_config

        return inference_config(json.loads(self.metadata[CONFIG_KEY]), None, list(sets), scales, flip)

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        maps = self.session.run([OUTPUT_NAME], {INPUT_NAME: batch.detach().cpu().contiguous().numpy()})[0]
        return torch.from_numpy(maps)
