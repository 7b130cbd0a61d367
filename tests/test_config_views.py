"""The views of `config.views` that the data and inference layers receive: made from a run's config
by `.of`, and checked as a config is when code builds one (a `ConfigError` naming the option)."""
from __future__ import annotations

import re

import pytest

from common.errors import ConfigError
from config.loader import build_config
from config.schema import AugmentConfig, InferenceConfig, TargetConfig
from config.views import PredictSettings, SampleSettings


def test_of_takes_the_parts_of_a_runs_config():
    cfg = build_config("tiny", sets=["train.seed=7", "inference.flip=true"])
    samples, predict = SampleSettings.of(cfg), PredictSettings.of(cfg)
    assert (samples.input_size, samples.stride, samples.seed) == (128, 4, 7)
    assert samples.augment is cfg.augment and samples.targets is cfg.targets
    assert predict.inference is cfg.inference and predict.inference.flip
    assert (predict.input_size, predict.targets) == (128, cfg.targets)


@pytest.mark.parametrize("build,says", [
    (lambda: PredictSettings(InferenceConfig(peak_threshold=float("nan")), 512),
     "option inference.peak_threshold: nan is not a finite number"),
    (lambda: PredictSettings(InferenceConfig(scales=[]), 512),
     "option inference.scales: [] must have 1 to 16"),
    (lambda: PredictSettings(InferenceConfig(), 500),
     "option data.input_size: 500 is not a positive multiple of 64"),
    (lambda: PredictSettings(InferenceConfig(), "512"),
     "option data.input_size: '512' is not a whole number"),
    (lambda: PredictSettings(InferenceConfig(), 512, TargetConfig(limb_sigma=0)),
     "option targets.limb_sigma"),
    (lambda: SampleSettings(512, 8, AugmentConfig(), TargetConfig()), "option data.stride: 8"),
    (lambda: SampleSettings(512, 4, AugmentConfig(rotate_deg=float("inf")), TargetConfig()),
     "option augment.rotate_deg: inf is not a finite number"),
    (lambda: SampleSettings(512, 4, AugmentConfig(), TargetConfig(), -1),
     "option train.seed: -1 must be >= 0"),
    (lambda: SampleSettings(512, 4, AugmentConfig(), TargetConfig(), 1.5),
     "option train.seed: 1.5 is not a whole"),
])
def test_a_view_built_in_code_is_checked_as_a_config_is(build, says):
    with pytest.raises(ConfigError, match="^" + re.escape(says)):
        build()
