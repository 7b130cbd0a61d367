"""The `apex` precision backend: NVIDIA Apex's own amp (25.04 and older; never a dependency); an
overflow Apex found shows as non-finite gradients, so the engine's skip vote agrees with it."""
from __future__ import annotations

import importlib

import torch
from torch import nn

from config.schema import AmpConfig
from engine.precision import apex_checks
from engine.precision.interface import PrecisionBackend
from engine.precision.loss_scale import apex_amp_state


class ApexPrecision(PrecisionBackend):
    """The backend on Apex's amp (float16, CUDA only); the base's `prepare_model`, `cast_input` and
    `autocast_context` suffice: amp.initialize casts the model, its forward the input (O1: torch's)."""
    name = "apex"

    def __init__(self, cfg: AmpConfig, device: torch.device):
        super().__init__(cfg, device)
        self.amp = importlib.import_module("apex.amp")
        self.build = apex_checks.apex_build()
        self.init_scale = cfg.init_scale
        self.dynamic = self.level != "O0" and self.static_scale is None
        self.fixed_scale = None if self.level == "O0" else self.static_scale
        self._optimizer, self._attached = None, False
        self._apex_skips = False        # Apex found an overflow and patched this step into a skip
        self._state_before = {}         # Apex's amp state before this step's unscale
        self._zero = torch.zeros((), device=device)

    @classmethod
    def check(cls, cfg) -> None:
        apex_checks.check_apex_options(cfg)
        super().check(cfg)

    @classmethod
    def half_dtype(cls, amp: AmpConfig, device) -> torch.dtype:
        """Apex's amp casts to float16 only (bfloat16 is refused by `check`)."""
        return torch.float16

    @classmethod
    def create(cls, cfg: AmpConfig, device: torch.device) -> "ApexPrecision":
        """Checked again here for callers that did not come through `check` (bench scripts)."""
        apex_checks.check_installed(device.type)
        return cls(cfg, device)

    def describe(self) -> str:
        text = f"Apex amp {self.level}"
        if self.level != "O0":
            text += {"O1": ", torch functions patched to float16",
                     "O2": ", model in float16, float32 master weights",
                     "O3": ", model in float16"}[self.level]
            if self.cast_model:
                text += ", BatchNorm in float32" if self.keep_bn_fp32 else ", BatchNorm in float16"
            text += (f", dynamic loss scale from {self.init_scale:g}" if self.dynamic
                     else f", loss scale {self.static_scale:g}")
        text += ", channels_last" if self.channels_last else ""
        gradients = len(list(self.amp.master_params(self._optimizer))) if self._attached else None
        return f"{text}; {self.build.describe(gradients)}"

    def optimizer_params(self, trainable: list[nn.Parameter]) -> list[nn.Parameter]:
        return list(self.amp.master_params(self._optimizer)) if self._attached else trainable

    def attach(self, model: nn.Module, optimizer):
        # masters start from the float32 values, not Apex's copy of the float16 model
        exact = ({id(p): p.detach().clone() for p in model.parameters() if p.requires_grad}
                 if self.master_weights else {})
        loss_scale = None if self.level == "O0" else ("dynamic" if self.dynamic else self.static_scale)
        model, optimizer = self.amp.initialize(
            model, optimizer, opt_level=self.level, loss_scale=loss_scale, verbosity=0,
            keep_batchnorm_fp32=self.keep_bn_fp32 if self.cast_model else None)
        if self.dynamic:          # Apex starts at 2**16; the run's config says where to start
            self.amp.load_state_dict({"loss_scaler0": {"loss_scale": float(self.init_scale), "unskipped": 0}})
        if self.master_weights:
            # Apex makes its masters lazily: zero_grad makes them now, in the optimiser's order
            halves = list(self.amp.master_params(optimizer))
            optimizer.zero_grad()
            self._pairs = list(zip(halves, self.amp.master_params(optimizer)))
            with torch.no_grad():
                for half, master in self._pairs:
                    if master is not half and id(half) in exact:
                        master.copy_(exact[id(half)])
        self._optimizer, self._attached = optimizer, True
        return model, optimizer

    def backward(self, loss: torch.Tensor) -> None:
        with self.amp.scale_loss(loss, self._optimizer, delay_unscale=True) as scaled:
            scaled.backward()

    def unscale_(self, optimizer) -> None:
        """Unscale (Apex's scale_loss exit); an overflow Apex found shows as non-finite gradients."""
        self._state_before = dict(self.amp.state_dict())
        before = self._scale()
        with self.amp.scale_loss(self._zero, optimizer):
            pass
        self._apex_skips = self.dynamic and self._scale() < before
        if self._apex_skips:
            with torch.no_grad():
                for param in self.amp.master_params(optimizer):
                    if param.grad is not None:
                        param.grad.fill_(float("nan"))

    def _scale(self) -> float:
        state = self.amp.state_dict().get("loss_scaler0")
        return float(state["loss_scale"]) if state else 1.0

    def step(self, optimizer, grads_finite: bool, bad_loss: bool = False) -> None:
        """Apex's step or (after an overflow) its skip; after a bad loss the scale is put back."""
        if grads_finite or self._apex_skips:
            optimizer.step()
        if bad_loss and self.dynamic and self._state_before:
            self.amp.load_state_dict(self._state_before)
        self._apex_skips = False

    def state_dict(self) -> dict:
        """Apex's amp state; empty at O0 (no scaling), as the native backend saves it."""
        return {} if self.level == "O0" else dict(self.amp.state_dict())

    def load_state_dict(self, state: dict) -> None:
        """A saved scaler state of either backend; a static scale keeps the config's value."""
        state = apex_amp_state(state)
        if state and self.dynamic:
            self.amp.load_state_dict(state)
