"""The loss scaler's saved state in either layout, and the mapping between the two: the `scaler`
entry holds torch's `GradScaler.state_dict()` (native backend) or Apex's `amp.state_dict()` (apex
backend; the authors' checkpoints keep it under `amp`). Both are the same dynamic scheme, so two
numbers carry over: the scale and the finite steps since the last change. A saved state that would
skip every step (a scale not finite or below 2^-24, bad factors or counts) is refused naming the
file and field; a scale above 2^24 continues from 2^24, with a line.
"""
from __future__ import annotations

import math

from common.errors import CheckpointError
from config.schema import MAX_LOSS_SCALE, MIN_LOSS_SCALE

APEX_KEY = "loss_scaler0"


def is_apex_layout(state) -> bool:
    return isinstance(state, dict) and isinstance(state.get(APEX_KEY), dict)


def grad_scaler_fields(state) -> dict:
    """`state` (either layout) as GradScaler fields; {} when it holds no scale."""
    if is_apex_layout(state):
        scaler = state[APEX_KEY]
        if "loss_scale" not in scaler:
            return {}
        return {"scale": float(scaler["loss_scale"]), "_growth_tracker": int(scaler.get("unskipped", 0))}
    return dict(state) if isinstance(state, dict) and "scale" in state else {}


def apex_amp_state(state) -> dict:
    """`state` (either layout) as Apex's amp state; {} when it holds no scale."""
    fields = grad_scaler_fields(state)
    if not fields:
        return {}
    return {APEX_KEY: {"loss_scale": float(fields["scale"]),
                       "unskipped": int(fields.get("_growth_tracker", 0))}}


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# field: (what it must be, the test); GradScaler's layout, then Apex's (under APEX_KEY)
_GRAD_SCALER_FIELDS = {
    "scale": ("a finite number >= 2^-24", lambda v: _number(v) and v >= MIN_LOSS_SCALE),
    "growth_factor": ("a finite number > 1", lambda v: _number(v) and v > 1),
    "backoff_factor": ("a number between 0 and 1", lambda v: _number(v) and 0 < v < 1),
    "growth_interval": ("a whole number >= 1", lambda v: _count(v) and v >= 1),
    "_growth_tracker": ("a whole number >= 0", _count),
}
_APEX_FIELDS = {"loss_scale": _GRAD_SCALER_FIELDS["scale"],
                "unskipped": _GRAD_SCALER_FIELDS["_growth_tracker"]}


def scaler_problem(state) -> str | None:
    """What makes a saved scaler state unusable, naming the field; None when usable or empty."""
    if is_apex_layout(state):
        fields, prefix, state = _APEX_FIELDS, f"{APEX_KEY}.", state[APEX_KEY]
        if "loss_scale" not in state:
            return f"{prefix}loss_scale is missing"
    elif isinstance(state, dict) and "scale" in state:
        fields, prefix = _GRAD_SCALER_FIELDS, ""
    else:
        return None if state is None or isinstance(state, dict) else f"it is a {type(state).__name__}"
    for name, (wanted, good) in fields.items():
        if name in state and not good(state[name]):
            value = state[name]
            return (f"{prefix}{name} is {value!r}" + (" (text)" if isinstance(value, (str, bytes)) else "")
                    + f", not {wanted}")
    return None


def checked_scaler_state(state, source: str) -> tuple[object, str]:
    """A checkpoint's scaler entry ready to load, and '' or a line saying its scale was brought
    within bounds; CheckpointError naming the file (`source`) and field when unusable."""
    problem = scaler_problem(state)
    if problem:
        raise CheckpointError(f"{source}: its loss scaler state is damaged ({problem}); start from its "
                              "weights with --weights instead of --resume")
    scale = grad_scaler_fields(state).get("scale")
    if scale is None or scale <= MAX_LOSS_SCALE:
        return state, ""
    state = ({APEX_KEY: {**state[APEX_KEY], "loss_scale": MAX_LOSS_SCALE}} if is_apex_layout(state)
             else {**state, "scale": MAX_LOSS_SCALE})
    return state, (f"{source}: its loss scale {scale:g} is above 2^24, where float16 overflows at "
                   "every step; the run continues from 2^24 (a dynamic scale lowers itself from there)")
