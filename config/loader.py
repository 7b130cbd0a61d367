"""Build a `Config` from a YAML preset and overrides, check it, and turn it back into YAML.

A preset is `config/presets/NAME.yaml` (or any YAML path) holding a nested mapping of the
sections of `config.schema.Config`; `base: OTHER` inherits another preset first. Overrides are
dotted keys (`train.epochs=3`), values parsed as YAML (`optim.milestones=[10,20]`). Unknown keys,
wrong types and impossible values raise `ConfigError` naming the key.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import yaml

from config.errors import ConfigError
from config.schema import Config

PRESET_DIR = Path(__file__).resolve().parent / "presets"


def available_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def _preset_path(name: str) -> Path:
    if name.endswith((".yaml", ".yml")) or os.sep in name:
        path = Path(name)
    else:
        path = PRESET_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(
            f"unknown preset or config file {name!r}: choose one of {', '.join(available_presets())} "
            f"or give a path to a YAML file")
    return path


def _read_preset(name: str, seen: tuple = ()) -> dict:
    path = _preset_path(name)
    if str(path) in seen:
        raise ConfigError(f"{path}: 'base' presets form a cycle")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: must hold a mapping of config sections")
    base = data.pop("base", None)
    if base:
        merged = _read_preset(base, seen + (str(path),))
        deep_update(merged, data)
        data = merged
    return data


def deep_update(dst: dict, src: dict) -> None:
    for key, value in src.items():
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            deep_update(dst[key], value)
        else:
            dst[key] = value


def _coerce(key: str, value: Any, default: Any) -> Any:
    """Check `value` against the type of the field's default; ints are accepted for floats."""
    if default is None or value is None:
        return value
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
        raise ConfigError(f"option {key}: expected true or false, got {value!r}")
    if isinstance(default, float):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        try:   # YAML 1.1 reads 1e-6 (no dot) as a string
            return float(value) if isinstance(value, str) else None
        except ValueError:
            pass
        raise ConfigError(f"option {key}: expected a number, got {value!r}")
    if isinstance(default, int):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"option {key}: expected an integer, got {value!r}")
    if isinstance(default, str):
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"option {key}: expected a string, got {value!r}")
    if isinstance(default, list):
        if isinstance(value, (list, tuple)):
            return list(value)
        if isinstance(value, str):
            return [v for v in value.replace(",", " ").split()]
        raise ConfigError(f"option {key}: expected a list, got {value!r}")
    return value


def _apply(cfg: Any, data: dict, prefix: str = "") -> None:
    fields = {f.name: f for f in dataclasses.fields(cfg)}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in fields:
            raise ConfigError(f"unknown option {full!r}; known here: {', '.join(sorted(fields))}")
        current = getattr(cfg, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"option {full}: expected a mapping of {type(current).__name__} fields")
            _apply(current, value, full + ".")
        else:
            # fields declared `object` take several types (auto or a switch, dynamic or a number):
            # validate() checks them
            declared_any = fields[key].type in ("object", object)
            setattr(cfg, key, value if declared_any else _coerce(full, value, current))


def parse_override(text: str) -> tuple[str, Any]:
    """`'a.b=VALUE'` -> (`'a.b'`, parsed VALUE)."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE, for example train.epochs=10")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def nested(key: str, value: Any) -> dict:
    out: dict = {}
    node = out
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return out


def build_config(preset: str | None = None, overrides: dict | None = None,
                 sets: list[str] | None = None) -> Config:
    """The resolved config: schema defaults, then the preset, then `overrides`, then `sets`."""
    cfg = Config()
    if preset:
        _apply(cfg, _read_preset(preset))
        cfg.preset = preset
    if overrides:
        _apply(cfg, overrides)
    for text in sets or []:
        key, value = parse_override(text)
        _apply(cfg, nested(key, value))
    validate(cfg)
    return cfg


def from_dict(data: dict) -> Config:
    """A `Config` from `to_dict` output (as saved in checkpoints)."""
    cfg = Config()
    _apply(cfg, data)
    validate(cfg)
    return cfg


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def validate(cfg: Config) -> None:
    """Raise `ConfigError` for settings that cannot work, naming the option."""
    size = cfg.data.input_size
    if size <= 0 or size % 64:
        raise ConfigError(f"option data.input_size: {size} is not a positive multiple of 64")
    if cfg.data.stride != 4:
        raise ConfigError("option data.stride: the network's output stride is 4")
    if cfg.amp.opt_level not in ("O0", "O1", "O2", "O3"):
        raise ConfigError(f"option amp.opt_level: unknown opt level {cfg.amp.opt_level!r} "
                          "(choose O0, O1, O2 or O3)")
    if cfg.amp.dtype not in ("auto", "float16", "bfloat16"):
        raise ConfigError(f"option amp.dtype: {cfg.amp.dtype!r} is not auto, float16 or bfloat16")
    scale = cfg.amp.loss_scale
    if scale != "dynamic":
        try:
            if isinstance(scale, bool) or float(scale) <= 0:
                raise ValueError
        except (TypeError, ValueError):
            raise ConfigError(f"option amp.loss_scale: {scale!r} "
                              "is not 'dynamic' or a positive number") from None
    if cfg.amp.channels_last not in ("auto", True, False):
        raise ConfigError(f"option amp.channels_last: {cfg.amp.channels_last!r} is not auto, true or false")
    if cfg.optim.name not in ("sgd", "adamw"):
        raise ConfigError(f"option optim.name: {cfg.optim.name!r} is not sgd or adamw")
    if cfg.optim.lr <= 0:
        raise ConfigError(f"option optim.lr: {cfg.optim.lr} must be positive")
    if cfg.train.batch_size <= 0:
        raise ConfigError(f"option train.batch_size: {cfg.train.batch_size} must be positive")
    if cfg.train.accumulate < 1:
        raise ConfigError(f"option train.accumulate: {cfg.train.accumulate} must be at least 1 "
                          "(batches per optimiser step)")
    if cfg.train.epochs <= 0:
        raise ConfigError(f"option train.epochs: {cfg.train.epochs} must be positive")
    if cfg.model.stacks <= 0 or cfg.model.depth <= 0:
        raise ConfigError("options model.stacks and model.depth must be positive")
    if len(cfg.loss.scale_weights) != cfg.model.depth + 1:
        raise ConfigError(f"option loss.scale_weights: {len(cfg.loss.scale_weights)} weights for "
                          f"{cfg.model.depth + 1} scales (model.depth + 1)")
    if size % (4 * 2 ** cfg.model.depth):
        raise ConfigError(f"option data.input_size: {size} is not a multiple of "
                          f"{4 * 2 ** cfg.model.depth} (4 x 2^model.depth)")
    if not all(float(s) > 0 for s in cfg.inference.scales):
        raise ConfigError("option inference.scales: every scale must be positive")
    if cfg.inference.decode_threads < 0:
        raise ConfigError(f"option inference.decode_threads: {cfg.inference.decode_threads} must be "
                          ">= 0 (0: one per core of this process's share of the machine)")
    if cfg.inference.batch_size < 1:
        raise ConfigError(f"option inference.batch_size: {cfg.inference.batch_size} must be >= 1")
