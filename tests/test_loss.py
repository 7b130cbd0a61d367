"""The multi-task focal L2 loss: exact values, masking, per-sample normalisation, float32 under AMP."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from config.loader import build_config
from config.schema import LossConfig
from data.skeleton import builtin
from models import FocalL2Loss, build_model

COCO = builtin("coco")
KEYPOINT_CHANNELS = COCO.keypoint_channels
NUM_CHANNELS = COCO.num_channels

SIZES = [(16, 16), (8, 8), (4, 4), (2, 2), (1, 1)]   # five scales of a 64x64 input


def random_outputs(batch, stacks=2, requires_grad=False):
    return [[torch.rand(batch, NUM_CHANNELS, h, w, requires_grad=requires_grad) for h, w in SIZES]
            for _ in range(stacks)]


@pytest.mark.parametrize("gamma,expected", [(0.0, 148.925), (2.0, 37.23125)])
def test_value_matches_the_formula_by_hand(gamma, expected):
    """Scale weights [1, 3] -> [0.25, 0.75]; P = 0.5 everywhere; G = 1 on channel 30, 0 elsewhere.

    Every element has (P - G)^2 = 0.25. Channel weights sum to 30 limbs + 18 x 3 keypoints + 0.1
    mask + 1 max = 85.1, so with gamma 0 a pixel costs 21.275: scale 0 (16 px) 340.4, scale 1
    (4 px) 85.1, and 0.25 * 340.4 + 0.75 * 85.1 = 148.925. With gamma 2 every element is also
    multiplied by 0.5^2 = 0.25 -> 37.23125. Both stacks are equal, so their mean is the same.
    """
    loss_fn = FocalL2Loss(LossConfig(gamma=gamma, scale_weights=[1.0, 3.0]), COCO)
    target = torch.zeros(1, NUM_CHANNELS, 4, 4)
    target[:, KEYPOINT_CHANNELS.start] = 1.0
    stack = [torch.full((1, NUM_CHANNELS, 4, 4), 0.5), torch.full((1, NUM_CHANNELS, 2, 2), 0.5)]
    per_sample, parts = loss_fn([stack, stack], target, torch.ones(1, 1, 4, 4))
    assert per_sample.shape == (1,)
    assert per_sample.item() == pytest.approx(expected, rel=1e-6)
    assert parts["stack0"].item() == pytest.approx(expected, rel=1e-6)


def test_focal_factor_switches_at_the_threshold():
    loss_fn = FocalL2Loss(LossConfig(gamma=2.0, scale_weights=[1.0]), COCO)
    prediction = torch.full((1, NUM_CHANNELS, 1, 1), 0.2)
    below = torch.full((1, NUM_CHANNELS, 1, 1), 0.005)    # G < 0.01: |P|^gamma
    above = torch.full((1, NUM_CHANNELS, 1, 1), 0.02)     # G >= 0.01: |1 - P|^gamma
    ones = torch.ones(1, 1, 1, 1)
    assert loss_fn.element_loss(prediction, below, ones)[0, 0, 0, 0].item() == \
        pytest.approx(0.195 ** 2 * 0.2 ** 2)
    assert loss_fn.element_loss(prediction, above, ones)[0, 0, 0, 0].item() == \
        pytest.approx(0.18 ** 2 * 0.8 ** 2)


@pytest.mark.parametrize("detach,expected_grad", [(False, 2 * 0.1 * 0.4 - 0.1 ** 2), (True, 2 * 0.1 * 0.4)])
def test_focal_factor_gradient_option(detach, expected_grad):
    loss_fn = FocalL2Loss(LossConfig(gamma=1.0, scale_weights=[1.0], focal_detach=detach), COCO)
    prediction = torch.full((1, NUM_CHANNELS, 1, 1), 0.6, requires_grad=True)
    target = torch.full((1, NUM_CHANNELS, 1, 1), 0.5)
    per_sample, _ = loss_fn([[prediction]], target, torch.ones(1, 1, 1, 1))
    per_sample.sum().backward()
    assert prediction.grad[0, 0, 0, 0].item() == pytest.approx(expected_grad, rel=1e-5)


@pytest.mark.parametrize("gamma", [0.0, 1.0, 2.0])
def test_perfect_prediction_has_zero_loss(gamma):
    loss_fn = FocalL2Loss(LossConfig(gamma=gamma), COCO)
    target = torch.rand(2, NUM_CHANNELS, 16, 16)
    stack = [F.adaptive_avg_pool2d(target, size) for size in SIZES]
    per_sample, parts = loss_fn([stack, stack], target, torch.ones(2, 1, 16, 16))
    assert torch.equal(per_sample, torch.zeros(2))
    wrong, _ = loss_fn([stack, [s + 0.1 for s in stack]], target, torch.ones(2, 1, 16, 16))
    assert (wrong > 0).all()


def test_masked_region_contributes_nothing_to_loss_or_gradient():
    torch.manual_seed(0)
    loss_fn = FocalL2Loss(LossConfig(gamma=1.0), COCO)
    target = torch.rand(2, NUM_CHANNELS, 16, 16)
    mask = torch.ones(2, 1, 16, 16)
    mask[..., :8] = 0          # left half unsupervised, at every scale
    outputs = random_outputs(2, requires_grad=True)
    per_sample, _ = loss_fn(outputs, target, mask)
    per_sample.sum().backward()
    changed = [[(o.detach().clone()) for o in stack] for stack in outputs]
    for stack_out, stack_changed in zip(outputs, changed):
        for out, new in zip(stack_out, stack_changed):
            half = out.shape[-1] // 2
            assert torch.equal(out.grad[..., :half], torch.zeros_like(out.grad[..., :half]))
            assert out.grad[..., half:].abs().sum() > 0
            new[..., :half] = 5.0
    again, _ = loss_fn(changed, target, mask)
    assert torch.allclose(again, per_sample.detach())


def test_batch_loss_is_the_mean_of_its_halves():
    torch.manual_seed(1)
    loss_fn = FocalL2Loss(LossConfig(gamma=2.0), COCO)
    outputs = random_outputs(4)
    target = torch.rand(4, NUM_CHANNELS, 16, 16)
    mask = (torch.rand(4, 1, 16, 16) > 0.2).float()
    whole, _ = loss_fn(outputs, target, mask)
    first, _ = loss_fn([[o[:2] for o in s] for s in outputs], target[:2], mask[:2])
    second, _ = loss_fn([[o[2:] for o in s] for s in outputs], target[2:], mask[2:])
    assert torch.allclose(whole, torch.cat([first, second]))
    assert whole.mean().item() == pytest.approx(((first.mean() + second.mean()) / 2).item(), rel=1e-6)


def test_parts_add_up_to_the_total():
    torch.manual_seed(2)
    loss_fn = FocalL2Loss(LossConfig(), COCO)
    per_sample, parts = loss_fn(random_outputs(3), torch.rand(3, NUM_CHANNELS, 16, 16),
                                torch.ones(3, 1, 16, 16))
    assert all(v.shape == (3,) and v.dtype == torch.float32 for v in parts.values())
    groups = parts["keypoints"] + parts["limbs"] + parts["person_mask"] + parts["keypoint_max"]
    assert torch.allclose(groups, per_sample)
    assert torch.allclose(sum(parts[f"scale{j}"] for j in range(5)), per_sample)
    assert torch.allclose((parts["stack0"] + parts["stack1"]) / 2, per_sample)


def test_loss_is_float32_under_bfloat16_autocast():
    cfg = build_config("tiny")
    torch.manual_seed(3)
    model = build_model(dataclasses.replace(cfg.model, stacks=1), COCO)
    loss_fn = FocalL2Loss(cfg.loss, COCO)
    target = torch.rand(2, NUM_CHANNELS, 16, 16)
    mask = torch.ones(2, 1, 16, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outputs = model(torch.rand(2, 3, 64, 64))
        per_sample, parts = loss_fn(outputs, target, mask)
    assert outputs[0][0].dtype == torch.bfloat16
    assert per_sample.dtype == torch.float32
    assert all(v.dtype == torch.float32 for v in parts.values())
    reference, _ = loss_fn([[o.float() for o in s] for s in outputs], target, mask)
    assert torch.allclose(per_sample, reference)
