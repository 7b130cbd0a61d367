"""The native precision backend: Apex's opt levels on torch.amp (docs/training.md); only float16
needs a `GradScaler`."""
from __future__ import annotations

import itertools

import torch
from torch import nn

from config.schema import AmpConfig
from engine.precision.interface import PrecisionBackend
from engine.precision.loss_scale import grad_scaler_fields

_NORM_TYPES = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm)


class _HalfParamsGradScaler(torch.amp.GradScaler):
    """O3 in float16: unscales float16 gradients in place, as Apex's O3 did."""

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, True)


class NativePrecision(PrecisionBackend):
    """Apex's opt levels on torch.amp: autocast, GradScaler, this class's own master weights."""
    name = "native"

    def __init__(self, cfg: AmpConfig, device: torch.device):
        super().__init__(cfg, device)
        self.autocast = self.level == "O1"
        self._grad_starts = [0]     # O2: where each master gradient starts in one flat buffer; last: its size
        scaler_type = (_HalfParamsGradScaler if self.cast_model and not self.master_weights
                       else torch.amp.GradScaler)
        use_scaler = self.level != "O0" and self.dtype == torch.float16
        self.scaler = scaler_type(self.device_type, enabled=use_scaler,
                                  init_scale=self.static_scale or cfg.init_scale,
                                  growth_interval=2 ** 30 if self.static_scale else 2000)
        self.dynamic = self.scaler.is_enabled() and self.static_scale is None
        self.fixed_scale = self.static_scale if self.scaler.is_enabled() else None

    def describe(self) -> str:
        text = f"opt level {self.level}"
        if self.level != "O0":
            text += f", {str(self.dtype).replace('torch.', '')}"
            if self.cast_model:
                text += ", BatchNorm in float32" if self.keep_bn_fp32 else ", BatchNorm in half"
            if self.master_weights:
                text += ", float32 master weights"
            text += (f", loss scale {self.static_scale:g}" if self.scaler.is_enabled() and self.static_scale
                     else ", dynamic loss scale" if self.scaler.is_enabled() else ", no loss scaling")
        return text + (", channels_last" if self.channels_last else "")

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """Cast the (already loaded and frozen) model for O2/O3; make O2's master weights."""
        model = super().prepare_model(model)
        if not self.cast_model:
            return model
        if self.master_weights:
            self._pairs = [(p, nn.Parameter(p.detach().clone().float()))
                           for p in model.parameters() if p.requires_grad]
            sizes = (-(-master.numel() // 4) * 4 for _, master in self._pairs)     # 16-byte aligned starts
            self._grad_starts = [0, *itertools.accumulate(sizes)]
        for module in model.modules():
            if self.keep_bn_fp32 and isinstance(module, _NORM_TYPES):
                continue
            for name, param in module.named_parameters(recurse=False):
                param.data = param.data.to(self.dtype)
            for name, buf in module.named_buffers(recurse=False):
                if buf.is_floating_point():
                    setattr(module, name, buf.to(self.dtype))
        return model

    def optimizer_params(self, trainable: list[nn.Parameter]) -> list[nn.Parameter]:
        return [master for _, master in self._pairs] if self.master_weights else trainable

    def cast_input(self, images: torch.Tensor) -> torch.Tensor:
        images = super().cast_input(images)
        return images.to(self.dtype) if self.cast_model else images

    def autocast_context(self):
        return torch.autocast(self.device_type, self.dtype) if self.autocast else super().autocast_context()

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def unscale_(self, optimizer) -> None:
        """The optimiser's parameters' gradients in true scale, with no host sync; O2's master.grad are
        param.grad in float32, views of one flat buffer filled by one `_foreach_copy_`."""
        if self._pairs:
            flat = torch.empty(self._grad_starts[-1], dtype=torch.float32, device=self._pairs[0][1].device)
            for (param, master), start in zip(self._pairs, self._grad_starts):
                master.grad = (None if param.grad is None
                               else flat.as_strided(master.shape, master.stride(), start))
            if used := [(param, master) for param, master in self._pairs if param.grad is not None]:
                torch._foreach_copy_([master.grad for _, master in used],
                                     [param.grad.detach() for param, _ in used])
        if self.scaler.is_enabled():
            self.scaler.unscale_(optimizer)

    def step(self, optimizer, grads_finite: bool, bad_loss: bool = False) -> None:
        if grads_finite:
            optimizer.step()
            if self._pairs:
                with torch.no_grad():        # one multi-tensor copy back to the half weights
                    torch._foreach_copy_([p for p, _ in self._pairs], [m for _, m in self._pairs])
        if not self.scaler.is_enabled():
            return
        keep = bad_loss and self.static_scale is None     # rare: reading the scale costs one more sync
        self.scaler.update(self.scaler.get_scale() if keep else self.static_scale)

    def zero_grad(self, optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)
        for param, _ in self._pairs:
            param.grad = None

    def state_dict(self) -> dict:
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """A saved scaler state, GradScaler's or Apex's; fields it lacks keep this scaler's values."""
        state = grad_scaler_fields(state)
        if state and self.scaler.is_enabled():
            self.scaler.load_state_dict({**self.scaler.state_dict(), **state})
