"""A run's checkpoint, written and read back in one place: `TrainState` is the run's position as a
checkpoint holds it; `checkpoint_of` writes it beside the parts' states (model, optimiser, scaler,
RNG) and each hook's `state_dict()` under its `checkpoint_key`; `restore` reads the same entries
back into a run built from the same configuration.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from common.errors import CheckpointError
from config.loader import to_dict
from engine.precision.loss_scale import checked_scaler_state
from runtime import checkpoint as ckpt

_STATE_ERRORS = (ValueError, KeyError, TypeError, RuntimeError, IndexError, AttributeError)


@dataclass
class TrainState:
    epoch: int                         # the epoch the run is in (0-based)
    iteration: int                     # batches of that epoch done
    step: int | None                   # optimiser steps done (None: the authors' run, whose count is unknown)
    skipped_steps: int = 0             # steps skipped for a bad loss or gradients, all told
    validation_pending: bool = False   # saved before the epoch's validation, which a resume runs again

    @classmethod
    def of_checkpoint(cls, state: dict) -> "TrainState":
        return cls(state["epoch"], state["iteration"], state["step"], state.get("skipped_steps", 0),
                   bool(state.get("validation_pending", False)))


def hook_states(trainer) -> dict:
    """The hooks' states under their `checkpoint_key`s (every rank computes them)."""
    return {h.checkpoint_key: h.state_dict() for h in trainer.hooks if h.checkpoint_key}


def checkpoint_of(trainer, position: TrainState, hooks: dict) -> dict:
    """What a run's checkpoint holds: its parts' states, `position`, the hooks' states `hooks`."""
    return {
        "model": trainer.precision.float32_state_dict(ckpt.unwrap_model(trainer.model)),
        "optimizer": trainer.optimizer.state_dict(),
        "scaler": trainer.precision.state_dict(),
        **asdict(position),
        "config": to_dict(trainer.cfg), "rng": ckpt.capture_rng_state(),
        "skeleton": trainer.skeleton.to_spec(),
        "mode": trainer.launch.mode, "world_size": trainer.ctx.world_size, **hooks,
    }


def restore(trainer, state: dict, path: Path) -> TrainState:
    """Optimiser, scaler, RNG and the hooks' states from `state` (the checkpoint at `path`) into
    `trainer`; returns the position it continues from. The scaler's state is checked first, as
    weights are (engine.precision.loss_scale)."""
    scaler, note = checked_scaler_state(state.get("scaler"), f"checkpoint {path}")
    try:
        trainer.optimizer.load_state_dict(state["optimizer"])
        trainer.precision.load_state_dict(scaler or {})
        if trainer.ctx.is_main and state.get("rng"):
            ckpt.restore_rng_state(state["rng"])
        for hook in trainer.hooks:
            if not hook.checkpoint_key:
                continue
            if hook.checkpoint_key not in state:
                hook.state_missing(trainer, path)
                continue
            try:
                hook.load_state_dict(state[hook.checkpoint_key])
            except CheckpointError as exc:          # what does not fit, in the hook's words
                raise CheckpointError(f"checkpoint {path}: {exc}") from None
    except _STATE_ERRORS as exc:
        first_line = str(exc).splitlines()[0] if str(exc) else ""
        raise CheckpointError(f"checkpoint {path}: its optimiser, scaler or RNG state does not fit "
                              f"this run ({type(exc).__name__}: {first_line}); start from its "
                              "weights with --weights instead of --resume") from None
    if note:
        trainer.say(note)
    position = TrainState.of_checkpoint(state)
    trainer.optim_step.skipped_total = position.skipped_steps
    origin = state.get("origin") or (f"saved by a {state.get('mode', '?')} run of "
                                     f"{state.get('world_size', '?')} process(es)")
    trainer.say(f"resumed from {path}: epoch {position.epoch + 1}, batch {position.iteration}"
                + (f", step {position.step}" if position.step is not None else "") + f" ({origin})")
    return position
