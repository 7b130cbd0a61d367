"""The imhn network computes the reference network's function: the authors' own outputs for
rule-made weights (`tests/data/fidelity`, see its NOTICE.md) are reproduced through our weight
import and our input convention, in eval and in train mode, to < 1e-6 of each map's magnitude."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from data.skeleton import builtin
from config.loader import build_config
from data.preprocess import bgr_to_input
from runtime.checkpoint import load_weights
from models import build_model
from models.reference import PREFIX
from reference_files import GOLDEN, model_entries, rule_weights, tsv_entries

COCO = builtin("coco")

TOLERANCE = 1e-6


def test_our_layout_maps_onto_every_reference_tensor_in_its_order():
    """The name mapping, made from our model's structure, gives the TSV's 1560 names and shapes in
    the file's own order (which is also the order of its optimiser's parameter indices)."""
    cfg = build_config("imhn512").model
    with torch.device("meta"):
        model = build_model(cfg, COCO)
    assert model_entries(model, cfg.depth) == tsv_entries()
    assert len(tsv_entries()) == 1560


def _relative_errors(outputs, golden, mode: str) -> dict[str, float]:
    errors = {}
    for key in golden.files:
        if key.startswith(mode + "_stack"):
            stack, scale = (int(part[-1]) for part in key.split("_")[1:])
            ref = golden[key].astype(np.float64)
            ours = outputs[stack][scale].numpy()
            assert ours.shape == ref.shape, key
            errors[key] = float(np.abs(ours - ref).max() / np.abs(ref).max())
    return errors


@pytest.mark.slow         # many CPU-seconds
def test_imhn_reproduces_the_reference_outputs_in_eval_and_train_mode():
    golden = np.load(GOLDEN)
    cfg = build_config("imhn").model
    with torch.device("meta"):                  # no initialisation: every tensor is loaded below
        model = build_model(cfg, COCO)
    model = model.to_empty(device="cpu").double()
    weights = rule_weights(tsv_entries(), int(golden["salt"]), torch.float64)
    report = load_weights(model, {"weights": {PREFIX + k: v for k, v in weights.items()}})
    assert report["converted"] and report["loaded"] == len(model.state_dict())

    errors = {}
    with torch.no_grad():
        for mode, images in (("eval", golden["eval_bgr"]), ("train", golden["train_bgr"])):
            model.train(mode == "train")        # train: BatchNorm normalises with the batch's statistics
            batch = torch.stack([bgr_to_input(torch.from_numpy(image), torch.float64) for image in images])
            errors.update(_relative_errors(model(batch), golden, mode))
    assert len(errors) == 12
    worst = max(errors, key=errors.get)
    assert errors[worst] < TOLERANCE, f"{worst}: relative error {errors[worst]:.3g}; all: {errors}"


@pytest.mark.parametrize("depth", [4, 2])
def test_reference_order_puts_the_bottom_residual_after_the_deepest_level(depth):
    """Any hourglass depth maps: the bottom residual is slot 4 of the deepest level."""
    cfg = dataclasses.replace(build_config("tiny").model, depth=depth)
    model = build_model(cfg, COCO)
    keys = [k for k, _ in model_entries(model, depth)]
    bottom = [k for k in keys if k.startswith(f"hourglass.0.hg.{depth - 1}.4.")]
    assert bottom and keys.index(bottom[0]) > keys.index(f"hourglass.0.hg.{depth - 1}.3.bn.weight")
    assert len(set(keys)) == len(keys)
