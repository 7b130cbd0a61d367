"""Build a `Config` from a YAML preset (`base: OTHER` inherits another first) and dotted overrides
(`optim.milestones=[10,20]`), check it (a `ConfigError` naming the key), and turn it back into YAML.
`read_yaml` reads any YAML file a user names (preset, config.yaml, skeleton), or one error line."""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
from pathlib import Path
from typing import Any

import yaml

from common.errors import ConfigError, os_reason
from config.schema import LOSS_SCALE, Bounds, Config, declared

PRESET_DIR = Path(__file__).resolve().parent / "presets"
MAX_BYTES = 16 << 20          # a config or skeleton is a few kB; more is another kind of file


def read_yaml(path, source: str | None = None):
    """The parsed content of the YAML file at `path`; `source` is how errors name it (the path)."""
    path, source = Path(path), source or str(path)
    try:
        if (size := path.stat().st_size) > MAX_BYTES:
            raise ConfigError(f"{source}: {size >> 20} MiB is too large for a YAML "
                              "config or skeleton file; is it the file you meant?")
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{source}: not a YAML file (not UTF-8 text)") from None
    except OSError as exc:
        raise ConfigError(f"{source}: cannot be read ({os_reason(exc)})") from None
    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{source}: malformed YAML{where}: {' '.join(str(exc.problem).split())}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: malformed YAML ({' '.join(str(exc).split())})") from None


def available_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def read_preset(name: str, seen: tuple = ()) -> dict:
    """The sections of preset `name` (or YAML path), its `base` chain merged under them."""
    is_path = name.endswith((".yaml", ".yml")) or os.sep in name
    path = Path(name) if is_path else PRESET_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(
            f"unknown preset or config file {name!r}: choose one of {', '.join(available_presets())} "
            f"or give a path to a YAML file")
    if str(path) in seen:
        raise ConfigError(f"{path}: 'base' presets form a cycle")
    data = read_yaml(path) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: must hold a mapping of config sections")
    if base := data.pop("base", None):
        merged = read_preset(base, seen + (str(path),))
        deep_update(merged, data)
        data = merged
    return data


def deep_update(dst: dict, src: dict) -> None:
    for key, value in src.items():
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            deep_update(dst[key], value)
        else:
            dst[key] = value


def _number(key: str, value: Any, kind: type, what: str = "") -> Any:
    """`value` as an int or a float (`kind`); ConfigError naming `key` for anything else."""
    if isinstance(value, str):               # YAML 1.1 reads 1e-6 (no dot) as a string
        with contextlib.suppress(ValueError):
            value = float(value) if kind is float else int(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if kind is float or isinstance(value, int) or (math.isfinite(value) and value.is_integer()):
            return kind(value)
    raise ConfigError(f"option {key}: {what}expected {_EXPECTED[kind]}, got {value!r}")


_EXPECTED = {bool: "true or false", int: "an integer", float: "a number", str: "a string", list: "a list"}


def _coerce(key: str, value: Any, default: Any) -> Any:
    """Check `value` against the type of the field's default (ints accepted for floats)."""
    kind = type(default)                     # not a union field: `_apply` leaves those to their choices
    if value is None:
        shown = yaml.safe_dump(default, default_flow_style=True).strip().removesuffix("\n...").strip()
        raise ConfigError(f"option {key}: expected {_EXPECTED[kind]}, got null (an empty value in YAML); "
                          f"give a value, or leave the option out to keep {shown}")
    if kind in (int, float):
        return _number(key, value, kind)
    if kind is list:
        if isinstance(value, str):
            value = value.replace(",", " ").split()
        if isinstance(value, (list, tuple)):
            bounds = declared(key)["bounds"]
            if bounds is None or bounds.items is None:
                return list(value)
            return [_number(key, v, bounds.items, f"item {i}: ") for i, v in enumerate(value)]
    elif kind is bool and isinstance(value, bool):
        return value
    elif kind is str and isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(f"option {key}: expected {_EXPECTED[kind]}, got {value!r}")


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
        else:          # union types (auto or a switch, ...): their choices, or validate(), check them
            several = "|" in str(fields[key].type)
            setattr(cfg, key, value if several else _coerce(full, value, current))


def nested(key: str, value: Any) -> dict:
    """`'a.b'`, VALUE -> {'a': {'b': VALUE}}."""
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


def build_config(preset: str | None = None, overrides: dict | None = None,
                 sets: list[str] | None = None, options: dict | None = None) -> Config:
    """Schema defaults, then the preset, `overrides`, `sets`, `options` (a command's flags: over --set)."""
    cfg = Config()
    if preset:
        _apply(cfg, read_preset(preset))
        cfg.preset = preset
    if overrides:
        _apply(cfg, overrides)
    for text in sets or []:                  # KEY=VALUE, VALUE read as YAML
        if "=" not in text:
            raise ConfigError(f"--set {text!r}: expected KEY=VALUE, for example train.epochs=10")
        key, raw = text.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        _apply(cfg, nested(key.strip(), value))
    if options:
        _apply(cfg, options)
    validate(cfg)
    return cfg


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def differences(old: dict, new: dict, prefix: str = "") -> dict:
    """{dotted key: (old value, new value)} of the fields that differ between two `to_dict`s."""
    found = {}
    for key, value in new.items():
        was = old.get(key) if isinstance(old, dict) else None
        if isinstance(value, dict):
            found.update(differences(was if isinstance(was, dict) else {}, value, f"{prefix}{key}."))
        elif was != value:
            found[f"{prefix}{key}"] = (was, value)
    return found


def setting(key: str) -> str:
    """How a user names option `key`: its flag and key ("--freeze (train.freeze)"), else the key."""
    flg = declared(key)["flag"]
    return f"{flg.name} ({key})" if flg else key


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def check_value(key: str, value: Any) -> None:
    """Raise `ConfigError` for a value of option `key` not finite or outside its bounds and choices."""
    declaration = declared(key)
    choices, bounds = declaration["choices"], declaration["bounds"]
    if choices is not None and value not in choices:
        shown = ["null" if c is None else str(c).lower() if isinstance(c, bool) else str(c) for c in choices]
        listed = f"{', '.join(shown[:-1])} or {shown[-1]}" if len(shown) > 1 else shown[0]
        why = f" ({declaration['why']})" if declaration["why"] else ""
        raise ConfigError(f"option {key}: {value!r} is not {listed}{why}")
    items = value if isinstance(value, list) else [value]
    if isinstance(value, list) and bounds is not None:
        if len(value) < bounds.min_items or (bounds.max_items is not None and len(value) > bounds.max_items):
            count = (f"exactly {bounds.min_items}" if bounds.min_items == bounds.max_items
                     else f"at least {bounds.min_items}" if bounds.max_items is None
                     else f"{bounds.min_items} to {bounds.max_items}")
            raise ConfigError(f"option {key}: {value!r} must have {count} items")
    for item in items:
        if isinstance(item, (int, float)) and not isinstance(item, bool):
            if problem := out_of_bounds(item, bounds or Bounds()):
                where = f"item {item!r} of {value!r}" if isinstance(value, list) else repr(item)
                raise ConfigError(f"option {key}: {where} {problem}")


def out_of_bounds(value: Any, bounds: Bounds, whole: bool = False) -> str | None:
    """Why `value` is not a (`whole`) finite number within `bounds` ("must be >= 0"), else None: one rule
    for flags, config and skeleton files and checkpoint state."""
    if not isinstance(value, int if whole else (int, float)) or isinstance(value, bool):
        text = "text, " if isinstance(value, (str, bytes)) else ""
        return f"is {text}not a {'whole ' if whole else ''}number"
    if not math.isfinite(value):
        return "is not a finite number"
    low_ok = bounds.low is None or (value > bounds.low if bounds.low_open else value >= bounds.low)
    high_ok = bounds.high is None or (value < bounds.high if bounds.high_open else value <= bounds.high)
    if low_ok and high_ok:
        return None
    low = "" if bounds.low is None else f"{'>' if bounds.low_open else '>='} {_shown(bounds.low)}"
    high = "" if bounds.high is None else f"{'<' if bounds.high_open else '<='} {_shown(bounds.high)}"
    return f"must be {' and '.join(t for t in (low, high) if t)}"


def _shown(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() and abs(bound) < 1e16 else f"{bound:g}"


def check_section(section: Any, prefix: str = "") -> None:
    """`check_value` for every field of a section (`prefix`: e.g. "inference") or a whole `Config`."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        key = f"{prefix}.{f.name}".lstrip(".")
        if dataclasses.is_dataclass(value):
            check_section(value, key)
        else:
            check_value(key, value)


def input_multiple(depth: int = 4) -> int:
    """What a network's input sides are multiples of: 64, or 4 x 2^depth when larger."""
    return 4 * 2 ** max(depth, 4)


def check_input_size(size: Any, depth: int = 4, option: str = "option data.input_size") -> None:
    """Raise `ConfigError` naming `option` unless a network of `depth` takes input `size`."""
    if not isinstance(size, int) or isinstance(size, bool):
        raise ConfigError(f"{option}: {size!r} is not a whole number of pixels")
    check_value("data.input_size", size)
    if size % (multiple := input_multiple(depth)):
        raise ConfigError(f"{option}: {size} is not a positive multiple of {multiple}"
                          + (" (4 x 2^model.depth)" if depth > 4 else ""))


def device_spelling(spec: str) -> str:
    return spec.strip().lower().replace(" ", "")


def check_device(spec: str, option: str) -> None:
    """ConfigError naming `option` unless `spec` is a device this project knows how to pick."""
    spelled = device_spelling(spec) if isinstance(spec, str) else ""
    if not re.fullmatch(r"auto|cpu|cuda|cuda:\d+|\d+(,\d+)*", spelled):
        raise ConfigError(f"{option}: {spec!r} is not auto, cpu, cuda, cuda:N or a list of GPU numbers "
                          "like 2,3")


def validate(cfg: Config) -> None:
    """Raise `ConfigError` for settings that cannot work, naming the option."""
    check_section(cfg)
    train = cfg.train
    name = train.run_name                    # the run directory is OUT_DIR/NAME: one plain component
    if name and (name in (".", "..") or "/" in name or "\\" in name or os.sep in name or "\0" in name):
        raise ConfigError(f"option train.run_name: {name!r} is not a plain folder name (no '/', "
                          "'.' or '..'); the run directory is --out-dir/NAME, choose the parent with "
                          "--out-dir")
    check_device(train.device, "option train.device")
    # one way to start a run (`--resume auto` with --weights: a requeued job)
    if train.resume_reference and train.weights:
        raise ConfigError("--resume-reference and --weights: give one (the authors' checkpoint already "
                          "holds the weights)")
    other = "--weights" if train.weights else "--resume-reference" if train.resume_reference else ""
    if train.resume and train.resume != "auto" and other:
        raise ConfigError(f"--resume {train.resume} and {other}: give one (a resume continues its run "
                          f"with the checkpoint's own weights; {other} starts a run)")
    if train.resume and train.overwrite:
        raise ConfigError(f"--resume {train.resume} and --overwrite: give one (--overwrite removes the "
                          "checkpoints a resume would continue from)")
    if not all(isinstance(p, str) and p for p in train.freeze):
        raise ConfigError(f"option train.freeze: {train.freeze!r} must be a list of module names or globs")
    if cfg.augment.scale_min > cfg.augment.scale_max:
        raise ConfigError(f"options augment.scale_min ({cfg.augment.scale_min}) and augment.scale_max "
                          f"({cfg.augment.scale_max}): the minimum is above the maximum")
    milestones = cfg.optim.milestones
    if milestones != sorted(set(milestones)) or any(m > 1 and not float(m).is_integer() for m in milestones):
        raise ConfigError(f"option optim.milestones: {milestones} must be increasing epochs, or shares "
                          "of train.epochs below 1")
    cfg.optim.milestones = [int(m) if m >= 1 else m for m in milestones]
    check_input_size(cfg.data.input_size, cfg.model.depth)
    scale = cfg.amp.loss_scale
    if isinstance(scale, str) and scale != "dynamic":
        with contextlib.suppress(ValueError):
            scale = float(scale)          # kept as given: amp reads it with float()
    if scale != "dynamic" and out_of_bounds(scale, LOSS_SCALE):
        raise ConfigError(f"option amp.loss_scale: {scale!r} is not 'dynamic' or a number from 2^-24 to "
                          "2^24 (smaller makes every float16 gradient under 1 zero, larger overflows "
                          "float16 at every step)")
    if len(cfg.loss.scale_weights) != cfg.model.depth + 1:
        raise ConfigError(f"option loss.scale_weights: {len(cfg.loss.scale_weights)} weights for "
                          f"{cfg.model.depth + 1} scales (model.depth + 1)")
