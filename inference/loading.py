"""What the inference API reads from a weights file: its config, its model (whose `.skeleton` names its
channels), and the device to run on (docs/evaluation.md says which config a file gets)."""
from __future__ import annotations

import os
import sys

import torch

from common.errors import CheckpointError, ConfigError, refuse_inapplicable
from config.loader import build_config
from config.schema import REFERENCE_PRESET, Config
from data.skeleton import from_checkpoint


def pick_device(device) -> torch.device:
    """A torch.device from auto | cpu | cuda | cuda:N (or a torch.device); ConfigError if absent."""
    from runtime.launch_env import read_launch, resolve_device

    if isinstance(device, torch.device):
        return device
    return resolve_device(str(device), read_launch(os.environ, None))


def inference_config(saved: dict | None, preset: str | None, sets: list[str],
                     scales=None, flip: bool | None = None, model: dict | None = None) -> Config:
    """The run's config: `saved` or `preset` with `model` settings, then `sets`, scales, flip."""
    flags = {"scales": [float(s) for s in scales] if scales else None, "flip": flip}
    options = {"inference": {k: v for k, v in flags.items() if v is not None}}
    if saved is not None:
        saved = {k: v for k, v in saved.items() if k != "preset"}
        return build_config(None, overrides=saved, sets=sets, options=options)
    return build_config(preset or REFERENCE_PRESET, overrides={"model": model} if model else None, sets=sets,
                        options=options)


def load_model(weights: str, preset: str | None, sets: list[str], device, scales=None,
               flip: bool | None = None, say=None):
    """(model on `device` in eval mode, its Config) of a checkpoint, an authors' file or bare weights."""
    from runtime.checkpoint import load_checkpoint, load_weights, reference_file_settings
    from models import build_model
    from models.checkpoint_weights import preferred_weights

    try:
        state, not_a_checkpoint = load_checkpoint(weights), None
    except CheckpointError as exc:
        state, not_a_checkpoint = None, exc   # a bare state dict, or a bad file: load_weights says which
    saved = state.get("config") if isinstance(state, dict) else None
    saved = saved if isinstance(saved, dict) else None
    settings = reference_file_settings(weights) if state is None else None
    if saved is not None:
        refuse_inapplicable({"--preset": preset}, "to a checkpoint of this trainer", "it carries its own "
                            "config (change a setting with --set KEY=VALUE)")
    try:
        cfg = inference_config(saved, preset, sets, scales, flip, settings)
    except ConfigError as exc:
        if saved is None:
            raise
        try:                                  # the flags' own mistake: that error
            inference_config(None, preset, sets, scales, flip)
        except ConfigError:
            raise exc from None
        raise ConfigError(f"the config saved in checkpoint {weights} does not fit this version: {exc}. "
                          "Fix it with --set KEY=VALUE, or export the bare weights and pass --preset"
                          ) from None
    model = build_model(cfg.model, from_checkpoint(state))
    chosen, ema_note = preferred_weights(state)
    try:
        report = load_weights(model, chosen if state is not None else weights, source=weights)
    except CheckpointError as exc:
        # the file itself cannot be read: the preset has nothing to do with it
        if saved is not None or settings is not None or str(exc) == str(not_a_checkpoint):
            raise
        raise CheckpointError(f"{exc} (the file holds no config: the network was built from preset "
                              f"{preset or REFERENCE_PRESET}; give the --preset of its run)") from None
    say = say or (lambda text: print(text, file=sys.stderr))
    for note in (report["converted"], ema_note):
        if note:
            say(f"{weights}: {note}")
    return model.to(device).eval(), cfg
