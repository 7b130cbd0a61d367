"""The weights EMA (engine/ema.py, --ema): the warmed-up decay, float32 at every opt level, steps
that were skipped, validation with the averaged weights, exact state round trips, and the
checkpoint's EMA weights taken by --weights, evaluate.py and demo.py."""
from __future__ import annotations

import math

import pytest
import torch

from config import build_config
from common.errors import CheckpointError, ConfigError
from config.loader import to_dict
from data.skeleton import builtin
from engine.precision import NativePrecision as Precision
from models.checkpoint_weights import preferred_weights
from runtime.checkpoint import save_checkpoint
from engine.ema import WeightsEMA
from engine.trainer import StepResult
from models import build_model

COCO = builtin("coco")


def step(skipped: bool) -> StepResult:
    """What `run_step` hands the hooks, for a step that was or was not skipped."""
    return StepResult(loss=1.0, lr=0.1, skipped=skipped, stop=False)


def tiny_model(seed: int = 0):
    torch.manual_seed(seed)
    return build_model(build_config("tiny").model, COCO)


def prepared(level: str, dtype: str = "bfloat16"):
    """(model, precision) of the tiny network as the trainer prepares it at `level`."""
    cfg = build_config("tiny", sets=[f"amp.opt_level={level}", f"amp.dtype={dtype}"])
    precision = Precision(cfg.amp, torch.device("cpu"))
    return precision.prepare_model(tiny_model()), precision


def nudge(model, precision, seed: int) -> None:
    """Change every trainable weight (the masters under O2, copied to the model as a step does) and
    every BatchNorm statistic, as a training step would."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        params = precision.optimizer_params([p for p in model.parameters() if p.requires_grad])
        for p in params:
            p.add_(torch.randn(p.shape, generator=generator).to(p.dtype) * 0.01)
        for param, master in precision._pairs:
            param.copy_(master)
        for name, buf in model.named_buffers():
            if "running_mean" in name:
                buf.add_(1.0)


def test_decay_warms_up_and_the_average_follows_the_formula():
    model, precision = prepared("O0")
    ema = WeightsEMA(0.9, 2.0).attach(model, precision)
    name = "stem.0.weight" if "stem.0.weight" in ema.averaged else next(
        n for n, p in model.named_parameters())
    expected = dict(model.named_parameters())[name].detach().double().clone()
    for k in range(1, 5):
        nudge(model, precision, k)
        ema.after_step(None, step(skipped=False))
        d = 0.9 * (1 - math.exp(-k / 2.0))
        assert ema.current_decay() == pytest.approx(d)
        expected = d * expected + (1 - d) * dict(model.named_parameters())[name].detach().double()
        assert torch.allclose(ema.averaged[name].double(), expected, rtol=0, atol=1e-6)
    assert ema.updates == 4
    # buffers are copied, not averaged
    for bname, buf in model.named_buffers():
        assert torch.equal(ema.averaged[bname], buf.float() if buf.is_floating_point() else buf)


def test_a_skipped_step_leaves_the_average_as_it_was():
    model, precision = prepared("O0")
    ema = WeightsEMA(0.9, 1.0).attach(model, precision)
    nudge(model, precision, 1)
    ema.after_step(None, step(skipped=False))
    before = {k: v.clone() for k, v in ema.averaged.items()}
    nudge(model, precision, 2)
    ema.after_step(None, step(skipped=True))
    assert ema.updates == 1
    assert all(torch.equal(before[k], ema.averaged[k]) for k in before)


def test_o2_averages_the_float32_masters_and_o3_the_half_model_in_float32():
    model, precision = prepared("O2")
    ema = WeightsEMA(0.5, 1e-9).attach(model, precision)     # d = 0.5 from the first update
    masters = {id(p): m for p, m in precision._pairs}
    names = {id(p): n for n, p in model.named_parameters()}
    start = {names[pid]: m.detach().clone() for pid, m in masters.items()}
    nudge(model, precision, 1)
    ema.update()
    assert all(v.dtype == torch.float32 for v in ema.averaged.values() if v.is_floating_point())
    half_weights = [n for n, p in model.named_parameters() if p.dtype != torch.float32]
    assert half_weights, "O2 should have half weights"
    for pid, master in masters.items():
        name = names[pid]
        assert torch.equal(ema.averaged[name], torch.lerp(start[name], master.detach(), 0.5))
    model3, precision3 = prepared("O3")
    ema3 = WeightsEMA(0.5, 1e-9).attach(model3, precision3)
    assert all(v.dtype == torch.float32 for v in ema3.averaged.values() if v.is_floating_point())
    weight = next(p for p in model3.parameters())
    assert weight.dtype == torch.bfloat16
    assert torch.equal(ema3.averaged[next(n for n, _ in model3.named_parameters())], weight.float())


@pytest.mark.slow         # many CPU-seconds
def test_validation_sees_the_average_and_training_gets_its_weights_back_bit_for_bit():
    model, precision = prepared("O2")
    ema = WeightsEMA(0.9, 1.0).attach(model, precision)
    nudge(model, precision, 1)
    ema.update()
    nudge(model, precision, 2)
    training = {k: v.clone() for k, v in model.state_dict().items()}
    saved_outside = precision.float32_state_dict(model)
    with ema.evaluating():
        inside = model.state_dict()
        assert all(torch.equal(inside[k], ema.averaged[k].to(inside[k].dtype)) for k in inside)
        assert any(not torch.equal(inside[k], training[k]) for k in inside)
        state = {"model": precision.float32_state_dict(model)}     # best.pth, saved meanwhile
        ema.before_save(None, "best.pth", state)
        assert all(torch.equal(state["model"][k], saved_outside[k]) for k in saved_outside)
    after = model.state_dict()
    assert all(torch.equal(after[k], training[k]) for k in training)
    with pytest.raises(RuntimeError, match="boom"), ema.applied():   # restored when validation fails
        raise RuntimeError("boom")
    assert all(torch.equal(model.state_dict()[k], training[k]) for k in training)


def test_state_round_trip_is_exact_and_a_damaged_state_is_one_error():
    model, precision = prepared("O0")
    ema = WeightsEMA(0.99, 3.0).attach(model, precision)
    for k in range(3):
        nudge(model, precision, k)
        ema.update()
    state = ema.state_dict()
    other_model, other_precision = prepared("O0")
    other = WeightsEMA(0.99, 3.0).attach(other_model, other_precision)
    other.load_state_dict(state)
    assert other.updates == 3
    assert all(torch.equal(other.averaged[k], ema.averaged[k]) for k in ema.averaged)
    other_model.load_state_dict(model.state_dict())    # the resumed run's weights are the saved ones
    nudge(model, precision, 9)
    nudge(other_model, other_precision, 9)
    ema.update()
    other.update()
    assert all(torch.equal(other.averaged[k], ema.averaged[k]) for k in ema.averaged)
    with pytest.raises(CheckpointError, match="^its EMA state is damaged"):
        other.load_state_dict({"model": {}})
    for updates, says in ((-5, "-5 must be >= 0"), (2.5, "2.5 is not a whole number")):   # a negative
        with pytest.raises(CheckpointError, match=f"damaged \\(updates: {says}\\)"):    # count: decay < 0
            other.load_state_dict(dict(state, updates=updates))
    broken = dict(state, model={k: v for k, v in state["model"].items() if "stem" not in k})
    with pytest.raises(CheckpointError, match=r"^its EMA weights do not fit this model \("):
        other.load_state_dict(broken)


@pytest.mark.slow         # many CPU-seconds
def test_a_checkpoint_with_ema_gives_its_ema_weights_and_says_so(tmp_path, capsys):
    from inference.loading import load_model

    model = tiny_model(0)
    averaged = tiny_model(1).state_dict()
    path = tmp_path / "best.pth"
    save_checkpoint(path, {"model": model.state_dict(), "config": to_dict(build_config("tiny")),
                           "ema": {"decay": 0.9, "tau": 2.0, "updates": 7, "model": averaged}})
    chosen, note = preferred_weights({"model": model.state_dict(), "ema": {"model": averaged}})
    assert chosen is averaged and "EMA" in note
    assert preferred_weights({"model": model.state_dict()})[1] == ""
    said = []
    loaded, _ = load_model(str(path), None, [], torch.device("cpu"), say=said.append)
    assert said == [f"{path}: the EMA weights (decay 0.9, 7 updates), not the training weights"]
    assert all(torch.equal(loaded.state_dict()[k], averaged[k]) for k in averaged)


@pytest.mark.parametrize("decay", ["1", "-0.1", "nan"])
def test_a_decay_outside_0_to_1_is_refused(decay):
    from engine.cli import build_parser, config_from_args
    with pytest.raises(ConfigError, match="option train.ema"):
        config_from_args(build_parser("t").parse_args(["--ema", decay]))
