"""An exponential moving average (EMA) of the weights (`--ema DECAY`): what is validated, scored
and kept in `best.pth` when it is on.

After every optimiser step that was not skipped, each floating-point parameter becomes
`ema = d * ema + (1 - d) * weight` with a decay that warms up as YOLO and RTMO do,
`d = decay * (1 - exp(-updates / tau))` (`train.ema_tau`, 2000 steps by default), so that the
average does not drag the random initial weights along for thousands of steps. Buffers (BatchNorm
statistics and counters) are copied, not averaged. The average is float32 whatever the opt level:
it reads O2's float32 master weights (and frozen weights' float32 values), the float32 model
under O0 and O1, and the half model cast to float32 under O3 (`PrecisionBackend.weight_sources`). It is a
deterministic function of the weights, which are identical on every rank, so every rank holds the
same average without any communication.

`WeightsEMA` is a hook of the training run: `attach` starts it at the model's weights,
`after_step(trainer, out)` updates it, `evaluating(trainer)` is a context in which the
averaged weights are in the model (validation, AP, best.pth), the training weights put back bit
for bit after it, and `before_save` keeps the training weights in a checkpoint saved meanwhile. Its
`state_dict()` goes into every checkpoint under "ema" ({"decay", "tau", "updates", "model": the
averaged float32 state dict}) and `load_state_dict` restores it exactly, so a resumed run continues
the average as the uninterrupted one would; resuming a checkpoint without one says that the
average starts from its weights. `--weights`, evaluate.py and demo.py take the "ema"
weights of a checkpoint that has them (`runtime.checkpoint.preferred_weights`). The trainer adds
this hook itself when `train.ema` is set (`engine.hooks.default_hooks`).
"""
from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from common.errors import CheckpointError
from engine.precision import PrecisionBackend, live_state_dict
from engine.trainer import Hook

CHECKPOINT_KEY = "ema"


class WeightsEMA(Hook):
    checkpoint_key = CHECKPOINT_KEY

    def __init__(self, decay: float, tau: float = 2000.0, say=print):
        if not 0.0 <= decay < 1.0 or not tau > 0:
            raise ValueError(f"EMA decay {decay} must be in [0, 1) and tau {tau} positive")
        self.decay, self.tau, self.updates, self.say = float(decay), float(tau), 0, say
        self.averaged: dict[str, torch.Tensor] = {}

    def attach(self, model: nn.Module, precision: PrecisionBackend) -> "WeightsEMA":
        """Start the average at the weights of `model` (loaded, frozen, cast and wrapped as it
        trains; under Apex, after its masters exist); returns self."""
        sources = precision.weight_sources(model)
        # the model's own tensors, live (not model.state_dict(): under Apex O2/O3 a hook makes
        # that return float32 copies, which the average would never follow nor write into)
        self._targets = live_state_dict(model)
        # what a checkpoint's "model" takes from the model itself (not from O2's float32 copies)
        self._from_model = {k for k, t in sources.items() if t.data_ptr() == self._targets[k].data_ptr()}
        parameters = {name for name, p in model.named_parameters() if p.is_floating_point()}
        self.averaged = {name: (t.detach().float() if t.is_floating_point() else t.detach()).clone()
                         for name, t in sources.items()}
        self._average = [(self.averaged[k], sources[k]) for k in sources if k in parameters]
        copied = [k for k in sources if k not in parameters]
        self._copied = ([self.averaged[k] for k in copied], [sources[k] for k in copied])
        self._kept: list[torch.Tensor] | None = None      # the training weights during validation
        return self

    def describe(self) -> str:
        return f"EMA of the weights, decay {self.decay:g} warmed up over tau {self.tau:g} steps"

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

    # -- the hook ---------------------------------------------------------------------------------
    def after_step(self, trainer, out) -> None:
        if not out.skipped:          # a skipped step changed no weight: the average stays too
            self.update()

    def state_missing(self, trainer, path) -> None:
        self.say(f"checkpoint {path} has no EMA of the weights (its run had no --ema): the "
                    "average starts from its weights now, its decay warming up again")

    def evaluating(self, trainer=None):
        """Validation, AP and saving best.pth see the averaged weights (`applied`)."""
        return self.applied()

    def before_save(self, trainer, name: str, state: dict) -> None:
        """A checkpoint saved while the averaged weights are in the model (best.pth, right after
        the validation that chose it) still holds the training weights under "model"."""
        if self._kept is None or not isinstance(state.get("model"), dict):
            return
        for (key, target), kept in zip(self._targets.items(), self._kept):
            if key in self._from_model:
                state["model"][key] = kept.float() if kept.is_floating_point() else kept.clone()

    @contextlib.contextmanager
    def applied(self):
        """The averaged weights in the model (in its precision) inside the block, the training
        weights kept aside and put back exactly as they were after it, whatever happens."""
        with torch.no_grad():
            self._kept = [t.clone() for t in self._targets.values()]
            torch._foreach_copy_(list(self._targets.values()), [self.averaged[k] for k in self._targets])
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(list(self._targets.values()), self._kept)
            self._kept = None

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"decay": self.decay, "tau": self.tau, "updates": self.updates,
                "model": {k: v.clone() for k, v in self.averaged.items()}}

    @torch.no_grad()
    def load_state_dict(self, state) -> None:
        """Continue the average saved in `state` (this run's decay and tau are kept); a
        CheckpointError when it does not fit this model (the caller names the checkpoint)."""
        saved = state.get("model") if isinstance(state, dict) else None
        updates = state.get("updates") if isinstance(state, dict) else None
        if not isinstance(saved, dict) or not isinstance(updates, int) or isinstance(updates, bool) \
                or updates < 0:
            raise CheckpointError("its EMA state is damaged (expected "
                                  "'updates' and 'model'); start from its weights with --weights")
        differ = sorted(set(saved) ^ set(self.averaged)) + sorted(
            k for k in saved.keys() & self.averaged.keys()
            if not isinstance(saved[k], torch.Tensor) or saved[k].shape != self.averaged[k].shape)
        if differ:
            raise CheckpointError("its EMA weights do not fit this model "
                                  f"({len(differ)} tensors differ, e.g. {', '.join(differ[:3])}); "
                                  "start from its weights with --weights")
        for name, tensor in self.averaged.items():
            tensor.copy_(saved[name])
        self.updates = updates
