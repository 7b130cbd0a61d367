"""Freezing: patterns by prefix and glob, frozen weights and BatchNorm statistics bit-identical
through real optimizer steps while the rest trains, and errors for useless patterns."""
from __future__ import annotations

from collections import OrderedDict
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from common.errors import ConfigError
from engine.freeze import freeze, set_frozen_bn_eval, trainable_parameters
from engine.hooks import FrozenBatchNorm


def block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(OrderedDict(conv=nn.Conv2d(cin, cout, 3, padding=1), bn=nn.BatchNorm2d(cout),
                                     act=nn.LeakyReLU(0.01)))


def tiny_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(
        stem=block(3, 4), stems=block(4, 4),
        stacks=nn.ModuleList([nn.Sequential(OrderedDict(a=block(4, 4), b=block(4, 4)))
                              for _ in range(2)]),
        head=nn.Conv2d(4, 2, 1)))


def frozen_names(model: nn.Module) -> set[str]:
    return {name for name, p in model.named_parameters() if not p.requires_grad}


def test_prefix_matches_whole_name_parts_only():
    model = tiny_net()
    report = freeze(model, ["stem"])
    assert frozen_names(model) == {"stem.conv.weight", "stem.conv.bias", "stem.bn.weight", "stem.bn.bias"}
    assert report["frozen"] == 4 * 3 * 9 + 4 + 4 + 4 and report["modules"] == ["stem"]
    assert report["trainable"] == sum(p.numel() for p in model.parameters()) - report["frozen"]


def test_glob_and_dotted_prefix():
    model = tiny_net()
    report = freeze(model, ["stacks.0.*", "stacks.1.b.conv"])
    assert frozen_names(model) == (
        {f"stacks.0.{part}.{layer}.{kind}" for part in "ab" for layer in ("conv", "bn")
         for kind in ("weight", "bias")} | {"stacks.1.b.conv.weight", "stacks.1.b.conv.bias"})
    assert report["modules"] == ["stacks.0.a", "stacks.0.b", "stacks.1.b.conv"]
    assert len(trainable_parameters(model)) == 26 - 10


def test_pattern_matching_nothing_names_the_top_level_modules():
    model = tiny_net()
    with pytest.raises(ConfigError, match="'stacks.5' matches no module.*stem, stems, stacks, head"):
        freeze(model, ["stem", "stacks.5"])
    assert frozen_names(model) == set()                 # nothing frozen by a failed call


def test_freezing_everything_is_an_error():
    model = tiny_net()
    with pytest.raises(ConfigError, match="nothing would be left to train"):
        freeze(model, ["stem*", "stacks", "head"])
    with pytest.raises(ConfigError, match="nothing would be left to train"):
        freeze(model, ["*"])
    assert frozen_names(model) == set()


def test_frozen_parts_bit_identical_through_sgd_steps_while_the_rest_trains():
    model = tiny_net()
    report = freeze(model, ["stem", "stacks.0.*"])
    frozen_before = {k: v.clone() for k, v in model.state_dict().items()
                     if k.startswith(("stem.", "stacks.0."))}
    others_before = {k: v.clone() for k, v in model.state_dict().items()
                     if k.startswith(("stems.", "stacks.1.", "head.")) and "num_batches" not in k}
    optimizer = torch.optim.SGD(trainable_parameters(model), lr=0.1, momentum=0.9, weight_decay=5e-4)
    assert not any(p is q for p in optimizer.param_groups[0]["params"] for q in model.stem.parameters())
    for step in range(3):
        model.train()
        assert set_frozen_bn_eval(model, report["all_modules"]) == 3
        assert not model.stem.bn.training and model.stems.bn.training
        images = torch.randn(2, 3, 8, 8) * 3 + 1
        optimizer.zero_grad()
        output = model[3](model[2][1](model[2][0](model[1](model[0](images)))))
        output.square().mean().backward()
        optimizer.step()
    assert all(p.grad is None for p in model.stem.parameters())
    assert len(optimizer.state) == len(trainable_parameters(model))    # no state for frozen ones
    after = model.state_dict()
    for key, value in frozen_before.items():
        assert torch.equal(after[key], value), key
    for key, value in others_before.items():
        assert not torch.equal(after[key], value), key


def test_batchnorm_without_parameters_in_a_frozen_part_stays_in_eval():
    model = nn.Sequential(OrderedDict(stem=nn.Sequential(nn.Conv2d(3, 4, 1),
                                                         nn.BatchNorm2d(4, affine=False)),
                                      bn=nn.BatchNorm2d(4, affine=False), head=nn.Conv2d(4, 1, 1)))
    report = freeze(model, ["stem"])
    model.train()
    assert set_frozen_bn_eval(model, report["all_modules"]) == 1
    assert not model.stem[1].training and model.bn.training
    model.stem[1] = nn.BatchNorm2d(4, affine=False)        # replaced since (SyncBN): by name, no mark
    FrozenBatchNorm(report["all_modules"]).before_epoch(SimpleNamespace(model=model.train()), 0)
    assert not model.stem[1].training and model.bn.training
