"""The loss scaler's saved state in either layout (GradScaler's, Apex's `loss_scaler0`), mapped both
ways (the scale and the finite steps since its change), and refused when it would skip every step."""
from __future__ import annotations

from common.errors import CheckpointError
from config.loader import out_of_bounds
from config.schema import FILE_FIELDS, MAX_LOSS_SCALE

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
    return fields and {APEX_KEY: {"loss_scale": float(fields["scale"]),
                                  "unskipped": int(fields.get("_growth_tracker", 0))}}


# GradScaler's fields (whole numbers or not), then Apex's (under APEX_KEY), and their bounds' names
_GRAD_SCALER_FIELDS = {"scale": False, "growth_factor": False, "backoff_factor": False,
                       "growth_interval": True, "_growth_tracker": True}
_APEX_FIELDS = {"loss_scale": "scale", "unskipped": "_growth_tracker"}


def scaler_problem(state) -> str | None:
    """What makes a saved scaler state unusable, naming the field; None when usable or empty."""
    if is_apex_layout(state):
        fields, prefix, state = _APEX_FIELDS, f"{APEX_KEY}.", state[APEX_KEY]
        if "loss_scale" not in state:
            return f"{prefix}loss_scale is missing"
    elif isinstance(state, dict) and "scale" in state:
        fields, prefix = {name: name for name in _GRAD_SCALER_FIELDS}, ""
    else:
        return None if state is None or isinstance(state, dict) else f"it is a {type(state).__name__}"
    for name, ours in fields.items():
        problem = name in state and out_of_bounds(state[name], FILE_FIELDS[f"scaler.{ours}"],
                                                  _GRAD_SCALER_FIELDS[ours])
        if problem:
            return f"{prefix}{name}: {state[name]!r} {problem}"
    return None


def checked_scaler_state(state, source: str) -> tuple[object, str]:
    """A checkpoint's scaler entry ready to load, and '' or a line saying its scale was brought
    within bounds; CheckpointError naming the file (`source`) and field when unusable."""
    if problem := scaler_problem(state):
        raise CheckpointError(f"{source}: its loss scaler state is damaged ({problem}); start from its "
                              "weights with --weights instead of --resume")
    scale = grad_scaler_fields(state).get("scale")
    if scale is None or scale <= MAX_LOSS_SCALE:
        return state, ""
    state = ({APEX_KEY: {**state[APEX_KEY], "loss_scale": MAX_LOSS_SCALE}} if is_apex_layout(state)
             else {**state, "scale": MAX_LOSS_SCALE})
    return state, (f"{source}: its loss scale {scale:g} is above 2^24, where float16 overflows at "
                   "every step; the run continues from 2^24 (a dynamic scale lowers itself from there)")
