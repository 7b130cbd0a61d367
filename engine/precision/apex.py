"""The `apex` precision backend (`--amp-backend apex`): NVIDIA Apex's own amp (its DDP and SyncBN
are engine.parallel's).

What the reference ran, for users whose Apex still has `amp` (25.04 and older; checked by
`engine.precision.apex_checks` before anything is built). `ApexPrecision` implements
`engine.precision.interface.PrecisionBackend`, as the native backend does, so the engine's step
is the same code for both:

- `attach`: `amp.initialize(model, optimizer, opt_level, keep_batchnorm_fp32, loss_scale)`. Apex
  casts the model itself (O2/O3) and patches its forward to cast inputs to float16 and outputs
  to float32; under O1 it patches torch's functions. A dynamic scale starts at `amp.init_scale`
  (given to Apex through `amp.load_state_dict`), as the native one does.
- `backward`: `amp.scale_loss(..., delay_unscale=True)` for every batch of the step; `unscale_`
  then closes the step with one `amp.scale_loss` exit that unscales what they accumulated (into
  the float32 master gradients under O2), checks for overflow and updates the scale: the same as
  passing delay_unscale=False on the last batch, without the engine telling which one is last.
- Clipping and the gradient norm use `amp.master_params(optimizer)` (`optimizer_params` after
  `attach`). When Apex finds an overflow it has already decided to skip the step; `unscale_`
  then marks the gradients non-finite, so the engine's skip vote, its count of skipped steps and
  its restore of the BatchNorm statistics agree with Apex, and `step` lets Apex's skip run.
- Checkpoints and the EMA read the model's own tensors (`interface.live_state_dict`), never
  `model.state_dict()`, which under O2/O3 runs the float32-copy hook Apex puts on every module.
  Weights are saved in float32 (O2: the master values, which start from the float32 weights
  rather than from Apex's float16 copy of them; frozen weights: their float32 values from before
  Apex cast them), the optimiser state by index as the native backend saves it, and
  `amp.state_dict()` as the `scaler` entry. Either layout loads in either backend
  (`engine.precision.loss_scale`).
- `describe` names the Apex build (with its CUDA extensions, or Python-only and what that costs:
  `apex_checks.apex_build`).

Apex is imported only when this backend is chosen; it is never a dependency.
"""
from __future__ import annotations

import contextlib
import importlib

import torch
from torch import nn

from config.schema import AmpConfig
from engine.precision import apex_checks
from engine.precision.interface import PrecisionBackend
from engine.precision.loss_scale import apex_amp_state


class ApexPrecision(PrecisionBackend):
    """The precision backend on Apex's amp (float16 only; CUDA only)."""

    name = "apex"

    def __init__(self, cfg: AmpConfig, device: torch.device):
        super().__init__(cfg, device)
        self.amp = importlib.import_module("apex.amp")
        self.build = apex_checks.apex_build()
        self.dtype = torch.float32 if self.level == "O0" else self.half_dtype(cfg, device)
        self.init_scale = cfg.init_scale
        self.dynamic = self.level != "O0" and self.static_scale is None
        self._optimizer = None
        self._attached = False
        self._apex_skips = False        # Apex found an overflow and patched this step into a skip
        self._state_before = {}         # Apex's amp state before this step's unscale
        self._zero = torch.zeros((), device=device)

    @classmethod
    def check(cls, cfg) -> None:
        apex_checks.check_backend(cfg)
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

    # -- model and optimiser ------------------------------------------------------------------
    def prepare_model(self, model: nn.Module) -> nn.Module:
        """channels_last only: amp.initialize casts the model (it must receive it in float32)."""
        if self.channels_last:
            model = model.to(memory_format=torch.channels_last)
        if self.master_weights:
            self._keep_frozen_float32(model)
        return model

    def optimizer_params(self, trainable: list[nn.Parameter]) -> list[nn.Parameter]:
        """Before `attach`: the model's trainable parameters (the optimiser is built on them, and
        Apex swaps in its float32 copies under O2); after: `amp.master_params`, what it steps."""
        if not self._attached:
            return trainable
        return list(self.amp.master_params(self._optimizer))

    def attach(self, model: nn.Module, optimizer):
        cast = self.level in ("O2", "O3")
        # Apex copies its masters from the float16 model: they start from these float32 values
        # instead, so a resumed run (either backend's checkpoint) continues from identical weights
        exact = ({id(p): p.detach().clone() for p in model.parameters() if p.requires_grad}
                 if self.master_weights else {})
        loss_scale = None if self.level == "O0" else ("dynamic" if self.dynamic else self.static_scale)
        model, optimizer = self.amp.initialize(
            model, optimizer, opt_level=self.level, keep_batchnorm_fp32=self.keep_bn_fp32 if cast else None,
            loss_scale=loss_scale, verbosity=0)
        if self.dynamic:          # Apex starts at 2**16; the run's config says where to start
            self.amp.load_state_dict({"loss_scaler0": {"loss_scale": float(self.init_scale), "unskipped": 0}})
        if self.master_weights:
            # Apex makes its float32 master copies lazily; its zero_grad makes them now, in the
            # optimiser's order, so model parameter i pairs with master i
            halves = list(self.amp.master_params(optimizer))
            optimizer.zero_grad()
            self._pairs = list(zip(halves, self.amp.master_params(optimizer)))
            with torch.no_grad():
                for half, master in self._pairs:
                    if master is not half and id(half) in exact:
                        master.copy_(exact[id(half)])
        self._optimizer, self._attached = optimizer, True
        return model, optimizer

    def cast_input(self, images: torch.Tensor) -> torch.Tensor:
        """Apex's patched forward casts the input (O2/O3); only the memory format is set here."""
        return images.contiguous(memory_format=torch.channels_last) if self.channels_last else images

    def autocast_context(self):
        return contextlib.nullcontext()        # O1's casts are Apex's patched torch functions

    # -- the step -------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        with self.amp.scale_loss(loss, self._optimizer, delay_unscale=True) as scaled:
            scaled.backward()

    def unscale_(self, optimizer) -> None:
        """Unscale the step's accumulated gradients (Apex's scale_loss exit, with no further
        backward); where Apex found an overflow, make the engine see non-finite gradients."""
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
        """Apex's step: the real one, or (after an overflow) its skip, which also restores the
        real one for the next step. Apex updated the scale when it unscaled; after a bad loss
        (gradients made NaN by the engine) the scale goes back to what it was."""
        if grads_finite or self._apex_skips:
            optimizer.step()
        if bad_loss and self.dynamic and self._state_before:
            self.amp.load_state_dict(self._state_before)
        self._apex_skips = False

    def zero_grad(self, optimizer) -> None:
        optimizer.zero_grad()                  # Apex's under O2: model and master gradients

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Apex's amp state; empty at O0 (no scaling), as the native backend saves it."""
        return {} if self.level == "O0" else dict(self.amp.state_dict())

    def load_state_dict(self, state: dict) -> None:
        """A saved scaler state of either backend; a static scale keeps the config's value."""
        state = apex_amp_state(state)
        if state and self.dynamic:
            self.amp.load_state_dict(state)
