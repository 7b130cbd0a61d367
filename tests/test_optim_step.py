"""OptimStep's one host sync per step: a bad loss poisons the gradients instead of being
read and voted before every backward. Checked on CPU: the count of host reads per step, the loss
scale after a bad loss and after an overflow, and two real gloo ranks of which one has a bad loss
(both skip, weights and BatchNorm statistics unchanged on both, no rank left waiting)."""
from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn

from bench.helpers import count_host_syncs
from config.schema import AmpConfig, DistConfig, OptimConfig
from engine.optim import updates_rounded_away
from engine.precision import NativePrecision as Precision
from engine.optim import OptimStep
from engine.parallel import convert_sync_bn, wrap_ddp
from gloo_ranks import on_gloo_ranks

WORLD = 2
BLOWN = 1e9          # far above optim.skip_loss_above


def small_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.LeakyReLU(0.01),
                         nn.Conv2d(4, 2, 1))


def build_step(net: nn.Module, amp: AmpConfig, optim: OptimConfig = OptimConfig(), wrapped=None,
               rounding_lr=None):
    precision = Precision(amp, torch.device("cpu"))
    net = precision.prepare_model(net)
    params = precision.optimizer_params([p for p in net.parameters() if p.requires_grad])
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return net, precision, OptimStep(precision, optimizer, params, net, optim, net=wrapped,
                                     rounding_lr=rounding_lr)


def take_step(step: OptimStep, net, precision, inputs: list, factors: list):
    """One step over the batches `inputs`, batch i's loss multiplied by factors[i]."""
    def loss_of(x, factor):
        with precision.autocast_context():
            return net(precision.cast_input(x)).float().pow(2).mean() * factor
    return step.update(list(zip(inputs, factors)), loss_of)


def state_of(net: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


@pytest.mark.parametrize("level, dtype", [("O0", "auto"), ("O1", "bfloat16"), ("O2", "float16"),
                                          ("O3", "float16")])
def test_one_host_read_per_step_of_two_batches_skipped_or_not(level, dtype):
    net, precision, step = build_step(small_net(), AmpConfig(opt_level=level, dtype=dtype),
                                      OptimConfig(clip_grad_norm=1.0))
    inputs = [torch.randn(2, 3, 6, 6), torch.randn(2, 3, 6, 6)]
    for factors, skipped in (([1, 1], False), ([1, BLOWN], True), ([1, 1], False)):
        with count_host_syncs() as syncs:
            outcome = take_step(step, net, precision, inputs, factors)
        assert outcome.skipped is skipped
        # a step skipped for its loss under a dynamic float16 scale reads the scale once more
        extra = int(skipped and precision.scaler.is_enabled())
        assert syncs.count == 1 + extra, syncs.by_kind


def test_a_gpu_run_counts_no_read_of_a_tensor_in_host_memory():
    """The host copy of a batch read before it goes to the GPU waits for nothing: not a sync."""
    batch_people = torch.ones(4, 3)
    counts = []
    for device in (None, torch.device("cpu"), torch.device("cuda")):
        with count_host_syncs(device=device) as syncs:
            int(batch_people.sum())
            batch_people.max().item()
        counts.append(syncs.count)
    assert counts == [2, 2, 0]


def test_a_gpu_run_counts_the_syncs_torch_makes_inside_its_ops(monkeypatch):
    """On CUDA the counter also counts the synchronizing operations torch makes inside its own ops
    (torch's SyncBatchNorm: one per layer and training forward), which no Python read shows, by
    torch's sync debug mode. Stood in here with its contract: in mode "warn" each synchronizing
    CUDA operation warns "called a synchronizing CUDA operation"; other warnings pass."""
    mode = ["default"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: mode[0])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda m: mode.__setitem__(0, m))

    def synchronizing_op():        # e.g. SyncBatchNorm's mask over the ranks' gathered counts
        if mode[0] == "warn":
            warnings.warn("called a synchronizing CUDA operation")

    with pytest.warns(UserWarning, match="not a sync"):
        with count_host_syncs(device=torch.device("cuda")) as syncs:
            assert mode == ["warn"]
            for _ in range(3):
                synchronizing_op()
            warnings.warn("not a sync")
    assert syncs.by_kind == {"cuda_sync": 3} and mode == ["default"]


def test_o3_measures_the_updates_that_round_away_in_its_half_weights_at_its_first_step():
    """A float16 weight of 1.0 has neighbours 2**-10 away: at lr 1e-4 an SGD update of gradient 1
    (1e-4, under half of that) leaves it as it was, one of gradient 10 moves it, and weight decay
    5e-4 (5e-8 of it) never does; AdamW's first update is lr x sign(grad). OptimStep says it in
    its outcome's note once: at its first step that updates (not a skipped one)."""
    weight = nn.Parameter(torch.ones(4, dtype=torch.float16))
    weight.grad = torch.tensor([1.0, 10.0, 1.0, 0.0], dtype=torch.float16)
    assert updates_rounded_away([weight], 1e-4, OptimConfig(name="sgd", weight_decay=5e-4)) == (0.75, 1.0)
    assert updates_rounded_away([weight], 1e-4, OptimConfig(name="sgd", weight_decay=0)) == (2 / 3, 0)
    assert updates_rounded_away([weight], 1e-3, OptimConfig(name="sgd", weight_decay=0)) == (0, 0)
    assert updates_rounded_away([weight], 1e-4, OptimConfig(name="adamw", weight_decay=0)) == (1, 0)
    master = nn.Parameter(torch.ones(4))
    master.grad = torch.ones(4)
    assert updates_rounded_away([master], 1e-4, OptimConfig()) is None       # O2's float32 masters
    net, precision, step = build_step(small_net(), AmpConfig(opt_level="O3", dtype="float16"),
                                      rounding_lr=1e-6)
    inputs = [torch.randn(2, 3, 6, 6)]
    outcomes = [take_step(step, net, precision, inputs, [factor]) for factor in (BLOWN, 1, 1)]
    assert [outcome.skipped for outcome in outcomes] == [True, False, False]
    assert [bool(outcome.note) for outcome in outcomes] == [False, True, False]
    share = re.match(r"float16 weights without float32 masters: at the peak lr 1e-06, (\d+)% of the "
                     r"first step's updates round away .*, and 100% of its weight decay", outcomes[1].note)
    assert share and int(share.group(1)) > 50, outcomes[1].note


def test_a_bad_loss_keeps_the_loss_scale_an_overflow_lowers_it():
    net, precision, step = build_step(small_net(), AmpConfig(opt_level="O2", dtype="float16"))
    inputs = [torch.randn(2, 3, 6, 6)]
    before = state_of(net)
    outcome = take_step(step, net, precision, inputs, [float("nan")])
    assert outcome.skipped and precision.scaler.get_scale() == 1024.0
    assert all(torch.equal(before[k], v) for k, v in state_of(net).items())
    # a finite loss whose scaled gradients overflow float16: skipped, and the scale halves
    outcome = take_step(step, net, precision, inputs, [1e5])
    assert outcome.skipped and precision.scaler.get_scale() == 512.0
    assert all(torch.equal(before[k], v) for k, v in state_of(net).items())
    outcome = take_step(step, net, precision, inputs, [1])
    assert not outcome.skipped and not torch.equal(before["0.weight"], net.state_dict()["0.weight"])


def test_a_skipped_steps_loss_is_the_mean_of_its_batches():
    net, precision, step = build_step(small_net(), AmpConfig())
    inputs = [torch.randn(2, 3, 6, 6), torch.randn(2, 3, 6, 6)]
    with torch.no_grad():
        losses = [net(x).pow(2).mean().item() for x in inputs]
    outcome = take_step(step, net, precision, inputs, [BLOWN, 1])
    assert outcome.skipped
    assert outcome.loss == pytest.approx((losses[0] * BLOWN + losses[1]) / 2, rel=1e-5)


# -- two gloo ranks, a bad loss on one ----------------------------------------------------------
def _steps(rank: int, ctx) -> dict:
    """Three steps of two batches each, SyncBN (a collective in every backward) under DDP; at the
    second step rank 1's first batch has a blown-up loss."""
    model = convert_sync_bn(small_net(), ctx, AmpConfig())
    ddp = wrap_ddp(model, ctx, AmpConfig(), DistConfig())
    _, precision, step = build_step(model, AmpConfig(), wrapped=ddp)
    gen = torch.Generator().manual_seed(10 + rank)
    record = {"states": [state_of(model)], "outcomes": []}
    for n in range(3):
        inputs = [torch.randn(2, 3, 6, 6, generator=gen) for _ in range(2)]
        factors = [BLOWN if (n == 1 and rank == 1) else 1, 1]
        outcome = take_step(step, ddp, precision, inputs, factors)
        record["outcomes"].append((outcome.loss, outcome.skipped, outcome.stop))
        record["states"].append(state_of(model))
    return record


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return on_gloo_ranks(_steps, WORLD, tmp_path_factory.mktemp("bad_loss_on_one_rank"))


@pytest.mark.slow
def test_a_bad_loss_on_one_rank_skips_the_step_on_both(two_ranks):
    threshold = OptimConfig().skip_loss_above
    for rank, record in enumerate(two_ranks):
        assert [skipped for _, skipped, _ in record["outcomes"]] == [False, True, False]
        assert (record["outcomes"][1][0] > threshold) is (rank == 1)     # only rank 1's was bad
        before, after = record["states"][1], record["states"][2]
        for key in before:          # weights and BatchNorm statistics untouched by the skip
            assert torch.equal(before[key], after[key]), key
        assert not torch.equal(record["states"][2]["0.weight"], record["states"][3]["0.weight"])
    for key, value in two_ranks[0]["states"][3].items():                 # still identical ranks
        torch.testing.assert_close(two_ranks[1]["states"][3][key], value, msg=key)


def test_o2_master_gradients_are_the_half_gradients_in_float32_and_none_stays_none():
    torch.manual_seed(0)
    net = nn.ModuleDict({"used": nn.Conv2d(3, 2, 3), "unused": nn.Conv2d(2, 2, 1)})
    precision = Precision(AmpConfig(opt_level="O2", dtype="bfloat16", channels_last=True),
                          torch.device("cpu"))
    net = precision.prepare_model(net)
    optimizer = torch.optim.SGD(precision.optimizer_params(list(net.parameters())), lr=0.1)
    precision.backward(net["used"](precision.cast_input(torch.randn(2, 3, 5, 5))).float().sum())
    precision.unscale_(optimizer)
    for param, master in precision._pairs:
        if param.grad is None:
            assert master.grad is None
        else:
            assert master.grad.dtype == torch.float32 and master.grad.stride() == master.stride()
            assert torch.equal(master.grad, param.grad.float())
    assert sum(m.grad is None for _, m in precision._pairs) == 2          # the unused conv's
    precision.step(optimizer, grads_finite=True)
    for param, master in precision._pairs:
        assert torch.equal(param, master.to(param.dtype))
