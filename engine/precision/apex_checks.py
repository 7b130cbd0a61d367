"""What the apex backend needs, checked in one line each before anything is built, and which Apex
build is installed (`apex_build`)."""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import pkgutil
from dataclasses import dataclass

import torch

from common.errors import ConfigError
from config.schema import AmpConfig, Config
from runtime.environment import APEX_EXTENSIONS, installed_version

LAST_APEX_WITH_AMP = "25.04"

# what Apex 25.04's amp and parallel use of torch (read from its source), as (object, attribute)
APEX_TORCH_NEEDS = (
    ("torch.cuda", "IntTensor"),                      # amp's LossScaler: its overflow flag
    ("torch.nn.Module", "_register_state_dict_hook"),  # O2: float32 state dicts of a half model
    ("torch.nn.modules.rnn", "_VF"),                  # O1: its RNN shim replaces this
    ("torch.autograd.Variable", "_execution_engine"),  # apex.parallel DDP: end-of-backward callback
    ("torch._utils", "_flatten_dense_tensors"),       # apex.parallel DDP: all-reduce buckets
)


@dataclass(frozen=True)
class ApexBuild:
    where: str                  # "Apex 25.04 at PATH" or "the Apex at PATH"
    extensions: tuple           # the compiled extensions that import

    def describe(self, gradient_tensors: int | None = None) -> str:
        """One line: the build, and what a Python-only one costs."""
        if len(self.extensions) == len(APEX_EXTENSIONS):
            return f"{self.where}, with its CUDA extensions ({', '.join(self.extensions)})"
        missing = [name for name in APEX_EXTENSIONS if name not in self.extensions]
        syncs = (f"{gradient_tensors} host syncs per step here" if gradient_tensors
                 else "one host sync per gradient tensor per step")
        kind = "Python-only" if not self.extensions else "partial"
        return (f"{self.where}, {kind} build (no {', '.join(missing)}): its loss scaler reads every "
                f"gradient on the host ({syncs}), SyncBN and DDP run Python fallbacks; figures of "
                "this build are not those of Apex built with --cpp_ext --cuda_ext")


def apex_build() -> ApexBuild:
    """The installed Apex's location and which of its compiled extensions import."""
    present = []
    for name in APEX_EXTENSIONS:
        with contextlib.suppress(Exception):  # noqa: BLE001 - absent, or built for another torch/CUDA
            importlib.import_module(name)
            present.append(name)
    return ApexBuild(_apex_where(), tuple(present))


def check_apex_options(cfg: Config) -> None:
    """ConfigError (one line) where `--amp-backend apex` cannot run `cfg`."""
    amp = cfg.amp
    if amp.opt_level != "O0" and amp.dtype == "bfloat16":
        raise ConfigError("--amp-backend apex with --amp-dtype bfloat16: Apex's amp casts to float16 "
                          "only; use --amp-dtype float16 (or auto), or --amp-backend native for bfloat16")
    if amp.compile:
        raise ConfigError("--amp-backend apex with --compile: Apex's amp works by monkey-patching torch's "
                          "functions (O1) and the model's forward (O2/O3) at run time and makes no "
                          "provision for torch.compile; compile with --amp-backend native")
    if cfg.dist.zero and amp.opt_level in ("O2", "O3"):
        raise ConfigError(f"--amp-backend apex with --zero at {amp.opt_level}: amp.initialize reloads the "
                          "optimiser's state_dict() to cast it, which ZeroRedundancyOptimizer refuses before "
                          "consolidate_state_dict (and O2's float32 master copies would replace parameters "
                          "its sharded inner optimiser steps); drop --zero, use O1, or --amp-backend native")
    check_installed(cfg.train.device)


def check_installed(device: str) -> None:
    """ConfigError unless an Apex with amp imports, can patch this PyTorch, and CUDA is there."""
    if importlib.util.find_spec("apex") is None:
        raise ConfigError(f"--amp-backend apex: Apex is not installed (import apex fails); install "
                          f"NVIDIA Apex {LAST_APEX_WITH_AMP} or older (the last with apex.amp), e.g. from "
                          "an NGC PyTorch container before 25.07, or use --amp-backend native")
    try:
        importlib.import_module("apex")
        has_amp = all(importlib.util.find_spec(f"apex.{name}") is not None for name in ("amp", "parallel"))
    except Exception as exc:                 # noqa: BLE001 - whatever this Apex raises on import
        first = (str(exc).splitlines() or [""])[0]
        raise ConfigError(f"--amp-backend apex: {_apex_where()} does not import with PyTorch "
                          f"{torch.__version__} ({type(exc).__name__}: {first}); use --amp-backend "
                          "native") from None
    if not has_amp:
        raise ConfigError(f"--amp-backend apex: {_apex_where()} has no apex.amp / apex.parallel: NVIDIA "
                          f"removed them in Apex 25.07; {LAST_APEX_WITH_AMP} is the last release that has "
                          "them. Install that one, or use --amp-backend native (torch.amp)")
    if missing := missing_torch_apis():
        raise ConfigError(f"--amp-backend apex: Apex {LAST_APEX_WITH_AMP}'s amp cannot patch PyTorch "
                          f"{torch.__version__}: it needs {', '.join(missing)}, which this PyTorch lacks; "
                          "use --amp-backend native")
    _check_cuda(device)


def check_data_parallel(amp: AmpConfig, gpus: int) -> None:
    """train_parallel.py over `gpus` GPUs: refused under Apex's O2/O3 (see the module's doc)."""
    if amp.backend == "apex" and gpus > 1 and amp.opt_level in ("O2", "O3"):
        raise ConfigError(f"--amp-backend apex with --opt-level {amp.opt_level} under DataParallel "
                          f"over {gpus} GPUs: amp.initialize patches the model's forward, and every "
                          "replica would run that patch, i.e. the original module on the first GPU; "
                          "use one process per GPU (torchrun train_distributed.py), as the reference did")


def _apex_where() -> str:
    spec = importlib.util.find_spec("apex")
    locations = list(spec.submodule_search_locations or []) if spec else []
    where = locations[0] if locations else (spec.origin if spec else "?")
    version = installed_version("apex")      # None: a source checkout on PYTHONPATH, no package metadata
    return f"Apex {version} at {where}" if version else f"the Apex at {where}"


def missing_torch_apis() -> list[str]:
    missing = []
    for owner, attr in APEX_TORCH_NEEDS:
        try:
            if not hasattr(pkgutil.resolve_name(owner), attr):
                missing.append(f"{owner}.{attr}")
        except (ImportError, AttributeError):
            missing.append(owner)
    return missing


def _check_cuda(device: str) -> None:
    if device == "cpu" or not torch.cuda.is_available():
        where = "--device cpu" if device == "cpu" else "no CUDA device is available"
        raise ConfigError(f"--amp-backend apex: Apex's amp runs on CUDA only (its loss scaler is a "
                          f"torch.cuda.IntTensor and amp.initialize refuses parameters off the GPU), "
                          f"and {where}; use --amp-backend native")
