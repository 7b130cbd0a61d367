"""Small frozen views of a run's `Config` (built by `of`, checked as a config is) for the data and
inference layers, which never receive the whole `Config`: what a function reads is in its signature."""
from __future__ import annotations

from dataclasses import dataclass, field

from common.errors import ConfigError
from config.loader import check_input_size, check_section, check_value, out_of_bounds
from config.schema import AugmentConfig, Config, InferenceConfig, TargetConfig, declared


@dataclass(frozen=True)
class SampleSettings:
    """How `KeypointDataset` makes a sample: input size, targets, augmentation and seed."""

    input_size: int
    stride: int
    augment: AugmentConfig
    targets: TargetConfig
    seed: int = 0

    def __post_init__(self):
        check_input_size(self.input_size)
        check_value("data.stride", self.stride)
        check_section(self.augment, "augment")
        check_section(self.targets, "targets")
        if problem := out_of_bounds(self.seed, declared("train.seed")["bounds"], whole=True):
            raise ConfigError(f"option train.seed: {self.seed!r} {problem}")

    @classmethod
    def of(cls, cfg: Config) -> "SampleSettings":
        return cls(cfg.data.input_size, cfg.data.stride, cfg.augment, cfg.targets, cfg.train.seed)


@dataclass(frozen=True)
class PredictSettings:
    """How pictures become people: the `inference` section, the input size, the oracle's widths."""

    inference: InferenceConfig
    input_size: int
    targets: TargetConfig = field(default_factory=TargetConfig)

    def __post_init__(self):
        check_input_size(self.input_size)
        check_section(self.inference, "inference")
        check_section(self.targets, "targets")

    @classmethod
    def of(cls, cfg: Config) -> "PredictSettings":
        return cls(cfg.inference, cfg.data.input_size, cfg.targets)


@dataclass(frozen=True)
class EvalOptions:
    """How `inference.evaluation.evaluate_h5` runs: the first `max_images` images (0: all), the
    ground-truth maps instead of a network (`oracle`), where rank 0 writes the results, the model's
    `skeleton` (refused when not the file's), the metrics (`scoring`: the file's skeleton's when
    None) and whether `keypoint_recall` is added."""

    max_images: int = 0
    progress: bool = True
    oracle: bool = False
    results_path: object = None
    overwrite: bool = True
    skeleton: object = None
    scoring: object = None
    recall: bool = False
