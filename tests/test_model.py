"""The IMHN network: output layout, stable module names, gradients, initialisation, config errors."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from common.errors import ConfigError
from data.skeleton import builtin
from models import FocalL2Loss, build_model

COCO = builtin("coco")
NUM_CHANNELS = COCO.num_channels


@pytest.mark.parametrize("height,width", [(64, 64), (128, 128), (192, 128)])
def test_outputs_every_stack_at_every_scale(tiny_model, tiny_cfg, height, width):
    with torch.no_grad():
        outputs = tiny_model(torch.rand(2, 3, height, width))
    assert len(outputs) == tiny_cfg.model.stacks
    for stack in outputs:
        assert len(stack) == tiny_cfg.model.depth + 1
        for j, out in enumerate(stack):
            stride = 4 * 2 ** j
            assert out.shape == (2, NUM_CHANNELS, height // stride, width // stride)
            assert out.dtype == torch.float32


def test_module_names_are_stable(tiny_model, tiny_cfg):
    names = dict(tiny_model.named_modules())
    last = tiny_cfg.model.stacks - 1
    for name in ("stem", "stem.context", "stacks.0.hourglass", "stacks.0.hourglass.levels.0.skip",
                 "stacks.0.hourglass.bottom", "stacks.0.heads.0.predict", "stacks.0.heads.4.se",
                 "stacks.0.merge.0", f"stacks.{last}.heads.0.predict"):
        assert name in names, name
    assert not any(n.startswith(f"stacks.{last}.merge") for n in names)   # last stack feeds nothing
    assert "stacks.0.heads.0.predict.bias" in dict(tiny_model.named_parameters())


@pytest.mark.slow         # many CPU-seconds
def test_every_parameter_gets_a_gradient(tiny_cfg):
    torch.manual_seed(1)
    model = build_model(tiny_cfg.model, COCO)
    loss_fn = FocalL2Loss(tiny_cfg.loss, COCO)
    outputs = model(torch.rand(2, 3, 64, 64))
    per_sample, _ = loss_fn(outputs, torch.rand(2, NUM_CHANNELS, 16, 16), torch.ones(2, 1, 16, 16))
    per_sample.mean().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing


def test_initial_outputs_are_near_zero(tiny_model):
    torch.manual_seed(2)
    model_in_train_mode = tiny_model.train()
    with torch.no_grad():
        outputs = model_in_train_mode(torch.rand(2, 3, 128, 128))
    for stack in outputs:
        for out in stack:
            assert out.abs().max() < 0.05
            assert out.abs().mean() < 0.01


def test_initialisation_uses_init_std(tiny_cfg):
    cfg = dataclasses.replace(tiny_cfg.model, init_std=0.001)
    torch.manual_seed(3)
    weight = build_model(cfg, COCO).stacks[0].hourglass.levels[0].up_conv[0].weight
    assert abs(weight.std().item() - 0.001) < 0.0002
    assert abs(weight.mean().item()) < 0.0002


def test_model_takes_the_preprocessed_input_as_is(tiny_model):
    """Normalisation lives in data.preprocess only: the stem sees exactly the tensor given."""
    seen = {}
    handle = tiny_model.stem.register_forward_pre_hook(lambda m, args: seen.update(x=args[0]))
    given = torch.rand(2, 3, 64, 64) - 0.5
    with torch.no_grad():
        tiny_model(given)
    handle.remove()
    assert torch.equal(seen["x"], given)


def test_impossible_stem_width_names_the_option(tiny_cfg):
    cfg = dataclasses.replace(tiny_cfg.model, channels=16, stem_channels=8)
    with pytest.raises(ConfigError, match="model.channels"):
        build_model(cfg, COCO)
