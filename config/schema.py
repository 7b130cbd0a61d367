"""Typed configuration of a run: one dataclass per concern, gathered in `Config`.

Defaults are the method's reference values (../shared/SPEC.md) unless a comment says otherwise.
Presets in `config/presets/*.yaml` override them; the command line overrides the preset
(`config.loader`). Every field is a plain YAML-able value so the resolved config of a run can be
saved next to its checkpoints and in them. What each field accepts (range, list items, choices) is
declared once at the end of this file, in `BOUNDS` and `CHOICES`; `config.loader.validate` applies
it to every value, whether it comes from a preset, the command line or a checkpoint's saved config.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DataConfig:
    train_h5: str = ""          # empty: the project's own synthetic dataset (made once, cached)
    val_h5: str = ""
    synthetic_dir: str = "checkpoints/_synthetic"   # cache of the synthetic dataset
    input_size: int = 512       # network input, square, a multiple of 64
    stride: int = 4             # output stride of the targets
    workers: int = 2            # DataLoader workers per process
    pin_memory: bool = True


@dataclass
class AugmentConfig:
    enabled: bool = True
    person_height: float = 0.6  # main person scaled to this fraction of the input height
    scale_prob: float = 0.8
    scale_min: float = 0.7
    scale_max: float = 1.3
    rotate_deg: float = 40.0
    shift_px: float = 50.0      # at 512 input; scaled with input_size / 512
    flip_prob: float = 0.5
    color_prob: float = 0.2
    hue_shift: float = 10.0     # OpenCV hue units (0-180)
    sat_scale: float = 0.3      # saturation multiplied by 1 +- this
    val_scale: float = 0.3      # value multiplied by 1 +- this


@dataclass
class TargetConfig:
    keypoint_sigma: float = 9.0   # input pixels
    limb_sigma: float = 7.0       # input pixels
    limb_margin: float = 4.0      # input pixels added around the limb's box


@dataclass
class ModelConfig:
    stacks: int = 4
    depth: int = 4                # hourglass levels: returns depth + 1 scales
    channels: int = 256           # stride-4 features
    increase: int = 128           # channels added per level down
    head_channels: int = 256      # the two 3x3 convs before each head
    stem_channels: int = 64       # 7x7 conv output (the stem then goes to 2x this, then `channels`)
    se: bool = True
    se_reduction: int = 16
    init_std: float = 0.001
    max_params_m: float = 1000.0  # refuse to build a network of more million parameters (a typo guard)


@dataclass
class LossConfig:
    gamma: float = 1.0                # focal exponent: 0 plain L2, 1 reference code, 2 paper's best
    focal_threshold: float = 0.01     # G >= this uses |1-P|^gamma, else |P|^gamma
    focal_detach: bool = False        # true: the focal factor is a constant weight (no gradient)
    keypoint_weight: float = 3.0
    mask_weight: float = 0.1
    scale_weights: list = field(default_factory=lambda: [0.1, 0.2, 0.4, 1.6, 6.4])


@dataclass
class OptimConfig:
    name: str = "sgd"             # sgd | adamw
    lr: float = 2.5e-5
    reference_batch: int = 0      # N: LR = lr x total batch / N (batch_size x accumulate, any mode);
                                  # 0: lr at any total batch
    scale_lr_by_world_size: bool = False   # legacy: lr x processes (differs between modes; prefer
                                           # reference_batch)
    momentum: float = 0.9
    weight_decay: float = 5e-4
    betas: list = field(default_factory=lambda: [0.9, 0.999])
    warmup_epochs: float = 3.0
    warmup_start: float = 0.0     # LR multiplier at step 0 of warm-up
    decay_every: int = 15         # epochs; used when milestones is empty (0: no decay)
    milestones: list = field(default_factory=list)
    decay_factor: float = 0.2
    clip_grad_norm: float = 0.0   # 0: off; applied after unscaling
    skip_loss_above: float = 2e5  # a step whose loss exceeds this is skipped
    max_bad_steps: int = 20       # consecutive skipped steps before the run stops
    fused: bool = False           # torch.optim fused kernels (CUDA)


@dataclass
class AmpConfig:
    # O0 fp32 | O1 autocast + scaler | O2 half model, fp32 BN & master | O3 all half
    opt_level: str = "O0"
    dtype: str = "auto"           # float16 | bfloat16 | auto (float16 on CUDA, bfloat16 on CPU)
    keep_batchnorm_fp32: object = None   # None: the opt level's default (True for O2, False for O3)
    loss_scale: object = "dynamic"       # "dynamic" or a number
    init_scale: float = 1024.0    # dynamic scaler start (65536 overflows fp16 early)
    channels_last: object = "auto"       # NHWC model and inputs; auto: on for CUDA (O1 +20-30 % on an
                                         # H100, bench/RESULTS.md), off on CPU
    compile: bool = False         # torch.compile the model
    tf32: bool = True             # CUDA: TF32 tensor cores for float32 convolutions and matmuls (Ampere+)
    backend: str = "native"       # native (torch.amp) | apex (NVIDIA Apex's amp, where installed)


@dataclass
class DistConfig:
    backend: str = "auto"         # auto: nccl on CUDA, gloo on CPU
    sync_bn: bool = False
    delay_allreduce: bool = False # one all-reduce after backward (Apex's option)
    bucket_cap_mb: float = 25.0
    static_graph: bool = False
    broadcast_buffers: bool = True
    find_unused_parameters: bool = False
    zero: bool = False            # ZeroRedundancyOptimizer
    timeout_s: int = 1800
    rendezvous_timeout_s: int = 120   # how long ranks wait for each other to join the group


@dataclass
class InferenceConfig:
    scales: list = field(default_factory=lambda: [1.0])  # x input_size / image height
    flip: bool = False
    peak_threshold: float = 0.1
    refine_radius: int = 2        # 5x5 weighted centroid
    limb_samples: int = 20
    limb_threshold: float = 0.1
    limb_min_ratio: float = 0.8
    max_limb_ratio: float = 16.0
    merge_ratio: float = 0.7
    bridge_ratio: float = 2.5     # join partial people across keypoints missing in both (0: off)
    min_parts: int = 2
    min_mean_score: float = 0.45
    max_people: int = 20
    max_peaks: int = 100          # strongest peaks kept per keypoint type (bounds noisy maps' cost)
    decode_threads: int = 0       # evaluation: images grouped in this many threads while the next one
                                  # runs through the network (0: this machine's cores / its processes, <= 8)
    batch_size: int = 8           # pictures per network pass at input_size x input_size (fewer when
                                  # larger; with flip each goes with its mirror)


@dataclass
class TrainConfig:
    run_name: str = ""            # empty: a timestamped name
    out_dir: str = "checkpoints"
    epochs: int = 100
    batch_size: int = 4           # total over all processes / replicas
    accumulate: int = 1           # batches per optimiser step (gradient accumulation): the step's
                                  # gradient is the mean over accumulate x batch_size samples
    seed: int = 0
    device: str = "auto"          # auto | cpu | cuda | cuda:N
    val_every: int = 1            # epochs between validation-loss passes (0: off)
    ap_every: int = 0             # epochs between validation-AP passes (0: off)
    ap_max_images: int = 0        # 0: every image of the val split
    save_every: int = 0           # keep epoch_N.pth every N epochs (0: only last and best)
    early_stop_patience: int = 0  # validations without improvement before stopping (0: off)
    log_every: int = 20           # iterations between metrics.jsonl lines
    max_steps_per_epoch: int = 0  # 0: the whole epoch
    resume: str = ""              # PATH | auto
    weights: str = ""
    resume_reference: str = ""    # a training checkpoint of the authors: continue their run from it
    allow_partial: bool = False
    freeze: list = field(default_factory=list)
    overwrite: bool = False
    tensorboard: bool = True
    cudnn_benchmark: bool = True  # CUDA: time cuDNN's convolution algorithms once for the fixed input size
    ema: float = 0.0              # decay of an exponential moving average of the weights (0: off),
                                  # validated, AP-scored and saved when on (engine/ema.py)
    ema_tau: float = 2000.0       # optimiser steps: the decay warms up as ema * (1 - exp(-steps / tau))
    val_pictures: int = 4         # validation images drawn after each AP pass (0: none)


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


# -- what each field accepts -------------------------------------------------------------------------
@dataclass(frozen=True)
class Bounds:
    """The values a number field accepts, or each item of a list field: `low` <= value <= `high`
    (`low_open`: `low` < value; `high_open`: value < `high`). Floats must also be finite, whatever
    their bounds."""
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False       # value < `high`
    items: type | None = None     # list fields: int or float items
    min_items: int = 0
    max_items: int | None = None


POSITIVE, NON_NEGATIVE, FRACTION = Bounds(0, low_open=True), Bounds(0), Bounds(0, 1)
COUNT = Bounds(1)                 # an integer that must be at least 1
LAYER = Bounds(1, 8192)           # channel counts: a sanity cap (model.max_params_m bounds the total)

BOUNDS = {
    "data.input_size": Bounds(64, 4096), "data.stride": Bounds(1, 64), "data.workers": Bounds(0, 256),
    "augment.person_height": Bounds(0, 10, low_open=True), "augment.scale_prob": FRACTION,
    "augment.scale_min": Bounds(0, 10, low_open=True), "augment.scale_max": Bounds(0, 10, low_open=True),
    "augment.rotate_deg": Bounds(0, 180), "augment.shift_px": Bounds(0, 4096),
    "augment.flip_prob": FRACTION, "augment.color_prob": FRACTION, "augment.hue_shift": Bounds(0, 180),
    "augment.sat_scale": FRACTION, "augment.val_scale": FRACTION,
    "targets.keypoint_sigma": Bounds(0, 256, low_open=True),
    "targets.limb_sigma": Bounds(0, 256, low_open=True), "targets.limb_margin": Bounds(0, 256),
    "model.stacks": Bounds(1, 64), "model.depth": Bounds(1, 8), "model.channels": LAYER,
    "model.increase": Bounds(0, 8192), "model.head_channels": LAYER, "model.stem_channels": LAYER,
    "model.se_reduction": LAYER, "model.init_std": Bounds(0, 1, low_open=True),
    "model.max_params_m": POSITIVE,
    "loss.gamma": Bounds(0, 16), "loss.focal_threshold": FRACTION, "loss.keypoint_weight": NON_NEGATIVE,
    "loss.mask_weight": NON_NEGATIVE, "loss.scale_weights": Bounds(0, items=float, min_items=1),
    "optim.lr": POSITIVE, "optim.momentum": FRACTION,
    "optim.weight_decay": Bounds(0, 1), "optim.betas": Bounds(0, 1, items=float, min_items=2, max_items=2),
    "optim.warmup_epochs": Bounds(0, 1e6), "optim.warmup_start": FRACTION,
    "optim.decay_every": Bounds(0, 1e6), "optim.milestones": Bounds(1, 1e6, items=int),
    "optim.decay_factor": Bounds(0, 1, low_open=True), "optim.clip_grad_norm": NON_NEGATIVE,
    "optim.skip_loss_above": POSITIVE, "optim.max_bad_steps": Bounds(1, 1e9),
    "amp.init_scale": POSITIVE,
    "dist.bucket_cap_mb": Bounds(0, 1e5, low_open=True), "dist.timeout_s": Bounds(1, 10 ** 7),
    "inference.scales": Bounds(0, 8, low_open=True, items=float, min_items=1, max_items=16),
    "inference.refine_radius": Bounds(0, 32),      # score thresholds: finite, any value (-1: keep all)
    "inference.limb_samples": Bounds(1, 1000),
    "inference.limb_min_ratio": FRACTION, "inference.max_limb_ratio": POSITIVE,
    "inference.merge_ratio": FRACTION, "inference.bridge_ratio": NON_NEGATIVE,
    "inference.min_parts": Bounds(1, 18),
    "inference.max_people": Bounds(1, 10000),
    "inference.max_peaks": Bounds(1, 10000), "inference.decode_threads": Bounds(0, 256),
    "inference.batch_size": Bounds(1, 4096),
    "train.epochs": Bounds(1, 10 ** 6), "train.batch_size": Bounds(1, 65536),
    "train.accumulate": Bounds(1, 65536),
    "optim.reference_batch": Bounds(0, 2 ** 32), "train.seed": Bounds(0, 2 ** 32 - 1),
    "train.val_every": Bounds(0), "train.ap_every": Bounds(0), "train.ap_max_images": Bounds(0),
    "train.save_every": Bounds(0), "train.early_stop_patience": Bounds(0), "train.log_every": COUNT,
    "train.max_steps_per_epoch": Bounds(0), "train.ema": Bounds(0, 1, high_open=True),
    "train.ema_tau": POSITIVE, "train.val_pictures": Bounds(0, 64),
}

CHOICES = {
    "optim.name": ("sgd", "adamw"), "amp.opt_level": ("O0", "O1", "O2", "O3"),
    "amp.dtype": ("auto", "float16", "bfloat16"), "amp.channels_last": ("auto", True, False),
    "amp.keep_batchnorm_fp32": (None, True, False), "amp.backend": ("native", "apex"),
}
