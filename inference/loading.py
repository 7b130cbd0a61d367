"""What evaluate.py and demo.py share: the config and the model of a weights file.

A checkpoint written by the engine carries its resolved config: it is the base, so the network
built matches the weights; a bare state dict uses `--preset` (default imhn512). `--set KEY=VALUE`
overrides apply on top, then the inference flags (scales, flip).
"""
from __future__ import annotations

from config.errors import CheckpointError
from config.loader import build_config
from config.schema import Config

DEFAULT_PRESET = "imhn512"


def inference_config(saved: dict | None, preset: str | None, sets: list[str],
                     scales=None, flip: bool | None = None) -> Config:
    """The run's config: `saved` (a checkpoint's) or `preset`, then `sets`, then scales / flip."""
    extra = list(sets or [])
    if scales:
        extra.append("inference.scales=[" + ",".join(str(float(s)) for s in scales) + "]")
    if flip is not None:
        extra.append(f"inference.flip={'true' if flip else 'false'}")
    if saved is not None:
        saved = {k: v for k, v in saved.items() if k != "preset"}
        return build_config(None, overrides=saved, sets=extra)
    return build_config(preset or DEFAULT_PRESET, sets=extra)


def load_model(weights: str, preset: str | None, sets: list[str], device, scales=None,
               flip: bool | None = None):
    """(model on `device` in eval mode, its Config) from a checkpoint or a bare weights file."""
    from engine.checkpoint import load_checkpoint, load_weights
    from models import build_model

    try:
        state, not_a_checkpoint = load_checkpoint(weights), None
    except CheckpointError as exc:
        state, not_a_checkpoint = None, exc   # a bare state dict, or a bad file: load_weights says which
    saved = state.get("config") if isinstance(state, dict) else None
    cfg = inference_config(saved if isinstance(saved, dict) else None, preset, sets, scales, flip)
    model = build_model(cfg.model)
    try:
        load_weights(model, state if state is not None else weights)
    except CheckpointError as exc:
        # the same message twice: the file itself cannot be read (missing, corrupt, unsafe), and
        # the preset has nothing to do with it
        if saved is not None or str(exc) == str(not_a_checkpoint):
            raise
        raise CheckpointError(f"{exc} (the file holds no config: the network was built from preset "
                              f"{preset or DEFAULT_PRESET}; give the --preset of its run)") from None
    return model.to(device).eval(), cfg
