"""The apex backend against Apex 25.04's own code (its CUDA-only pieces stood in: see
tests/apex_cpu_standins.py): what broke on first contact with it, each case on its own.

- O1's patched operators and validation's loss total;
- Apex's Python SyncBatchNorm under O2 (its output dtype) and its running statistics (their
  tensors, which a skipped step's BN restore and the EMA hold);
- the EMA and checkpoints under Apex's O2/O3 state-dict hook (live sources, and the hook's cost);
- Apex's optimized SyncBatchNorm and its DDP with the compiled extensions a CUDA build has (`syncbn`
  and `amp_C` stood in with their kernels' contracts, `apex_C` built), on channels_last models;
- the arguments given to Apex's DDP (a stand-in class records them).
"""
from __future__ import annotations

import copy
import math
import sys
import types
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from apex_cpu_standins import (apex_amp_c, apex_c, apex_c_built, apex_cpu,  # noqa: F401 - fixtures
                               apex_syncbn_kernels, requires_apex)
from gloo_ranks import gloo_group_of_one  # noqa: F401 - a fixture
from config.schema import AmpConfig, DistConfig, OptimConfig
from engine.ema import WeightsEMA
from engine.optim import OptimStep
from engine import parallel
from engine.precision.apex import ApexPrecision

CPU = torch.device("cpu")
DISTRIBUTED = SimpleNamespace(device=CPU, distributed=True, world_size=1)


def conv_bn_net(blocks: int = 1) -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.Conv2d(3, 8, 3, padding=1)]
    for _ in range(blocks):
        layers += [nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1)]
    return nn.Sequential(*layers)


def apex_attached(model: nn.Module, level: str, **amp):
    """(precision, model, optimizer) after Apex's real amp.initialize at `level`."""
    precision = ApexPrecision(AmpConfig(backend="apex", opt_level=level, dtype="float16",
                                        channels_last=False, **amp), CPU)
    model = precision.prepare_model(model)
    optimizer = torch.optim.SGD(precision.optimizer_params([p for p in model.parameters()
                                                            if p.requires_grad]), lr=0.1)
    model, optimizer = precision.attach(model, optimizer)
    return precision, model, optimizer


# -- O1: validation's loss total under Apex's patched operators --------------------------------------
@requires_apex
def test_validation_sums_its_loss_under_apex_o1_patching(apex_cpu, synthetic_h5):
    from config.loader import build_config
    from data.dataset import KeypointDataset
    from config.views import SampleSettings
    from engine.validation import Validator
    from runtime.distributed import DistContext

    precision, model, _ = apex_attached(conv_bn_net(), "O1")
    from apex.amp._amp_state import _amp_state
    assert _amp_state.handle.is_active()             # torch's functions are patched now
    cfg = build_config("tiny", sets=["data.workers=0", "train.batch_size=4"])
    val_set = KeypointDataset(str(synthetic_h5[1]), SampleSettings.of(cfg), train=False)
    seen = []

    def eval_net(images, target, mask):       # a float32 per-sample loss, as the model gives it
        per_sample = torch.arange(len(target), dtype=torch.float32) + 0.1 * len(seen)
        seen.append(per_sample)
        return per_sample, {}

    class EvalNet:
        def eval(self):
            pass

        def __call__(self, images, target, mask):
            return eval_net(images, target, mask)

    data = SimpleNamespace(val_set=val_set, val_h5=None, skeleton=val_set.skeleton)
    loss = Validator(cfg, DistContext(), data, EvalNet(), None).loss(lambda: False)
    every = [value for per_sample in seen for value in per_sample.tolist()]   # not torch.sum: O1 casts
    assert loss == pytest.approx(math.fsum(every) / len(every), rel=1e-12)     # it to float32


# -- Apex's Python SyncBatchNorm ---------------------------------------------------------------------
@requires_apex
def test_apex_python_syncbn_under_o2_hands_float16_to_the_next_convolution(apex_cpu):
    model = parallel.convert_sync_bn(conv_bn_net(), DISTRIBUTED, AmpConfig(backend="apex"))
    assert isinstance(model[1], sys.modules["apex.parallel"].SyncBatchNorm)      # the Python one
    _, model, _ = apex_attached(model, "O2")
    assert model[1].weight.dtype == torch.float32 and model[3].weight.dtype == torch.float16
    inside = []
    model[3].register_forward_pre_hook(lambda module, args: inside.append(args[0].dtype))
    out = model(torch.randn(2, 3, 8, 8))          # Apex's patched forward casts the input
    assert inside == [torch.float16] and out.dtype == torch.float32 and torch.isfinite(out).all()


@requires_apex
def test_apex_python_syncbn_updates_its_running_statistics_in_their_own_tensors(apex_cpu):
    model = parallel.convert_sync_bn(conv_bn_net(), DISTRIBUTED, AmpConfig(backend="apex"))
    bn = model[1]
    mean, var = bn.running_mean, bn.running_var
    model(torch.randn(4, 3, 8, 8) * 3 + 1)
    assert bn.running_mean is mean and bn.running_var is var
    assert not torch.equal(mean, torch.zeros(8)) and not torch.equal(var, torch.ones(8))


@requires_apex
def test_apex_syncbn_keeps_the_parameters_and_freezing_of_the_batch_norms_it_replaces(apex_cpu):
    from engine.freeze import freeze, set_frozen_bn_eval
    model = conv_bn_net(blocks=2)
    report = freeze(model, ["1"])                       # the first batch norm
    frozen, trained = model[1].weight, model[4].weight
    model = parallel.convert_sync_bn(model, DISTRIBUTED, AmpConfig(backend="apex"))
    assert isinstance(model[1], sys.modules["apex.parallel"].SyncBatchNorm)
    assert model[1].weight is frozen and not model[1].weight.requires_grad
    assert model[4].weight is trained and model[4].weight.requires_grad
    model.train()
    assert set_frozen_bn_eval(model, report["all_modules"]) == 1 and not model[1].training and model[4].training


@requires_apex
def test_a_skipped_step_under_apex_syncbn_leaves_the_running_statistics_as_they_were(apex_cpu):
    model = parallel.convert_sync_bn(conv_bn_net(), DISTRIBUTED, AmpConfig(backend="apex"))
    precision, model, optimizer = apex_attached(model, "O2", init_scale=2.0 ** 10)
    step = OptimStep(precision, optimizer, precision.optimizer_params([]), model, OptimConfig())
    before = {k: v.clone() for k, v in model.state_dict().items() if "running" in k}
    overflowing = [(torch.randn(4, 3, 8, 8) * 3 + 1, float("inf"))]
    assert step.update(overflowing, lambda x, factor: model(x).float().mean() * factor).skipped
    after = {k: v for k, v in model.state_dict().items() if "running" in k}
    assert all(torch.equal(before[k], after[k]) for k in before)


# -- Apex's O2/O3 state-dict hook: the EMA and checkpoints read the live tensors ----------------------
@pytest.mark.parametrize("level", ["O2", "O3"])
@requires_apex
def test_the_ema_follows_the_weights_and_is_what_validation_sees_under_apex(apex_cpu, level):
    precision, model, optimizer = apex_attached(conv_bn_net(), level)
    ema = WeightsEMA(0.5, tau=1e-9).attach(model, precision)   # decay 0.5 from the first update
    weight = model[0].weight
    source = dict(precision.weight_sources(model))["0.weight"]  # O2: the master; O3: the weight
    start = source.detach().float().clone()
    with torch.no_grad():
        source.add_(1.0)
        if level == "O2":
            weight.copy_(source)
    ema.update()
    assert torch.allclose(ema.averaged["0.weight"], start + 0.5, atol=1e-2)
    with ema.applied():
        assert torch.allclose(weight.float(), ema.averaged["0.weight"], atol=1e-3)
    assert torch.allclose(weight.float(), start + 1.0, atol=1e-2)


@requires_apex
def test_saving_and_ema_attach_under_apex_o2_run_no_state_dict_hook(apex_cpu, monkeypatch):
    from apex.amp._initialize import O2StateDictHook
    precision, model, _ = apex_attached(conv_bn_net(blocks=20), "O2")
    calls = []
    hook_call = O2StateDictHook.__call__
    monkeypatch.setattr(O2StateDictHook, "__call__",
                        lambda self, *args: (calls.append(1), hook_call(self, *args))[1])
    saved = precision.float32_state_dict(model)
    WeightsEMA(0.9).attach(model, precision)
    assert calls == []
    reference = model.state_dict()               # Apex's way: one hook per module, each over all keys
    assert len(calls) == len(list(model.modules())) > 60
    assert saved.keys() == reference.keys()
    assert all(saved[k].dtype == reference[k].dtype for k in saved)
    masters = dict(zip([id(p) for p, _ in precision._pairs], [m for _, m in precision._pairs]))
    assert torch.equal(saved["0.weight"], masters[id(model[0].weight)])


# -- Apex's compiled extensions on channels_last models ------------------------------------------------
@pytest.mark.parametrize("channels_last", [True, False])
@requires_apex
def test_apex_optimized_syncbn_is_batch_norm_per_channel_in_either_memory_format(
        apex_syncbn_kernels, gloo_group_of_one, channels_last):
    """Apex's optimized SyncBatchNorm (its `syncbn` kernels stood in) in a gloo group of one, as
    `--sync-bn` builds it: training outputs, running statistics and gradients, and eval outputs,
    are nn.BatchNorm2d's. The width equals the channel count, so normalising the wrong dim would
    not even fail on a shape."""
    reference = conv_bn_net()
    model = parallel.convert_sync_bn(copy.deepcopy(reference), DISTRIBUTED,
                                     AmpConfig(backend="apex", opt_level="O2", channels_last=channels_last))
    assert isinstance(model[1], apex_syncbn_kernels)
    layout = torch.channels_last if channels_last else torch.contiguous_format
    model, reference = (net.to(memory_format=layout) for net in (model, reference))
    x = (torch.randn(4, 3, 8, 8) * 2 + 1).contiguous(memory_format=layout)
    probe = torch.randn(4, 8, 8, 8)
    inputs, outputs = [], []
    for net in (model, reference):
        inputs.append(x.clone().requires_grad_())
        outputs.append(net(inputs[-1]))
        (outputs[-1] * probe).sum().backward()
    assert torch.allclose(outputs[0], outputs[1], atol=1e-5)
    assert outputs[0].is_contiguous(memory_format=layout)
    assert torch.allclose(inputs[0].grad, inputs[1].grad, atol=1e-5)
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(ours.grad, theirs.grad, atol=1e-4), name
    for name in ("running_mean", "running_var"):
        assert torch.allclose(getattr(model[1], name), getattr(reference[1], name), atol=1e-6), name
    model.eval(), reference.eval()
    assert torch.allclose(model(x), reference(x), atol=1e-5)


@pytest.mark.slow          # builds apex_C: the compiler's processes
@requires_apex
def test_apex_ddp_gives_channels_last_gradients_back_as_they_were_all_reduced(
        apex_amp_c, apex_c, gloo_group_of_one):
    """Apex's DDP as a CUDA build runs it (`amp_C` stood in: its copy-back walks memory; `apex_C`
    built: Apex's own flatten) in a gloo group of one, on a channels_last model with 3x3 and 1x1
    kernels: every gradient after the copy-back is the all-reduced one (here: the local one)."""
    reference = nn.Sequential(conv_bn_net(), nn.Conv2d(8, 4, 1))
    model = copy.deepcopy(reference).to(memory_format=torch.channels_last)
    ctx = SimpleNamespace(device=CPU, distributed=True, world_size=1)
    net = parallel.wrap_ddp(model, ctx, AmpConfig(backend="apex"), DistConfig(delay_allreduce=True))
    assert sys.modules["apex.parallel.distributed"].flatten_impl is apex_c.flatten
    x = torch.randn(2, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    net(x).square().mean().backward()
    reference(x).square().mean().backward()
    assert model[0][0].weight.grad.is_contiguous(memory_format=torch.channels_last)
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(ours.grad, theirs.grad, atol=1e-6), name


# -- what Apex's DDP is given (a recording stand-in class) --------------------------------------------
@pytest.fixture
def recording_apex_parallel(monkeypatch):
    """`apex.parallel` with a DistributedDataParallel that records its arguments."""
    made = []

    class DistributedDataParallel(nn.Module):
        def __init__(self, module, **kwargs):
            super().__init__()
            made.append(("ddp", kwargs))
            self.module = module

        def disable_allreduce(self):
            pass

        def enable_allreduce(self):
            pass

    parallel = types.ModuleType("apex.parallel")
    parallel.DistributedDataParallel = DistributedDataParallel
    monkeypatch.setitem(sys.modules, "apex.parallel", parallel)
    return made


def test_apex_ddp_divides_by_the_world_size_before_summing(recording_apex_parallel):
    ctx = SimpleNamespace(device=CPU, distributed=True, world_size=4)
    net = parallel.wrap_ddp(conv_bn_net(), ctx, AmpConfig(backend="apex"), DistConfig(delay_allreduce=True))
    (kind, kwargs), = recording_apex_parallel
    assert kind == "ddp" and kwargs["gradient_predivide_factor"] == 4.0
    assert kwargs.get("gradient_average", True) and kwargs["delay_allreduce"] is True
    with net.no_sync():
        pass
