"""What a precision backend must do (`PrecisionBackend`), and what every backend shares.

The engine talks to the precision of a run only through this interface, whichever backend
(`amp.backend`, `engine.precision.BACKENDS`) implements it:

- before training: `check` (one-line refusals of what the backend cannot run, before anything
  is built), `prepare_model` (cast, memory format), `optimizer_params` (what the optimiser
  steps), `attach` (once the optimiser exists);
- every batch: `cast_input`, `autocast_context`, `backward` (through the loss scaler);
- every step, in this order (`engine.optim_step.OptimStep` sequences them and decides between
  them): `unscale_` the accumulated gradients, `step` (or skip) and update the loss scale,
  `zero_grad`;
- checkpoints and the EMA: `weight_sources` (live float32 sources of the weights),
  `float32_state_dict`, and the loss scaler's `state_dict` / `load_state_dict`
  (`engine.precision.loss_scale` maps either backend's layout onto the other).

`live_state_dict` gives a model's state dict as its own tensors without calling
`Module.state_dict()`: Apex's O2/O3 registers a hook on every module that makes `state_dict()`
return float32 copies of the half tensors (dead copies for an EMA, and quadratic in the number of
modules: seconds per call on imhn512).
"""
from __future__ import annotations

import abc

import torch
from torch import nn

from common.errors import ConfigError
from config.schema import AmpConfig
from runtime.launch_env import device_kind


def live_state_dict(model: nn.Module) -> dict:
    """`model.state_dict(keep_vars=True)`'s keys and the module's own tensors (detached views of
    the same storage), without running any state-dict hook."""
    state = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for name, param in module._parameters.items():
            if param is not None:
                state.setdefault(dot + name, param.detach())
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                state.setdefault(dot + name, buf.detach())
    return state


class PrecisionBackend(abc.ABC):
    """One run's mixed precision: see the module's doc for the order in which the engine calls it."""

    name: str = ""
    dynamic: bool = False     # a dynamic loss scale: an overflow halves it and skips the step

    def __init__(self, cfg: AmpConfig, device: torch.device):
        """The settings both backends read from `amp` the same way."""
        self.level = cfg.opt_level
        self.device_type = device.type
        self.cast_model = self.level in ("O2", "O3")
        keep = cfg.keep_batchnorm_fp32
        self.keep_bn_fp32 = (self.level == "O2") if keep is None else bool(keep)
        self.master_weights = self.level == "O2"
        self.channels_last = channels_last_for(cfg, device)
        self.static_scale = None if cfg.loss_scale == "dynamic" else float(cfg.loss_scale)
        self._frozen_float32: dict[int, torch.Tensor] = {}   # id(frozen param) -> its float32 value
        self._pairs: list[tuple[nn.Parameter, nn.Parameter]] = []   # (model param, its O2 master)

    def _keep_frozen_float32(self, model: nn.Module) -> None:
        """Frozen weights keep their float32 values for the checkpoint: a half copy saved as float32
        would lose up to 1e-4 per fine-tune, compounding over chained ones."""
        self._frozen_float32 = {id(p): p.detach().clone().float()
                                for p in model.parameters() if not p.requires_grad}

    # -- before anything is built ------------------------------------------------------------------
    @classmethod
    def check(cls, cfg) -> None:
        """Raise a one-line ConfigError where this backend cannot run `cfg`: pure float16 (O3)
        with AdamW, whose moments and eps (1e-8 is 0 in float16) make the weights NaN at the first
        step. A subclass adds its own refusals."""
        if (cfg.amp.opt_level == "O3" and cfg.optim.name == "adamw"
                and cls.half_dtype(cfg.amp, cfg.train.device) == torch.float16):
            raise ConfigError("--opt-level O3 with --optimizer adamw in float16: AdamW's moments and "
                              "its eps (1e-8 is 0 in float16) in half precision turn the weights into "
                              "NaN at the first step; use --opt-level O2 (float32 master weights), "
                              "--optimizer sgd, or --amp-dtype bfloat16")

    @classmethod
    def half_dtype(cls, amp: AmpConfig, device: str | torch.device) -> torch.dtype:
        """The half type of O1-O3 on `device` (a torch.device, or a `--device` value): `amp.dtype`,
        or for "auto" float16 on CUDA and bfloat16 elsewhere."""
        if amp.dtype != "auto":
            return getattr(torch, amp.dtype)
        kind = device.type if isinstance(device, torch.device) else device_kind(device)
        return torch.float16 if kind == "cuda" else torch.bfloat16

    @classmethod
    def create(cls, cfg: AmpConfig, device: torch.device) -> "PrecisionBackend":
        """The backend object of a run on `device`."""
        return cls(cfg, device)

    # -- model and optimiser -----------------------------------------------------------------------
    @abc.abstractmethod
    def describe(self) -> str:
        """One line for the run's start."""

    @abc.abstractmethod
    def prepare_model(self, model: nn.Module) -> nn.Module:
        """The (loaded, frozen) model as it trains in this precision."""

    @abc.abstractmethod
    def optimizer_params(self, trainable: list[nn.Parameter]) -> list[nn.Parameter]:
        """What the optimiser steps (float32 master copies where the backend keeps them)."""

    def attach(self, model: nn.Module, optimizer):
        """Once the optimiser exists, before any wrapper: (model, optimizer), changed or not."""
        return model, optimizer

    # -- every batch ---------------------------------------------------------------------------------
    @abc.abstractmethod
    def cast_input(self, images: torch.Tensor) -> torch.Tensor:
        """The images as the prepared model takes them."""

    @abc.abstractmethod
    def autocast_context(self):
        """The context of the forward pass."""

    @abc.abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Backward of `loss` through the loss scaler; gradients accumulate until `zero_grad`."""

    # -- every step ----------------------------------------------------------------------------------
    @abc.abstractmethod
    def unscale_(self, optimizer) -> None:
        """The accumulated gradients of the optimiser's parameters in true scale (overflow made
        visible to the engine as non-finite gradients)."""

    @abc.abstractmethod
    def step(self, optimizer, grads_finite: bool, bad_loss: bool = False) -> None:
        """Step (or skip) and update the loss scale, except after a bad loss."""

    @abc.abstractmethod
    def zero_grad(self, optimizer) -> None:
        """Every gradient the step used, freed."""

    # -- checkpoints and the EMA -----------------------------------------------------------------
    def weight_sources(self, model: nn.Module) -> dict:
        """The model's state dict as live tensors holding the float32 values where the backend
        keeps them, nothing copied: O2's master copies and frozen weights' float32 values, the
        model's own tensors otherwise (half under O3; never `model.state_dict()`, which Apex's O2
        hook copies). A weights EMA reads these after every step."""
        return sources_with_masters(model, {id(p): m for p, m in self._pairs} | self._frozen_float32)

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


def channels_last_for(cfg: AmpConfig, device: torch.device) -> bool:
    """`amp.channels_last` resolved: "auto" is on for CUDA (measured faster there), off elsewhere."""
    return (device.type == "cuda") if cfg.channels_last == "auto" else bool(cfg.channels_last)


def sources_with_masters(model: nn.Module, float32_by_param: dict) -> dict:
    """`live_state_dict(model)` with each parameter whose id is in `float32_by_param` replaced by
    that float32 tensor (O2's masters, frozen weights' float32 values)."""
    by_id = {id(p): name for name, p in model.named_parameters()}
    state = live_state_dict(model)
    for pid, tensor in float32_by_param.items():
        if pid in by_id:
            state[by_id[pid]] = tensor.detach()
    return state
