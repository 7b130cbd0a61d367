"""The command line shared by the three entry scripts: flags -> resolved `Config`, and error exits.
Flags are declared beside their fields in config/schema.py; `--set KEY=VALUE` reaches any field.
With `--resume` and no `--config`, the run's saved config is the base.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import sys
from pathlib import Path

from common.errors import ArgumentParser, CheckpointError, ConfigError, run_cli
from config.loader import deep_update, build_config, nested, to_dict
from config.schema import REFERENCE_PRESET, add_flags, flags
from config.yaml_file import read_yaml

DEFAULT_PRESET = "tiny"


def build_parser(description: str) -> ArgumentParser:
    """--config, --set and the flags that config/schema.py declares beside their fields."""
    p = ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None,
                   help=f"preset name (config/presets) or YAML path; default {DEFAULT_PRESET}")
    add_flags(p)
    return p


def _saved_config(resume: str, run_name: str | None, out_dir: str | None,
                  reader) -> tuple[Path | None, dict | None]:
    """(checkpoint, its stored config) that --resume will load, if found; read with `reader`. A run
    killed before its first checkpoint: (its config.yaml, that config)."""
    from engine.run_dir import newest_run_dir, run_config
    if resume == "auto":
        base = Path(out_dir or "checkpoints")
        run_dir = base / run_name if run_name else newest_run_dir(base)
        if run_config(run_dir):
            return run_dir / "config.yaml", read_yaml(run_dir / "config.yaml")
        path = reader.latest(run_dir) if run_dir and run_dir.is_dir() else None
    else:
        path = Path(resume)
    if not path or not path.is_file():
        return None, None
    saved = copy.deepcopy(reader.state(path).get("config"))   # read once: the trainer resumes from it
    if saved is not None and not (isinstance(saved, dict) and isinstance(saved.get("train"), dict)):
        raise CheckpointError(f"checkpoint {path}: its saved config is damaged (not a mapping of config "
                              "sections); resume with --config PRESET to give the settings anew")
    return path, saved


# what names one run: never taken over from a saved config
RUN_IDENTITY = {"resume": "", "weights": "", "resume_reference": "", "overwrite": False,
                "run_name": ""}


def _config_from_checkpoint(path: Path, saved: dict, overrides: dict, sets: list[str]):
    """The resumed run's config: its checkpoint's, then the flags given now."""
    saved["train"].update(RUN_IDENTITY)
    deep_update(saved, overrides)
    try:
        return build_config(None, saved, sets)
    except ConfigError as exc:
        try:
            build_config(None, overrides, sets)
        except ConfigError:
            raise exc from None             # the flags given now are wrong, not the saved config
        raise ConfigError(f"the config saved in checkpoint {path} does not fit this version: {exc}. "
                          "Resume with --config PRESET (plus --set for what that run changed) to give "
                          "the settings anew; the weights and optimiser state are still loaded") from None


def _is_saved_run_config(config: str | None) -> bool:
    """Whether --config is a run's own config.yaml (it has a top-level `preset` key)."""
    if not config or not Path(config).is_file():
        return False
    try:
        data = read_yaml(config)
    except ConfigError:
        return False                      # build_config reports it
    return isinstance(data, dict) and "preset" in data


def _weights_network(path: str) -> tuple[dict | None, tuple]:
    """(model settings, presets that may build it) of the network in a --weights file, if known."""
    from runtime.checkpoint import load_checkpoint, reference_file_settings
    try:
        saved = load_checkpoint(path, mmap=True).get("config")
    except CheckpointError:               # a bare state dict, or a bad file: the trainer says which
        return reference_file_settings(path), (REFERENCE_PRESET, DEFAULT_PRESET)
    if not isinstance(saved, dict) or not isinstance(saved.get("model"), dict):
        return None, ()
    return saved["model"], (saved.get("preset"),)


def _check_weights_network(cfg) -> None:
    """Weights of another network: say which model settings differ, not hundreds of tensors."""
    from runtime.checkpoint import listed_difference, settings_difference

    for option, path, partial in (("--weights", cfg.train.weights, cfg.train.allow_partial),
                                  ("--resume-reference", cfg.train.resume_reference, False)):
        if not path or partial or not Path(path).is_file():
            continue
        saved, presets = _weights_network(path)
        differ = settings_difference(saved, to_dict(cfg)["model"]) if saved else None
        if not differ:
            continue
        fix = " ".join(f"--set model.{k}={str(v).lower() if isinstance(v, bool) else v}"
                       for k, (v, _) in differ.items())
        for preset in filter(None, presets):
            with contextlib.suppress(ConfigError):       # a preset that does not build: not the fix
                if all(to_dict(build_config(preset))["model"].get(k) == v for k, v in saved.items()):
                    fix = f"--config {preset}"
                    break
        partial = ", or --allow-partial to load only the tensors that fit" if option == "--weights" else ""
        raise ConfigError(f"{option} {path} holds another network ({listed_difference(differ)}): "
                          f"add {fix} to build it{partial}")


def config_from_args(args: argparse.Namespace, reader=None):
    """The run's config from the flags, refused now when its backend cannot run here."""
    from engine.precision import check_backend
    cfg = _resolve_config(args, reader)
    check_backend(cfg)
    return cfg


def _resolve_config(args: argparse.Namespace, reader=None):
    overrides: dict = {}
    for key, flag in flags():
        value = getattr(args, flag.name.lstrip("-").replace("-", "_"), None)    # argparse's dest
        if value is not None:
            deep_update(overrides, nested(key, value))
    if args.resume and not args.config:
        from engine.train_state import CheckpointReader
        path, saved = _saved_config(args.resume, args.run_name, args.out_dir, reader or CheckpointReader())
        if saved:
            return _config_from_checkpoint(path, saved, overrides, args.set)
    if _is_saved_run_config(args.config):
        # another run's config.yaml as --config: a new run with its settings, not that run itself
        given, overrides = overrides, {"train": dict(RUN_IDENTITY, run_name="")}
        deep_update(overrides, given)
    default = REFERENCE_PRESET if getattr(args, "resume_reference", None) else DEFAULT_PRESET
    cfg = build_config(args.config or default, overrides, args.set)
    if not cfg.train.resume:
        _check_weights_network(cfg)
    return cfg


def run_main(main, argv=None) -> None:
    """Entry point of the train scripts: `main(argv)`, errors as one line (`common.errors.run_cli`)."""
    sys.exit(run_cli(main, argv))


def single_process_context(device: str):
    """The context of a one-process run on `device` (made the current CUDA device)."""
    import torch
    from runtime.distributed import DistContext
    from runtime.launch_env import Launch, resolve_device
    dev = resolve_device(device, Launch())
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return DistContext(device=dev)
