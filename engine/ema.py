"""The exponential moving average of the weights (`--ema DECAY`, docs/training.md): float32 at any
opt level, the same on every rank without communication, kept in checkpoints under `EMA_KEY`."""
from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from common.errors import CheckpointError
from config.loader import out_of_bounds
from config.schema import FILE_FIELDS
from engine.precision import PrecisionBackend, live_state_dict
from engine.trainer import Hook
from models.checkpoint_weights import EMA_KEY


class WeightsEMA(Hook):
    checkpoint_key = EMA_KEY

    def __init__(self, decay: float, tau: float = 2000.0, say=print):
        if not 0.0 <= decay < 1.0 or not tau > 0:
            raise ValueError(f"EMA decay {decay} must be in [0, 1) and tau {tau} positive")
        self.decay, self.tau, self.updates, self.say = float(decay), float(tau), 0, say
        self.averaged: dict[str, torch.Tensor] = {}

    def attach(self, model: nn.Module, precision: PrecisionBackend) -> "WeightsEMA":
        """Start the average at the weights of `model` as it trains; returns self."""
        sources = precision.weight_sources(model)
        self._targets = live_state_dict(model)      # the model's own tensors, live
        # what a checkpoint's "model" takes from the model itself (not from O2's float32 copies)
        self._from_model = {k for k, t in sources.items() if t.data_ptr() == self._targets[k].data_ptr()}
        parameters = {name for name, p in model.named_parameters() if p.is_floating_point()}
        self.averaged = precision.float32_state_dict(model)     # copies of `sources`, float32
        self._average = [(self.averaged[k], sources[k]) for k in sources if k in parameters]
        copied = [k for k in sources if k not in parameters]
        self._copied = ([self.averaged[k] for k in copied], [sources[k] for k in copied])
        self._kept: list[torch.Tensor] | None = None      # the training weights during validation
        return self

    def current_decay(self) -> float:
        """The decay the last update used (0 before the first)."""
        return self.decay * (1.0 - math.exp(-self.updates / self.tau))

    @torch.no_grad()
    def update(self) -> None:
        """Move the average towards the weights (after an optimiser step that was taken)."""
        self.updates += 1
        weight = 1.0 - self.current_decay()
        if self._average:
            averaged, sources = zip(*self._average)
            sources = [s if s.dtype == torch.float32 else s.float() for s in sources]
            torch._foreach_lerp_(list(averaged), sources, weight)
        if self._copied[0]:               # one multi-tensor copy, not a kernel per buffer
            torch._foreach_copy_(*self._copied)

    def after_step(self, trainer, out) -> None:
        if not out.skipped:          # a skipped step changed no weight: the average stays too
            self.update()

    def state_missing(self, trainer, path) -> None:
        self.say(f"checkpoint {path} has no EMA of the weights (its run had no --ema): the "
                    "average starts from its weights now, its decay warming up again")

    def before_save(self, trainer, name: str, state: dict) -> None:
        """A checkpoint saved while the average is in the model keeps the training weights."""
        if self._kept is None or not isinstance(state.get("model"), dict):
            return
        for (key, target), kept in zip(self._targets.items(), self._kept):
            if key in self._from_model:
                state["model"][key] = kept.float() if kept.is_floating_point() else kept.clone()

    @contextlib.contextmanager
    def applied(self, trainer=None):
        """The averaged weights in the model inside the block (`evaluating`), the training ones after."""
        with torch.no_grad():
            self._kept = [t.clone() for t in self._targets.values()]
            torch._foreach_copy_(list(self._targets.values()), [self.averaged[k] for k in self._targets])
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(list(self._targets.values()), self._kept)
            self._kept = None

    evaluating = applied

    def state_dict(self) -> dict:
        return {"decay": self.decay, "tau": self.tau, "updates": self.updates,
                "model": {k: v.clone() for k, v in self.averaged.items()}}

    @torch.no_grad()
    def load_state_dict(self, state) -> None:
        state = state if isinstance(state, dict) else {}
        saved, updates = state.get("model"), state.get("updates")
        bad = updates is not None and out_of_bounds(updates, FILE_FIELDS["ema.updates"], whole=True)
        if not isinstance(saved, dict) or updates is None or bad:
            why = f"updates: {updates!r} {bad}" if bad else "expected 'updates' and 'model'"
            raise CheckpointError(f"its EMA state is damaged ({why}); start from its weights with --weights")
        differ = sorted(set(saved) ^ set(self.averaged)) + sorted(
            k for k in saved.keys() & self.averaged.keys()
            if not isinstance(saved[k], torch.Tensor) or saved[k].shape != self.averaged[k].shape)
        if differ:
            raise CheckpointError("its EMA weights do not fit this model "
                                  f"({len(differ)} tensors differ, e.g. {', '.join(differ[:3])}); "
                                  "start from its weights with --weights")
        torch._foreach_copy_(list(self.averaged.values()), [saved[name] for name in self.averaged])
        self.updates = updates
