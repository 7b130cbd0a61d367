"""The loss scaler's saved state in either layout, and the mapping between the two.

A checkpoint's `scaler` entry holds torch's `GradScaler.state_dict()` when the native backend
wrote it, and Apex's `amp.state_dict()` (`{'loss_scaler0': {'loss_scale': S, 'unskipped': N}}`)
when the apex backend did; the authors' own checkpoints keep the latter under `amp`. Both scalers
are the same dynamic scheme (x0.5 on an overflow, x2 after a window of finite steps; both windows
2000 by default), so two numbers carry over: the current scale, and the finite steps since the
last overflow or growth (Apex's `unskipped`, GradScaler's `_growth_tracker`). The other
GradScaler fields are its settings, which the run's config gives.
"""
from __future__ import annotations

APEX_KEY = "loss_scaler0"


def is_apex_layout(state) -> bool:
    return isinstance(state, dict) and isinstance(state.get(APEX_KEY), dict)


def grad_scaler_fields(state) -> dict:
    """`state` (either layout) as GradScaler fields; {} when it holds no scale (a disabled scaler's
    empty state, None, or something else)."""
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
