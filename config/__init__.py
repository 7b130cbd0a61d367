"""Configuration: typed config classes, YAML presets and command-line overrides."""
from config.loader import available_presets, build_config, to_dict, to_yaml
from config.schema import Config

__all__ = ["Config", "available_presets", "build_config", "to_dict", "to_yaml"]
