"""Configuration: typed config classes, YAML presets and command-line overrides."""
from common.errors import CheckpointError, ConfigError, DataError, TrainingDiverged, UserError
from config.loader import available_presets, build_config, from_dict, to_dict, to_yaml
from config.schema import (AmpConfig, AugmentConfig, Config, DataConfig, DistConfig,
                           InferenceConfig, LossConfig, ModelConfig, OptimConfig, TargetConfig,
                           TrainConfig)

__all__ = [
    "AmpConfig", "AugmentConfig", "CheckpointError", "Config", "ConfigError", "DataConfig",
    "DataError", "DistConfig", "InferenceConfig", "LossConfig", "ModelConfig", "OptimConfig",
    "TargetConfig", "TrainConfig", "TrainingDiverged", "UserError", "available_presets",
    "build_config", "from_dict", "to_dict", "to_yaml",
]
