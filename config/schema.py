"""Typed configuration of a run: a dataclass per concern in `Config`, each field declared once with what it
accepts (`option(bounds=, choices=)`), maybe its `flag`; defaults: SPEC's unless a comment says otherwise."""
from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Iterable, Iterator


@dataclass(frozen=True)
class Bounds:
    """The (finite) values a number field, or each item of a list field, accepts."""
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False       # value < `high`
    items: type | None = None     # list fields: int or float items
    min_items: int = 0
    max_items: int | None = None


POSITIVE, NON_NEGATIVE, FRACTION = Bounds(0, low_open=True), Bounds(0), Bounds(0, 1)
# A loss scale lies in [2^-24, 2^24]: above Apex's largest, a static scale overflows float16 at
# every step; below float16's smallest value, nearly every gradient becomes 0.
MIN_LOSS_SCALE, MAX_LOSS_SCALE = 2.0 ** -24, 2.0 ** 24
LOSS_SCALE = Bounds(MIN_LOSS_SCALE, MAX_LOSS_SCALE)
# the numbers of the files the project reads, beside the config's fields (`config.loader.out_of_bounds`):
# a checkpoint's loss scaler (GradScaler's names; a scale above 2^24 continues from 2^24, said) and EMA,
# a skeleton file's OKS sigmas (COCO's: 0.025-0.107) and PCK threshold
FILE_FIELDS = {"scaler.scale": Bounds(MIN_LOSS_SCALE), "scaler.growth_factor": Bounds(1, 16, low_open=True),
               "scaler.backoff_factor": Bounds(1 / 16, 1, high_open=True),
               "scaler.growth_interval": Bounds(1, 2 ** 31), "scaler._growth_tracker": Bounds(0),
               "ema.updates": Bounds(0), "skeleton.sigmas": Bounds(0, 1, low_open=True),
               "skeleton.pck_threshold": Bounds(0, 1, low_open=True)}
LAYER = Bounds(1, 8192)           # channel counts: a sanity cap (model.max_params_m bounds the total)


@dataclass(frozen=True)
class Flag:
    """A field's command-line flag: name, --help group, help and other `add_argument` options."""
    name: str
    group: str
    help: str | None = None
    options: tuple = ()            # (name, value) pairs for add_argument


# what a resume does with a value given again that differs from the run's: refuses it (KEPT: it would
# change the run silently), applies it saying so (CHANGES), or never compares it (NAMES_RUN)
KEPT, CHANGES, NAMES_RUN = "kept", "changes", "names the run"


def option(default: Any = MISSING, *, factory=None, bounds: Bounds | None = None,
           choices: tuple | None = None, flag: Flag | None = None, why: str | None = None,
           resume: str = KEPT):
    """A field with what it accepts (`bounds`, `choices`, and `why`, said when a value is refused),
    its command-line `flag` and what a resume does with another value (`resume`)."""
    return field(default=default, default_factory=factory or MISSING,
                 metadata={"bounds": bounds, "choices": choices, "flag": flag, "why": why, "resume": resume})


def flag(name: str, group: str, help: str | None = None, **options) -> Flag:
    return Flag(name, group, help, tuple(options.items()))


# the flags' groups, in the order --help shows them; the training scripts take the first five
DATA, RUN, OPTIMISATION, PRECISION, MULTI_PROCESS, INFERENCE = (
    "data", "run", "optimisation", "mixed precision (Apex's names)", "multi-process", "inference")
FLAG_GROUPS = (DATA, RUN, OPTIMISATION, PRECISION, MULTI_PROCESS)
REFERENCE_PRESET = "imhn512"     # the authors' published network


def parse_bool(text: str) -> bool:
    """A flag's True|False (1/0, yes/no, on/off)."""
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected True or False, got {text!r}")


def parse_loss_scale(text: str):
    if text == "dynamic":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'dynamic' or a number, got {text!r}") from None


@dataclass
class DataConfig:
    train_h5: str = option("",
        flag=flag("--train-h5", DATA, help="training HDF5 (default: the project's synthetic dataset)"))
    val_h5: str = option("",
        flag=flag("--val-h5", DATA,
                  help="validation HDF5 (data.make_hdf5 --split val); with --train-h5 and no --val-h5 there"
                       " is no validation and no best.pth"))
    synthetic_dir: str = "checkpoints/_synthetic"   # cache of the synthetic dataset
    input_size: int = option(512, bounds=Bounds(64, 4096),
        flag=flag("--input-size", DATA, type=int, help="network input in pixels, a multiple of 64"))
    stride: int = option(4, choices=(4,), why="the network's output stride is 4")   # of the targets
    workers: int = option(2, resume=CHANGES, bounds=Bounds(0, 256),
        flag=flag("--workers", DATA, type=int, help="DataLoader workers per process"))
    pin_memory: bool = option(True, resume=CHANGES)
    # a batch the workers have not handed over after this long ends the run: one is stuck (0: wait forever)
    batch_timeout_s: int = option(600, resume=CHANGES, bounds=Bounds(0, 10 ** 7))


@dataclass
class AugmentConfig:
    enabled: bool = True
    # main person scaled to this fraction of the input height
    person_height: float = option(0.6, bounds=Bounds(0, 10, low_open=True))
    scale_prob: float = option(0.8, bounds=FRACTION)
    scale_min: float = option(0.7, bounds=Bounds(0, 10, low_open=True))
    scale_max: float = option(1.3, bounds=Bounds(0, 10, low_open=True))
    rotate_deg: float = option(40.0, bounds=Bounds(0, 180))
    shift_px: float = option(50.0, bounds=Bounds(0, 4096))      # at 512 input; scaled with input_size / 512
    flip_prob: float = option(0.5, bounds=FRACTION)
    color_prob: float = option(0.2, bounds=FRACTION)
    hue_shift: float = option(10.0, bounds=Bounds(0, 180))     # OpenCV hue units (0-180)
    sat_scale: float = option(0.3, bounds=FRACTION)      # saturation multiplied by 1 +- this
    val_scale: float = option(0.3, bounds=FRACTION)      # value multiplied by 1 +- this


@dataclass
class TargetConfig:
    keypoint_sigma: float = option(9.0, bounds=Bounds(0, 256, low_open=True))   # input pixels
    limb_sigma: float = option(7.0, bounds=Bounds(0, 256, low_open=True))       # input pixels
    limb_margin: float = option(4.0, bounds=Bounds(0, 256))      # input pixels added around the limb's box


@dataclass
class ModelConfig:
    stacks: int = option(4, bounds=Bounds(1, 64))
    depth: int = option(4, bounds=Bounds(1, 8))                # hourglass levels: returns depth + 1 scales
    channels: int = option(256, bounds=LAYER)           # stride-4 features
    increase: int = option(128, bounds=Bounds(0, 8192))           # channels added per level down
    head_channels: int = option(256, bounds=LAYER)      # the two 3x3 convs before each head
    stem_channels: int = option(64, bounds=LAYER)      # 7x7 conv output (the stem: 2x this, then `channels`)
    se: bool = True
    se_reduction: int = option(16, bounds=LAYER)
    init_std: float = option(0.001, bounds=Bounds(0, 1, low_open=True))
    max_params_m: float = option(1000.0, bounds=POSITIVE)     # million parameters at most (a typo guard)


@dataclass
class LossConfig:
    gamma: float = option(1.0, bounds=Bounds(0, 16))  # focal exponent: 0 L2, 1 reference code, 2 paper's best
    focal_threshold: float = option(0.01, bounds=FRACTION)     # G >= this uses |1-P|^gamma, else |P|^gamma
    focal_detach: bool = False        # true: the focal factor is a constant weight (no gradient)
    keypoint_weight: float = option(3.0, bounds=NON_NEGATIVE)
    mask_weight: float = option(0.1, bounds=NON_NEGATIVE)
    scale_weights: list[float] = option(
        factory=lambda: [0.1, 0.2, 0.4, 1.6, 6.4], bounds=Bounds(0, items=float, min_items=1))


@dataclass
class OptimConfig:
    name: str = option("sgd", choices=("sgd", "adamw"), flag=flag("--optimizer", OPTIMISATION))
    lr: float = option(2.5e-5, resume=CHANGES, bounds=Bounds(0, 1e30, low_open=True),   # more overflows AdamW
        flag=flag("--lr", OPTIMISATION, type=float, help="peak learning rate, after warm-up"))
    reference_batch: int = option(0, bounds=Bounds(0, 2 ** 32))
    scale_lr_by_world_size: bool = False   # legacy: lr x processes (differs by mode; use reference_batch)
    momentum: float = option(0.9, bounds=FRACTION)
    weight_decay: float = option(5e-4, bounds=Bounds(0, 1))
    betas: list[float] = option(
        factory=lambda: [0.9, 0.999], bounds=Bounds(0, 1, items=float, min_items=2, max_items=2))
    warmup_epochs: float = option(3.0, bounds=Bounds(0, 1e6),
        flag=flag("--warmup-epochs", OPTIMISATION, type=float))
    warmup_start: float = option(0.0, bounds=FRACTION)     # LR multiplier at step 0 of warm-up
    decay_every: int = option(15, bounds=Bounds(0, 1e6))   # epochs, when milestones is empty (0: no decay)
    milestones: list[float] = option(factory=list, bounds=Bounds(0, 1e6, low_open=True, items=float))
    decay_factor: float = option(0.2, bounds=Bounds(0, 1, low_open=True))
    clip_grad_norm: float = option(0.0, resume=CHANGES, bounds=NON_NEGATIVE,   # 0: off; after unscaling
        flag=flag("--clip-grad", OPTIMISATION, type=float, metavar="MAX_NORM"))
    skip_loss_above: float = option(2e5, resume=CHANGES, bounds=POSITIVE)
    max_bad_steps: int = option(20, resume=CHANGES, bounds=Bounds(1, 1e9))
    fused: str | bool = option("auto", choices=("auto", True, False))   # fused kernels; auto: CUDA + native


@dataclass
class AmpConfig:
    opt_level: str = option("O0", choices=("O0", "O1", "O2", "O3"),
        flag=flag("--opt-level", PRECISION,
                  help="O0 float32 | O1 autocast | O2 half model, float32 BN and master weights | O3 all "
                       "half"))
    dtype: str = option("auto", choices=("auto", "float16", "bfloat16"),
        flag=flag("--amp-dtype", PRECISION,
                  help="half type of O1-O3; auto: float16 on CUDA, bfloat16 on CPU"))
    keep_batchnorm_fp32: bool | None = option(None, choices=(None, True, False),
        flag=flag("--keep-batchnorm-fp32", PRECISION, type=parse_bool, nargs="?", const=True,
                  metavar="True|False",
                  help="BatchNorm in float32 under O2/O3 (default: True for O2, False for O3)"))
    loss_scale: str | float = option("dynamic",
        flag=flag("--loss-scale", PRECISION, type=parse_loss_scale, metavar="dynamic|NUMBER",
                  help="float16 loss scale: dynamic (GradScaler) or fixed"))
    # dynamic scaler start (65536 overflows fp16 early); a larger one halves at each overflow
    init_scale: float = option(1024.0, bounds=LOSS_SCALE)
    channels_last: str | bool = option("auto", resume=CHANGES, choices=("auto", True, False),
        flag=flag("--channels-last", PRECISION, type=parse_bool, nargs="?", const=True, metavar="True|False",
                  help="NHWC memory format for model and inputs (default: on for CUDA, off on CPU)"))
    compile: bool = option(False, resume=CHANGES,
        flag=flag("--compile", PRECISION, action="store_true", default=None, help="torch.compile the model"))
    cuda_graphs: str | bool = option("auto", resume=CHANGES, choices=("auto", True, False),
        flag=flag("--cuda-graphs", PRECISION, type=parse_bool, nargs="?", const=True, metavar="True|False",
                  help="replay the network's training forward and backward as CUDA graphs (default: on "
                       "for one CUDA process with the native backend, without --compile)"))
    tf32: bool = option(True, resume=CHANGES)   # CUDA: TF32 tensor cores for float32 convs, matmuls
    backend: str = option("native", resume=CHANGES, choices=("native", "apex"),
        flag=flag("--amp-backend", PRECISION, metavar="native|apex",
                  help="native: torch.amp (default); apex: NVIDIA Apex's amp.initialize, apex.parallel DDP "
                       "and SyncBN (Apex 25.04 or older, CUDA only)"))


@dataclass
class DistConfig:
    backend: str = "auto"         # auto: nccl on CUDA, gloo on CPU
    sync_bn: bool = option(False, resume=CHANGES,
        flag=flag("--sync-bn", MULTI_PROCESS, action="store_true", default=None,
                  help="batch norm over all processes"))
    delay_allreduce: bool = option(False, resume=CHANGES,
        flag=flag("--delay-allreduce", MULTI_PROCESS, action="store_true", default=None,
                  help="one all-reduce after backward"))
    bucket_cap_mb: float = option(25.0, bounds=Bounds(0, 1e5, low_open=True))
    static_graph: bool = False
    broadcast_buffers: bool = True
    find_unused_parameters: bool = False
    zero: bool = option(False,
        flag=flag("--zero", MULTI_PROCESS, action="store_true", default=None,
                  help="shard optimiser state (ZeroRedundancyOptimizer)"))
    timeout_s: int = option(1800, resume=CHANGES, bounds=Bounds(1, 10 ** 7))
    rendezvous_timeout_s: int = option(120, resume=CHANGES, bounds=Bounds(1, 10 ** 7))  # wait for all ranks
    heartbeat_timeout_s: int = option(20, resume=CHANGES, bounds=Bounds(3, 10 ** 7))


@dataclass
class InferenceConfig:
    scales: list[float] = option(
        factory=lambda: [1.0], resume=CHANGES,
        bounds=Bounds(0, 8, low_open=True, items=float, min_items=1, max_items=16),
        flag=flag("--scales", INFERENCE, type=float, nargs="+",
                  help="image heights to run, in units of input_size (1: input_size px; default: the "
                       "config's)"))
    flip: bool = option(False, resume=CHANGES,
        flag=flag("--flip", INFERENCE, action=argparse.BooleanOptionalAction, default=None,
                  help="also run the mirror image (default: the config's)"))
    # compared with the network's maps, which hold any value (2: no peak; -1: every sample)
    peak_threshold: float = 0.1
    refine_radius: int = option(2, bounds=Bounds(0, 32))        # 5x5 weighted centroid
    limb_samples: int = option(20, bounds=Bounds(1, 1000))
    limb_threshold: float = 0.1
    limb_min_ratio: float = option(0.8, bounds=FRACTION)
    max_limb_ratio: float = option(16.0, bounds=POSITIVE)
    merge_ratio: float = option(0.7, bounds=FRACTION)
    bridge_ratio: float = option(2.5, bounds=NON_NEGATIVE)
    min_parts: int = option(2, bounds=Bounds(1, 18))
    min_mean_score: float = 0.45
    max_people: int = option(20, bounds=Bounds(1, 10000))
    # strongest peaks kept per keypoint type (bounds noisy maps' cost)
    max_peaks: int = option(100, bounds=Bounds(1, 1000))
    decode_threads: int = option(0, resume=CHANGES, bounds=Bounds(0, 256))
    # pictures per network pass at input_size x input_size (fewer when larger)
    batch_size: int = option(8, resume=CHANGES, bounds=Bounds(1, 4096))


@dataclass
class TrainConfig:
    run_name: str = option("", resume=NAMES_RUN,
        flag=flag("--run-name", RUN, help="the run directory OUT_DIR/RUN_NAME (default: run-DATE-TIME)"))
    out_dir: str = option("checkpoints", resume=NAMES_RUN,
        flag=flag("--out-dir", RUN, help="parent of run directories (default checkpoints)"))
    epochs: int = option(100, resume=CHANGES, bounds=Bounds(1, 10 ** 6),
        flag=flag("--epochs", RUN, type=int, help="total epochs (a resumed run continues up to it)"))
    batch_size: int = option(4, bounds=Bounds(1, 65536),
        flag=flag("--batch-size", RUN, type=int, help="total batch over all processes / GPUs"))
    # a resume may change it: checkpoints count loader batches, so the run goes on from the same one
    accumulate: int = option(1, resume=CHANGES, bounds=Bounds(1, 65536),
        flag=flag("--accumulate", RUN, type=int, metavar="K",
                  help="batches per optimiser step (gradient accumulation): K x batch-size samples per step"))
    seed: int = option(0, bounds=Bounds(0, 2 ** 32 - 1),
        flag=flag("--seed", RUN, type=int, help="weights, sample order and augmentation"))
    device: str = option("auto", resume=CHANGES,
        flag=flag("--device", RUN, help="auto | cpu | cuda | cuda:N"))
    val_every: int = option(1, resume=CHANGES, bounds=Bounds(0),
        flag=flag("--val-every", RUN, type=int, help="epochs between validation-loss passes (0: off)"))
    ap_every: int = option(0, resume=CHANGES, bounds=Bounds(0),
        flag=flag("--ap-every", RUN, type=int, help="epochs between validation-AP passes (0: off)"))
    ap_max_images: int = option(0, resume=CHANGES, bounds=Bounds(0))        # 0: every image of the val split
    save_every: int = option(0, resume=CHANGES, bounds=Bounds(0),
        flag=flag("--save-every", RUN, type=int, help="also keep epoch_N.pth every N epochs"))
    early_stop_patience: int = option(0, resume=CHANGES, bounds=Bounds(0),
        flag=flag("--early-stop", RUN, type=int, metavar="N",
                  help="stop after N validations without improvement"))
    log_every: int = option(20, resume=CHANGES, bounds=Bounds(1))   # iterations between metrics.jsonl lines
    max_steps_per_epoch: int = option(0, resume=CHANGES, bounds=Bounds(0))  # 0: the whole epoch
    resume: str = option("", resume=NAMES_RUN,
        flag=flag("--resume", RUN,
                  help="checkpoint PATH (the run continues in its folder), or 'auto': the newest one of the"
                       " run"))
    weights: str = option("", resume=NAMES_RUN,
        flag=flag("--weights", RUN, help="initial weights only (fine-tuning); also the authors' layout"))
    resume_reference: str = option("", resume=NAMES_RUN,
        flag=flag("--resume-reference", RUN, metavar="FILE",
                  help="continue the authors' training run from their checkpoint: weights, SGD momentum, "
                       f"loss scale, next epoch (default config {REFERENCE_PRESET})"))
    allow_partial: bool = option(False,
        flag=flag("--allow-partial", RUN, action="store_true", default=None,
                  help="with --weights: load the keys that match"))
    freeze: list[str] = option(factory=list,
        flag=flag("--freeze", RUN, nargs="+", action="extend", metavar="PATTERN",
                  help="module-name prefixes or globs to freeze (repeatable: the patterns add up)"))
    overwrite: bool = option(False, resume=NAMES_RUN,
        flag=flag("--overwrite", RUN, action="store_true", default=None,
                  help="replace an existing run directory"))
    tensorboard: bool = option(True, resume=CHANGES)
    cudnn_benchmark: bool = option(True, resume=CHANGES)   # CUDA: time cuDNN's convs once per input size
    ema: float = option(0.0, resume=CHANGES, bounds=Bounds(0, 1, high_open=True),
        flag=flag("--ema", OPTIMISATION, type=float, metavar="DECAY",
                  help="validate, score and keep in best.pth an exponential moving average of the weights "
                       "with this decay, e.g. 0.9998 (warmed up over train.ema_tau steps; default 0: off)"))
    ema_tau: float = option(2000.0, bounds=POSITIVE)   # steps: the decay is ema * (1 - exp(-steps / tau))
    val_pictures: int = option(4, resume=CHANGES, bounds=Bounds(0, 64))   # drawn after each AP pass


@dataclass
class Config:
    preset: str = ""
    data: DataConfig = field(default_factory=DataConfig)
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    targets: TargetConfig = field(default_factory=TargetConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    amp: AmpConfig = field(default_factory=AmpConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


def declared(key: str) -> dict:
    """{"bounds", "choices", "flag", "why", "resume"} of option `key` ("train.seed"); None: not declared."""
    section, _, name = key.partition(".")
    kind = {f.name: f for f in fields(Config)}.get(section)
    fld = {f.name: f for f in fields(kind.default_factory)}.get(name) if kind and name else None
    return {k: fld.metadata.get(k) if fld else None for k in ("bounds", "choices", "flag", "why", "resume")}


def flags() -> Iterator[tuple[str, Flag]]:
    """(dotted key, its flag) of every field that has one, in the order of `Config`'s fields."""
    for section in fields(Config):
        if section.name == "preset":
            continue
        for fld in fields(section.default_factory):
            if fld.metadata.get("flag") is not None:
                yield f"{section.name}.{fld.name}", fld.metadata["flag"]


def add_flags(parser: argparse.ArgumentParser, keys: Iterable[str] | None = None,
              set_example: str = "optim.milestones=[30,45]") -> None:
    """Add to `parser` `--set KEY=VALUE` and the flags of the fields `keys` (default: training's)."""
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help=f"override any config field, e.g. {set_example}")
    groups = {name: parser.add_argument_group(name) for name in FLAG_GROUPS} if keys is None else {}
    for key, flg in flags():
        if (flg.group in FLAG_GROUPS) if keys is None else key in keys:
            options, choices = dict(flg.options), declared(key)["choices"]
            if choices and not {"type", "action"} & set(options):
                options["choices"] = list(choices)
            groups.get(flg.group, parser).add_argument(flg.name, help=flg.help, **options)
