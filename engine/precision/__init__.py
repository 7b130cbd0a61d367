"""A run's mixed precision, in one package: the interface every precision backend implements
(`interface.PrecisionBackend`), the native (torch.amp) and Apex implementations side by side
(`native`, `apex` with `apex_checks` and `apex_parallel`), the loss scaler's state in either
layout (`loss_scale`), the registry by name (`registry`, `amp.backend`), and the process-wide CUDA
switches (`cuda_switches`).
"""
from engine.precision.cuda_switches import cudnn_autotuning_off, set_cuda_backends
from engine.precision.interface import PrecisionBackend, StepDecision, live_state_dict
from engine.precision.native import NativePrecision
from engine.precision.registry import (BACKENDS, build_precision, check_backend, convert_sync_bn,
                                       wrap_ddp)
from engine.precision.apex_checks import check_data_parallel

__all__ = ["BACKENDS", "NativePrecision", "PrecisionBackend", "StepDecision", "build_precision",
           "check_backend", "check_data_parallel", "convert_sync_bn", "cudnn_autotuning_off",
           "live_state_dict", "set_cuda_backends", "wrap_ddp"]
