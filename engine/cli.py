"""The command line shared by the three entry scripts: flags -> resolved `Config`, and error exits.

Named flags cover the common options (Apex's names for mixed precision and DDP); `--set KEY=VALUE`
reaches any config field. With `--resume` and no `--config`, the run's saved config is the base, so
a resumed run trains with what it started with (plus any flag given now).
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

from config.errors import ArgumentParser, CheckpointError, ConfigError, run_cli
from config.loader import deep_update, build_config, nested
from config.yaml_file import read_yaml

DEFAULT_PRESET = "tiny"
REFERENCE_PRESET = "imhn512"     # the authors' published network

# flag dest -> dotted config key
FLAG_KEYS = {
    "train_h5": "data.train_h5", "val_h5": "data.val_h5", "workers": "data.workers",
    "input_size": "data.input_size",
    "epochs": "train.epochs", "batch_size": "train.batch_size", "accumulate": "train.accumulate",
    "seed": "train.seed",
    "run_name": "train.run_name", "out_dir": "train.out_dir", "resume": "train.resume",
    "weights": "train.weights", "resume_reference": "train.resume_reference",
    "allow_partial": "train.allow_partial", "freeze": "train.freeze",
    "overwrite": "train.overwrite", "device": "train.device", "ap_every": "train.ap_every",
    "val_every": "train.val_every", "save_every": "train.save_every",
    "early_stop": "train.early_stop_patience",
    "lr": "optim.lr", "optimizer": "optim.name", "clip_grad": "optim.clip_grad_norm",
    "warmup_epochs": "optim.warmup_epochs", "ema": "train.ema",
    "opt_level": "amp.opt_level", "keep_batchnorm_fp32": "amp.keep_batchnorm_fp32",
    "loss_scale": "amp.loss_scale", "amp_dtype": "amp.dtype",
    "channels_last": "amp.channels_last", "compile": "amp.compile", "amp_backend": "amp.backend",
    "sync_bn": "dist.sync_bn", "delay_allreduce": "dist.delay_allreduce", "zero": "dist.zero",
}


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected True or False, got {text!r}")


def _loss_scale(text: str):
    if text == "dynamic":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'dynamic' or a number, got {text!r}") from None


def build_parser(description: str) -> ArgumentParser:
    p = ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--config", default=None, help=f"preset name (config/presets) or YAML path; default {DEFAULT_PRESET}")
    add("--set", action="append", default=[], metavar="KEY=VALUE",
        help="any config field, e.g. optim.milestones=[30,45]")
    g = p.add_argument_group("data")
    g.add_argument("--train-h5", help="training HDF5 (default: the project's synthetic dataset)")
    g.add_argument("--val-h5", help="validation HDF5 (data.make_hdf5 --split val); with --train-h5 "
                   "and no --val-h5 there is no validation and no best.pth")
    g.add_argument("--workers", type=int, help="DataLoader workers per process")
    g.add_argument("--input-size", type=int, help="network input in pixels, a multiple of 64")
    g = p.add_argument_group("run")
    g.add_argument("--epochs", type=int, help="total epochs (a resumed run continues up to it)")
    g.add_argument("--batch-size", type=int, help="total batch over all processes / GPUs")
    g.add_argument("--accumulate", type=int, metavar="K", help="batches per optimiser step "
                   "(gradient accumulation): K x batch-size samples per step")
    g.add_argument("--seed", type=int, help="weights, sample order and augmentation")
    g.add_argument("--run-name", help="the run directory OUT_DIR/RUN_NAME (default: run-DATE-TIME)")
    g.add_argument("--out-dir", help="parent of run directories (default checkpoints)")
    g.add_argument("--resume", help="checkpoint PATH (the run continues in its folder), or 'auto': "
                   "the newest one of the run")
    g.add_argument("--weights", help="initial weights only (fine-tuning); also the authors' layout")
    g.add_argument("--resume-reference", metavar="FILE",
                   help="continue the authors' training run from their checkpoint: weights, SGD "
                        f"momentum, loss scale, next epoch (default config {REFERENCE_PRESET})")
    g.add_argument("--allow-partial", action="store_true", default=None,
                   help="with --weights: load the keys that match")
    g.add_argument("--freeze", nargs="+", action="extend", metavar="PATTERN",
                   help="module-name prefixes or globs to freeze (repeatable: the patterns add up)")
    g.add_argument("--overwrite", action="store_true", default=None, help="replace an existing run directory")
    g.add_argument("--device", help="auto | cpu | cuda | cuda:N")
    g.add_argument("--val-every", type=int, help="epochs between validation-loss passes (0: off)")
    g.add_argument("--ap-every", type=int, help="epochs between validation-AP passes (0: off)")
    g.add_argument("--save-every", type=int, help="also keep epoch_N.pth every N epochs")
    g.add_argument("--early-stop", type=int, metavar="N", help="stop after N validations without improvement")
    g = p.add_argument_group("optimisation")
    g.add_argument("--lr", type=float, help="peak learning rate, after warm-up")
    g.add_argument("--optimizer", choices=["sgd", "adamw"])
    g.add_argument("--clip-grad", type=float, metavar="MAX_NORM")
    g.add_argument("--warmup-epochs", type=float)
    g.add_argument("--ema", type=float, metavar="DECAY",
                   help="validate, score and keep in best.pth an exponential moving average of the "
                        "weights with this decay, e.g. 0.9998 (warmed up over train.ema_tau steps; "
                        "default 0: off)")
    g = p.add_argument_group("mixed precision (Apex's names)")
    g.add_argument("--opt-level", help="O0 float32 | O1 autocast | O2 half model, "
                                       "float32 BN and master weights | O3 all half")
    g.add_argument("--keep-batchnorm-fp32", type=_bool, nargs="?", const=True, metavar="True|False",
                   help="BatchNorm in float32 under O2/O3 (default: True for O2, False for O3)")
    g.add_argument("--loss-scale", type=_loss_scale, metavar="dynamic|NUMBER",
                   help="float16 loss scale: dynamic (GradScaler) or fixed")
    g.add_argument("--amp-dtype", choices=["auto", "float16", "bfloat16"],
                   help="half type of O1-O3; auto: float16 on CUDA, bfloat16 on CPU")
    g.add_argument("--channels-last", type=_bool, nargs="?", const=True, metavar="True|False",
                   help="NHWC memory format for model and inputs (default: on for CUDA, off on CPU)")
    g.add_argument("--compile", action="store_true", default=None, help="torch.compile the model")
    g.add_argument("--amp-backend", metavar="native|apex",
                   help="native: torch.amp (default); apex: NVIDIA Apex's amp.initialize, "
                        "apex.parallel DDP and SyncBN (Apex 25.04 or older, CUDA only)")
    g = p.add_argument_group("multi-process")
    g.add_argument("--sync-bn", action="store_true", default=None, help="batch norm over all processes")
    g.add_argument("--delay-allreduce", action="store_true", default=None,
                   help="one all-reduce after backward")
    g.add_argument("--zero", action="store_true", default=None,
                   help="shard optimiser state (ZeroRedundancyOptimizer)")
    return p


def _saved_config(resume: str, run_name: str | None, out_dir: str | None) -> tuple[Path | None, dict | None]:
    """(checkpoint, the config stored in it) that --resume will load, if it can be found."""
    from engine.resume import latest_checkpoint, read_state
    from engine.run_setup import newest_run_dir
    if resume == "auto":
        base = Path(out_dir or "checkpoints")
        run_dir = base / run_name if run_name else newest_run_dir(base)
        path = latest_checkpoint(run_dir) if run_dir and run_dir.is_dir() else None
    else:
        path = Path(resume)
    if not path or not path.is_file():
        return None, None
    saved = copy.deepcopy(read_state(path).get("config"))   # read once: the trainer resumes from it
    if saved is not None and not (isinstance(saved, dict) and isinstance(saved.get("train"), dict)):
        raise CheckpointError(f"checkpoint {path}: its saved config is damaged (not a mapping of config "
                              "sections); resume with --config PRESET to give the settings anew")
    return path, saved


# what names one run, not how to train: never taken over from another run's saved config (the run
# directory of a resume is where its checkpoint is, or --run-name: not the name saved in it)
RUN_IDENTITY = {"resume": "", "weights": "", "resume_reference": "", "overwrite": False,
                "run_name": ""}


def _config_from_checkpoint(path: Path, saved: dict, overrides: dict, sets: list[str]):
    """The resumed run's config: its checkpoint's, then the flags given now. A field this version
    no longer knows, or a value it no longer accepts, is named with the file and how to go on."""
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
    """Whether --config is a run's own config.yaml (the trainer writes a top-level `preset` key,
    which a preset file does not have)."""
    if not config or not Path(config).is_file():
        return False
    try:
        data = read_yaml(config)
    except ConfigError:
        return False                      # build_config reports it
    return isinstance(data, dict) and "preset" in data


def _weights_network(path: str) -> tuple[dict | None, tuple]:
    """(model settings, presets that may build it) of the network a --weights file holds, when the
    file says: a checkpoint of this trainer carries its config; a file of the authors', its shapes."""
    from config.errors import CheckpointError
    from runtime.checkpoint import load_checkpoint, reference_file_settings
    try:
        saved = load_checkpoint(path, mmap=True).get("config")
    except CheckpointError:               # a bare state dict, or a bad file: the trainer says which
        return reference_file_settings(path), (REFERENCE_PRESET, DEFAULT_PRESET)
    if not isinstance(saved, dict) or not isinstance(saved.get("model"), dict):
        return None, ()
    return saved["model"], (saved.get("preset"),)


def _check_weights_network(cfg) -> None:
    """--weights or --resume-reference from a checkpoint of another network: say which model
    settings differ and how to build it, instead of a list of hundreds of mismatched tensors."""
    from config.loader import to_dict
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
            preset_model = _preset_model(preset)
            if preset_model is not None and all(preset_model.get(k) == v for k, v in saved.items()):
                fix = f"--config {preset}"
                break
        partial = ", or --allow-partial to load only the tensors that fit" if option == "--weights" else ""
        raise ConfigError(f"{option} {path} holds another network ({listed_difference(differ)}): "
                          f"add {fix} to build it{partial}")


def _preset_model(preset: str) -> dict | None:
    from config.loader import to_dict
    try:
        return to_dict(build_config(preset))["model"]
    except ConfigError:
        return None


def config_from_args(args: argparse.Namespace):
    """The run's config from the flags; a backend that cannot run here (`--amp-backend apex`
    without Apex, CUDA, ...) is refused now, before anything is built."""
    from engine.precision import check_backend
    cfg = _resolve_config(args)
    check_backend(cfg)
    return cfg


def _resolve_config(args: argparse.Namespace):
    overrides: dict = {}
    for dest, key in FLAG_KEYS.items():
        value = getattr(args, dest, None)
        if value is not None:
            deep_update(overrides, nested(key, value))
    if args.resume and not args.config:
        path, saved = _saved_config(args.resume, args.run_name, args.out_dir)
        if saved:
            return _config_from_checkpoint(path, saved, overrides, args.set)
    if _is_saved_run_config(args.config):
        # another run's config.yaml as --config: a new run with its settings, not that run itself
        flags, overrides = overrides, {"train": dict(RUN_IDENTITY, run_name="")}
        deep_update(overrides, flags)
    default = REFERENCE_PRESET if getattr(args, "resume_reference", None) else DEFAULT_PRESET
    cfg = build_config(args.config or default, overrides, args.set)
    if not cfg.train.resume:
        _check_weights_network(cfg)
    return cfg


def run_main(main, argv=None) -> None:
    """Entry point of the train scripts: `main(argv)`, errors as one line (`config.errors.run_cli`)."""
    sys.exit(run_cli(main, argv))


def single_process_context(device: str):
    """The context of a one-process run (train.py, train_parallel.py) on `device`. A GPU other than
    0 becomes the current device, or the DataLoader's pinning thread would open a CUDA context on
    GPU 0 as well."""
    import torch
    from runtime.distributed import DistContext
    from runtime.launch_env import Launch, resolve_device
    dev = resolve_device(device, Launch())
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return DistContext(device=dev)
