"""The precision backends by name (`amp.backend`), and the functions the engine and the entry
scripts call without knowing which backend a run uses: each looks the backend up here and asks it.
"""
from __future__ import annotations

import torch
from torch import nn

from config.schema import AmpConfig, Config, DistConfig
from engine.precision.apex import ApexPrecision
from engine.precision.cuda_switches import set_cuda_backends
from engine.precision.interface import PrecisionBackend
from engine.precision.native import NativePrecision

BACKENDS: dict[str, type[PrecisionBackend]] = {cls.name: cls for cls in (NativePrecision, ApexPrecision)}


def backend_class(amp: AmpConfig) -> type[PrecisionBackend]:
    return BACKENDS[amp.backend]


def check_backend(cfg: Config) -> None:
    """A one-line ConfigError where the run's backend cannot run `cfg`, before anything is built."""
    backend_class(cfg.amp).check(cfg)


def build_precision(cfg: AmpConfig, device: torch.device, cudnn_benchmark: bool = False) -> PrecisionBackend:
    """The run's precision backend, with the process-wide CUDA switches set."""
    set_cuda_backends(cfg, cudnn_benchmark)
    return backend_class(cfg).create(cfg, device)


def convert_sync_bn(model: nn.Module, ctx, amp: AmpConfig) -> nn.Module:
    """`--sync-bn` with the run's backend (unchanged when not distributed)."""
    return backend_class(amp).convert_sync_bn(model, ctx, amp) if ctx.distributed else model


def wrap_ddp(model: nn.Module, ctx, amp: AmpConfig, dist: DistConfig) -> nn.Module:
    """train_distributed.py's wrapper: the backend's DDP with the options of `dist`; the model
    itself without a group."""
    return backend_class(amp).wrap_ddp(model, ctx, dist) if ctx.distributed else model
