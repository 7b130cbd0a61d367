"""Parameter and MAC counting, and the paper's network size (129.0 M params, 268.5 GMAC at 512)."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from data.skeleton import builtin
from config.loader import build_config
from models.imhn import build_model
from models.summary import count_macs, count_parameters, main

COCO = builtin("coco")


def test_imhn_preset_matches_the_paper():
    with torch.device("meta"):
        model = build_model(build_config("imhn").model, COCO)
    params = count_parameters(model)
    macs, per_module = count_macs(model, 512)
    assert abs(params / 129.0e6 - 1) < 0.01, params
    assert abs(macs / 268.5e9 - 1) < 0.02, macs
    assert sum(per_module.values()) == macs


def test_macs_of_a_conv_and_a_linear_layer():
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(8, 4))
    total, per_module = count_macs(model, (16, 12))
    assert per_module == {"0": 16 * 12 * 8 * 3 * 9, "4": 8 * 4}
    assert total == 16 * 12 * 8 * 3 * 9 + 32
    assert count_parameters(model) == (3 * 8 * 9 + 8) + 2 * 8 + (8 * 4 + 4)
    assert model.training and model[0].weight.device.type == "cpu"   # model left as it was


def test_cli_ends_with_one_json_line(capsys):
    assert main(["--preset", "tiny", "--input", "128"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    model = build_model(build_config("tiny").model, COCO)
    assert result["parameters"] == count_parameters(model)
    assert result["macs"] == count_macs(model, 128)[0]
    assert any(line.startswith("stacks.0.hourglass") for line in lines[:-1])


def test_cli_rejects_an_input_size_the_network_cannot_take(capsys):
    assert main(["--preset", "tiny", "--input", "100"]) == 2
    assert "--input: 100 is not a positive multiple of 64" in capsys.readouterr().err


def test_cli_takes_config_like_train_py_and_names_itself(capsys):
    assert main(["--config", "tiny"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["input"] == 128
    assert result["parameters"] == count_parameters(build_model(build_config("tiny").model, COCO))
    with pytest.raises(SystemExit):
        main(["--help"])
    assert capsys.readouterr().out.startswith("usage: python -m models.summary")
