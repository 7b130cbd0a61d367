"""What a layer below the engine needs of a run's `Config`, where that spans sections.

The data and inference layers never receive the whole `Config`: a function takes the section it
needs (`InferenceConfig`, ...) or one of the small frozen views here, built by its `of`, so what it
reads is in its signature. A view built in code is checked as a config is (`config.loader`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from common.errors import ConfigError
from config.loader import check_input_size, check_section, check_value
from config.schema import AugmentConfig, Config, InferenceConfig, TargetConfig


@dataclass(frozen=True)
class SampleSettings:
    """How `data.dataset.KeypointDataset` makes a sample: the network input (`input_size` square),
    the targets' stride and widths, the augmentation, and the seed its random draws start from."""

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
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ConfigError(f"option train.seed: {self.seed!r} is not a whole number")
        check_value("train.seed", self.seed)

    @classmethod
    def of(cls, cfg: Config) -> "SampleSettings":
        return cls(cfg.data.input_size, cfg.data.stride, cfg.augment, cfg.targets, cfg.train.seed)


@dataclass(frozen=True)
class PredictSettings:
    """How the inference layer turns pictures into people: its `inference` section (scales, flip,
    grouping, batches), the network's input size a scale is relative to, and the target widths the
    evaluation's oracle draws ground-truth maps with."""

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
