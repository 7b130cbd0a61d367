"""What a precision backend must do (`PrecisionBackend`), and what every backend shares, in the
order the engine calls it (`engine.optim.OptimStep` sequences `unscale_`, `step`, `zero_grad`)."""
from __future__ import annotations

import abc
import contextlib

import torch
from torch import nn

from common.errors import ConfigError
from config.schema import AmpConfig
from runtime.launch_env import device_kind


def live_state_dict(model: nn.Module) -> dict:
    """`model.state_dict()`'s keys with the module's own tensors (detached), no state-dict hook
    run: Apex's O2/O3 hook copies every half tensor to float32, seconds per call on imhn512."""
    state = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for name, tensor in [*module._parameters.items(), *module._buffers.items()]:   # names never shared
            if tensor is not None and name not in module._non_persistent_buffers_set:
                state.setdefault(dot + name, tensor.detach())
    return state


class PrecisionBackend(abc.ABC):
    """One run's mixed precision."""
    name: str = ""
    dynamic: bool = False     # a dynamic loss scale: an overflow halves it and skips the step
    fixed_scale: float | None = None    # a fixed loss scale in use (--loss-scale NUMBER, float16)

    def __init__(self, cfg: AmpConfig, device: torch.device):
        self.level = cfg.opt_level
        self.dtype = torch.float32 if self.level == "O0" else self.half_dtype(cfg, device)
        self.device_type = device.type
        self.cast_model, self.master_weights = self.level in ("O2", "O3"), self.level == "O2"
        keep = cfg.keep_batchnorm_fp32
        self.keep_bn_fp32 = self.master_weights if keep is None else bool(keep)
        auto = cfg.channels_last == "auto"      # on for CUDA (measured faster there), off elsewhere
        self.channels_last = device.type == "cuda" if auto else bool(cfg.channels_last)
        self.static_scale = None if cfg.loss_scale == "dynamic" else float(cfg.loss_scale)
        self._frozen_float32: dict[int, torch.Tensor] = {}   # id(frozen param) -> its float32 value
        self._pairs: list[tuple[nn.Parameter, nn.Parameter]] = []   # (model param, its O2 master)

    # -- before anything is built ------------------------------------------------------------------
    @classmethod
    def check(cls, cfg) -> None:
        """Raise a one-line ConfigError where this backend cannot run `cfg`."""
        if (cfg.amp.opt_level == "O3" and cfg.optim.name == "adamw"
                and cls.half_dtype(cfg.amp, cfg.train.device) == torch.float16):
            raise ConfigError("--opt-level O3 with --optimizer adamw in float16: AdamW's moments and "
                              "its eps (1e-8 is 0 in float16) in half precision turn the weights into "
                              "NaN at the first step; use --opt-level O2 (float32 master weights), "
                              "--optimizer sgd, or --amp-dtype bfloat16")

    @classmethod
    def half_dtype(cls, amp: AmpConfig, device: str | torch.device) -> torch.dtype:
        """The half type on `device`; "auto": float16 on CUDA, else bfloat16."""
        if amp.dtype != "auto":
            return getattr(torch, amp.dtype)
        kind = device.type if isinstance(device, torch.device) else device_kind(device)
        return torch.float16 if kind == "cuda" else torch.bfloat16

    @classmethod
    def create(cls, cfg: AmpConfig, device: torch.device) -> "PrecisionBackend":
        return cls(cfg, device)

    # -- model and optimiser -----------------------------------------------------------------------
    @abc.abstractmethod
    def describe(self) -> str:
        """One line for the run's start."""

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """The (loaded, frozen) model as it trains in this precision: here its memory format, and
        under master weights frozen weights' float32 values kept (a half copy loses up to 1e-4)."""
        if self.channels_last:
            model = model.to(memory_format=torch.channels_last)
        if self.master_weights:
            self._frozen_float32 = {id(p): p.detach().clone().float()
                                    for p in model.parameters() if not p.requires_grad}
        return model

    @abc.abstractmethod
    def optimizer_params(self, trainable: list[nn.Parameter]) -> list[nn.Parameter]:
        """What the optimiser steps (float32 master copies where the backend keeps them)."""

    def attach(self, model: nn.Module, optimizer):
        """Once the optimiser exists, before any wrapper: (model, optimizer), changed or not."""
        return model, optimizer

    # -- every batch ---------------------------------------------------------------------------------
    def cast_input(self, images: torch.Tensor) -> torch.Tensor:
        """The images as the prepared model takes them."""
        return images.contiguous(memory_format=torch.channels_last) if self.channels_last else images

    def autocast_context(self):
        return contextlib.nullcontext()

    @abc.abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Backward of `loss` through the loss scaler; gradients accumulate until `zero_grad`."""

    # -- every step ----------------------------------------------------------------------------------
    @abc.abstractmethod
    def unscale_(self, optimizer) -> None:
        """The accumulated gradients in true scale (an overflow shows as non-finite)."""

    @abc.abstractmethod
    def step(self, optimizer, grads_finite: bool, bad_loss: bool = False) -> None:
        """Step (or skip) and update the loss scale, except after a bad loss."""

    def zero_grad(self, optimizer) -> None:
        """Every gradient the step used, freed (Apex's optimiser under O2: model and master ones)."""
        optimizer.zero_grad()

    # -- checkpoints and the EMA -----------------------------------------------------------------
    def weight_sources(self, model: nn.Module) -> dict:
        """The model's state dict as live tensors, float32 where the backend keeps them (O2's
        masters, frozen weights), nothing copied; the EMA reads these after every step."""
        by_id = {id(p): name for name, p in model.named_parameters()}
        state = live_state_dict(model)
        for pid, tensor in ({id(p): m for p, m in self._pairs} | self._frozen_float32).items():
            if pid in by_id:
                state[by_id[pid]] = tensor.detach()
        return state

    def float32_state_dict(self, model: nn.Module) -> dict:
        """The model's weights in float32, loadable in any mode and either backend."""
        return {k: (v.float() if v.is_floating_point() else v).clone()
                for k, v in self.weight_sources(model).items()}

    @abc.abstractmethod
    def state_dict(self) -> dict:
        """The loss scaler's state for a checkpoint."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict) -> None:
        """A saved loss scaler state of either backend (`engine.precision.loss_scale`)."""
