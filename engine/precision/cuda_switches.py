"""Process-wide CUDA switches of a training run (no effect on CPU), whatever its precision backend."""
from __future__ import annotations

import contextlib

import torch

from config.schema import AmpConfig


def set_cuda_backends(cfg: AmpConfig, cudnn_benchmark: bool) -> None:
    """TF32 for float32 convolutions and matmuls (PyTorch's own default is on for convolutions, off
    for matmuls), and cuDNN autotuning, which pays off because every training batch has the same
    shape."""
    torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
    torch.backends.cudnn.allow_tf32 = cfg.tf32
    torch.backends.cudnn.benchmark = cudnn_benchmark


@contextlib.contextmanager
def cudnn_autotuning_off():
    """For evaluation inside a training run: images of many sizes would each be autotuned anew."""
    previous = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = previous
