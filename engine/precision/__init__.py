"""A run's mixed precision: the backends by name (`amp.backend`) and the process-wide CUDA switches."""
from __future__ import annotations

import contextlib

import torch

from config.schema import AmpConfig, Config
from engine.precision.apex import ApexPrecision
from engine.precision.apex_checks import check_data_parallel
from engine.precision.interface import PrecisionBackend, live_state_dict
from engine.precision.native import NativePrecision

__all__ = ["BACKENDS", "NativePrecision", "PrecisionBackend", "build_precision", "check_backend",
           "check_data_parallel", "cudnn_autotuning_off", "live_state_dict"]

BACKENDS: dict[str, type[PrecisionBackend]] = {cls.name: cls for cls in (NativePrecision, ApexPrecision)}


def check_backend(cfg: Config) -> None:
    """A one-line ConfigError where the run's backend cannot run `cfg`, before anything is built."""
    BACKENDS[cfg.amp.backend].check(cfg)


def build_precision(cfg: AmpConfig, device: torch.device, cudnn_benchmark: bool = False) -> PrecisionBackend:
    """The run's precision backend, TF32 and cuDNN autotuning set process-wide (no effect on CPU)."""
    torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
    torch.backends.cudnn.allow_tf32 = cfg.tf32
    torch.backends.cudnn.benchmark = cudnn_benchmark
    return BACKENDS[cfg.backend].create(cfg, device)


@contextlib.contextmanager
def cudnn_autotuning_off():
    """For evaluation inside a training run: images of many sizes would each be autotuned anew."""
    previous = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = previous
