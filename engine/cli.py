"""The command line of the three train scripts: flags (declared in config/schema.py) -> `Config`;
with `--resume` and no `--config`, the run's saved config is the base."""
from __future__ import annotations

import argparse
import contextlib
import copy
import os
import sys
from pathlib import Path

from common.errors import ArgumentParser, CheckpointError, ConfigError, refuse_inapplicable, run_cli
from config.loader import (build_config, deep_update, differences, nested, read_preset, read_yaml, setting,
                           to_dict)
from config.schema import CHANGES, KEPT, REFERENCE_PRESET, add_flags, declared, flags

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
RUN_IDENTITY = {"resume": "", "weights": "", "resume_reference": "", "overwrite": False, "run_name": ""}


def _config_from_checkpoint(path: Path, saved: dict, overrides: dict, sets: list[str],
                            preset: str | None = None) -> tuple:
    """(the resumed run's config, the lines naming what it changes): its checkpoint's, then what
    `preset` sets, then the flags given now, compared with it by `_resume_changes`."""
    saved["train"].update(RUN_IDENTITY)
    held = copy.deepcopy(saved)
    if preset:
        given, overrides = overrides, read_preset(preset)
        deep_update(overrides, given)
    try:
        base = build_config(None, held)
        deep_update(saved, overrides)
        cfg = build_config(None, saved, sets)
    except ConfigError as exc:
        try:
            build_config(preset, overrides, sets)
        except ConfigError:
            raise exc from None             # the flags given now are wrong, not the saved config
        raise ConfigError(f"the config saved in checkpoint {path} does not fit this version: {exc}. "
                          "Resume with --config PRESET (plus --set for what that run changed) to give "
                          "the settings anew; the weights and optimiser state are still loaded") from None
    return cfg, _resume_changes(base, cfg, path, f"--config {preset}" if preset else "this resume", held)


def _resume_changes(base, cfg, path: Path, given: str, held: dict) -> list[str]:
    """A line per setting `cfg` changes from the run's (`base`) that a resume may change or the saved
    config `held` lacks; ConfigError naming those it keeps (config/schema.py's `option(resume=)`)."""
    from engine.optim import milestone_epochs
    differ = differences(to_dict(base), to_dict(cfg))
    differ.pop("preset", None)
    held = _leaf_keys(held)                 # the keys the saved config holds
    kept = {key: pair for key, pair in differ.items()
            if declared(key)["resume"] in (None, KEPT) and key in held}
    if kept:
        listed = "; ".join(f"{setting(key)} from {old!r} to {new!r}"
                           for key, (old, new) in list(kept.items())[:4])
        more = f" and {len(kept) - 4} more" if len(kept) > 4 else ""
        raise ConfigError(f"{given} changes {listed}{more} of the run in {path.parent}, which a resume keeps "
                          "(the run would change silently): leave out what differs or give the run's value; "
                          f"to train with the new settings, start a new run with --weights {path}")
    moved = [milestone_epochs(c.optim, c.train.epochs) for c in (base, cfg)]
    also = {"train.epochs": f": LR milestones {cfg.optim.milestones} move from epochs {moved[0]} to "
                            f"{moved[1]}" if moved[0] != moved[1] else ""}
    return [f"{setting(key)} changes from {old!r} to {new!r}{also.get(key, '')}" if key in held else
            f"{setting(key)} is {new!r} (the run's saved config, of an older version, has no value)"
            for key, (old, new) in differ.items() if declared(key)["resume"] == CHANGES or key not in held]


def _leaf_keys(data: dict, prefix: str = "") -> set[str]:
    """The dotted keys of the values in nested mappings `data`."""
    return {leaf for key, value in data.items() for leaf in (
        _leaf_keys(value, f"{prefix}{key}.") if isinstance(value, dict) else [f"{prefix}{key}"])}


def _check_weights_network(cfg) -> None:
    """Weights of another network: say which model settings differ, not hundreds of tensors."""
    from runtime.checkpoint import (listed_difference, load_checkpoint, reference_file_settings,
                                    settings_difference)
    for option, path, partial in (("--weights", cfg.train.weights, cfg.train.allow_partial),
                                  ("--resume-reference", cfg.train.resume_reference, False)):
        if not path or partial or not Path(path).is_file():
            continue
        try:                              # the model settings, and presets that may build it
            run = load_checkpoint(path, mmap=True).get("config")
            run = run if isinstance(run, dict) and isinstance(run.get("model"), dict) else {}
            saved, presets = run.get("model"), (run.get("preset"),)
        except CheckpointError:           # a bare state dict, or a bad file: the trainer says which
            saved, presets = reference_file_settings(path), (REFERENCE_PRESET, DEFAULT_PRESET)
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
    """The run's config from the flags, refused when its backend cannot run here; a resume's changes said."""
    import torch
    from engine.precision import BACKENDS, check_backend
    cfg, lines = _resolve_config(args, reader)
    check_backend(cfg)
    level = cfg.amp.opt_level           # the flags given now that would have no effect in this run
    half = BACKENDS[cfg.amp.backend].half_dtype(cfg.amp, cfg.train.device)
    float16 = level != "O0" and half == torch.float16
    for flag, off, where, why in (
            ("--loss-scale", not float16, "to this run", "only float16 training (O1-O3, --amp-dtype float16 "
             "or auto on CUDA) scales its loss"),
            ("--amp-dtype", level == "O0", "at --opt-level O0", "it trains in float32"),
            ("--keep-batchnorm-fp32", level in ("O0", "O1"), f"at --opt-level {level}", "only O2 and O3 "
             "turn the model's BatchNorm into half precision"),
            ("--allow-partial", not cfg.train.weights, "without --weights", "it loads the tensors of "
             "--weights that fit the model"),
            ("--early-stop", not (cfg.train.val_every or cfg.train.ap_every), "with --val-every 0 and "
             "--ap-every 0", "it counts validations, and there are none")):
        if off:
            refuse_inapplicable({flag: getattr(args, flag[2:].replace("-", "_"))}, where, why)
    if os.environ.get("RANK", "0") == "0":
        for line in lines:
            print(line, flush=True)
    return cfg


def _resolve_config(args: argparse.Namespace, reader=None) -> tuple:
    """(the run's config, the lines saying what a resume changes or --config RUN/config.yaml leaves out)."""
    overrides: dict = {}
    for key, flag in flags():
        value = getattr(args, flag.name.lstrip("-").replace("-", "_"), None)    # argparse's dest
        if value is not None:
            deep_update(overrides, nested(key, value))
    run_config = None       # another run's config.yaml (a top-level `preset`): its settings, not that run
    with contextlib.suppress(ConfigError):                  # build_config reports it
        found = read_yaml(args.config) if args.config and Path(args.config).is_file() else None
        run_config = found if isinstance(found, dict) and "preset" in found else None
    if run_config:
        given, overrides = overrides, {"train": dict(RUN_IDENTITY, run_name="")}
        deep_update(overrides, given)
    if args.resume:
        from engine.checkpoints import CheckpointReader
        path, saved = _saved_config(args.resume, args.run_name, args.out_dir, reader or CheckpointReader())
        if saved:       # the run's config is the base; its own preset given again changes nothing
            same = not args.config or args.config == saved.get("preset")
            return _config_from_checkpoint(path, saved, overrides, args.set, None if same else args.config)
    default = REFERENCE_PRESET if getattr(args, "resume_reference", None) else DEFAULT_PRESET
    cfg = build_config(args.config or default, overrides, args.set)
    if not cfg.train.resume:
        _check_weights_network(cfg)
    if not run_config or args.resume:
        return cfg, []
    theirs, config = run_config.get("train") or {}, Path(args.config)    # what it leaves out of that run
    name, weights = theirs.get("run_name") or config.parent.name, theirs.get("weights")
    return cfg, [f"--config {config}: a new run with that run's settings but not its run name {name}"
                 + (f" nor its --weights {weights}" if weights else "")
                 + f": it trains from {cfg.train.weights or 'scratch'}; to continue that run instead: "
                 f"--resume auto --run-name {name} --out-dir {theirs.get('out_dir') or config.parent.parent}"]


def run_main(main, argv=None) -> None:
    """Entry point of the train scripts: `main(argv)`, errors as one line (`common.errors.run_cli`)."""
    sys.exit(run_cli(main, argv))


def single_process_context(device: str):
    """The context of a one-process run on `device` (made the current CUDA device)."""
    import torch
    from runtime.distributed import DistContext
    from runtime.launch_env import ProcessPlace, resolve_device
    dev = resolve_device(device, ProcessPlace())
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return DistContext(device=dev)
