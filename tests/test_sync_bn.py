"""--sync-bn on CPU: two real gloo processes with batch 2 each must match one process with batch 4
(outputs, running statistics, input and weight gradients, and a DDP training step); the host sync
counter sees what each SyncBN layer costs."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from bench.helpers import count_host_syncs
from config.schema import AmpConfig, DistConfig
from runtime.distributed import DistContext, all_reduce_sum
from engine.parallel import CrossProcessBatchNorm, convert_sync_bn, wrap_ddp
from gloo_ranks import gloo_group_of_one, on_gloo_ranks  # noqa: F401 - a fixture

TOTAL_BATCH = 4
WORLD = 2
TOL = dict(rtol=1e-4, atol=1e-5)


def small_net() -> nn.Module:
    """conv + BN + conv + BN (the second with a cumulative average), identical on every rank."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.LeakyReLU(0.01),
                        nn.Conv2d(4, 2, 1), nn.BatchNorm2d(2, momentum=None))
    with torch.no_grad():   # non-trivial affine parameters
        for bn in (net[1], net[4]):
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
    return net


def batches():
    """Two training batches and a probe per batch (fixed weights that make the loss)."""
    gen = torch.Generator().manual_seed(1)
    data = [torch.randn(TOTAL_BATCH, 3, 6, 6, generator=gen) * 2 + 1 for _ in range(2)]
    probes = [torch.randn(TOTAL_BATCH, 2, 6, 6, generator=gen) for _ in range(2)]
    return data, probes


def run_steps(net, shard: slice):
    """Two train-mode passes on `shard` of each batch, then one eval pass; what the test compares."""
    data, probes = batches()
    record = {"out": [], "x_grad": [], "grads": []}
    for x_full, probe in zip(data, probes):
        x = x_full[shard].clone().requires_grad_(True)
        out = net(x)
        (out * probe[shard]).sum().backward()
        grads = [p.grad.clone() for p in net.parameters()]
        record["out"].append(out.detach())
        record["x_grad"].append(x.grad)
        record["grads"].append(grads)
        net.zero_grad()
    record["state"] = {k: v.clone() for k, v in net.state_dict().items()}
    net.eval()
    record["eval_out"] = net(data[0][shard]).detach()
    net.train()
    return record


def ddp_step(net, shard: slice, mean_over: int):
    """One SGD step on a per-process mean loss; returns the parameters after it."""
    data, probes = batches()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    loss = (net(data[0][shard]) * probes[0][shard]).sum() / mean_over
    loss.backward()
    opt.step()
    return [p.detach().clone() for p in net.parameters()]


def _record(rank: int, ctx) -> dict:
    shard = slice(rank * TOTAL_BATCH // WORLD, (rank + 1) * TOTAL_BATCH // WORLD)
    net = convert_sync_bn(small_net(), ctx, AmpConfig())
    kinds = sorted({type(m).__name__ for m in net.modules()})
    record = run_steps(net, shard)
    record["grads_summed"] = [[all_reduce_sum(g) for g in step] for step in record["grads"]]
    ddp_net = wrap_ddp(convert_sync_bn(small_net(), ctx, AmpConfig()), ctx, AmpConfig(), DistConfig())
    with count_host_syncs() as syncs:
        record["after_step"] = ddp_step(ddp_net, shard, mean_over=TOTAL_BATCH // WORLD)
    record["syncs"] = syncs.by_kind
    record["kinds"] = kinds
    return record


@pytest.fixture(scope="module")
def two_rank_records(tmp_path_factory):
    return on_gloo_ranks(_record, WORLD, tmp_path_factory.mktemp("syncbn"))


@pytest.mark.slow
def test_two_processes_match_one_process_with_the_whole_batch(two_rank_records):
    reference = run_steps(small_net(), slice(None))
    for rank, rec in enumerate(two_rank_records):
        shard = slice(rank * 2, rank * 2 + 2)
        assert "CrossProcessBatchNorm" in rec["kinds"] and "BatchNorm2d" not in rec["kinds"]
        for step in range(2):
            torch.testing.assert_close(rec["out"][step], reference["out"][step][shard], **TOL)
            torch.testing.assert_close(rec["x_grad"][step], reference["x_grad"][step][shard], **TOL)
            scale = max(g.abs().max().item() for g in reference["grads"][step])
            for got, want in zip(rec["grads_summed"][step], reference["grads"][step]):
                # the conv bias before a BN has a true gradient of 0: only float noise, of this scale
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6 * scale)
        assert list(rec["state"]) == list(reference["state"])   # same keys as BatchNorm2d
        for key, want in reference["state"].items():
            torch.testing.assert_close(rec["state"][key], want, **TOL, msg=f"state {key}")
        torch.testing.assert_close(rec["eval_out"], reference["eval_out"][shard], **TOL)


@pytest.mark.slow
def test_ddp_step_with_sync_bn_equals_one_process_step(two_rank_records):
    reference = ddp_step(small_net(), slice(None), mean_over=TOTAL_BATCH)
    for rec in two_rank_records:
        for got, want in zip(rec["after_step"], reference):
            torch.testing.assert_close(got, want, **TOL)


@pytest.mark.slow
def test_the_sync_counter_sees_one_host_sync_per_sync_bn_layer_and_training_forward(two_rank_records):
    """Each SyncBN layer's training forward waits for the ranks' joint count on the host (torch's
    SyncBatchNorm on CUDA too: counted there through its sync debug mode, bench/helpers.py);
    its backward and the DDP step add none. small_net has two, the second with a cumulative
    average (momentum None), whose factor reads its batch count, as torch's BatchNorm does."""
    for rec in two_rank_records:
        assert rec["syncs"] == {"item": 2, "__float__": 1}


def test_single_process_is_plain_batch_norm():
    x = torch.randn(3, 4, 5, 5)
    plain = nn.BatchNorm2d(4)
    cross = CrossProcessBatchNorm(4)
    torch.testing.assert_close(cross(x), plain(x))
    torch.testing.assert_close(cross.running_var, plain.running_var)
    assert cross.num_batches_tracked.item() == 1


def test_convert_keeps_checkpoints_loadable():
    net = small_net()
    keys = list(net.state_dict())
    cpu_ctx = DistContext(world_size=2, distributed=True)
    converted = convert_sync_bn(net, cpu_ctx, AmpConfig())
    assert isinstance(converted[1], CrossProcessBatchNorm) and converted[4].momentum is None
    converted.load_state_dict(small_net().state_dict())        # a plain checkpoint loads
    assert list(converted.state_dict()) == keys


def test_convert_uses_torch_sync_batchnorm_on_cuda_and_nothing_alone():
    cuda_ctx = DistContext(world_size=2, distributed=True, device=torch.device("cuda", 0))
    assert isinstance(convert_sync_bn(small_net(), cuda_ctx, AmpConfig())[1], nn.SyncBatchNorm)
    net = small_net()
    assert convert_sync_bn(net, DistContext(), AmpConfig()) is net


def test_the_builder_sets_up_syncbn_and_ddp_of_a_ddp_launch_in_one_place(gloo_group_of_one):
    """A `Launch` of mode ddp gets its cross-process BatchNorm (--sync-bn) and its DDP wrapper from
    `TrainerBuilder.build_parallel`; the entry script hands in no wrapper."""
    from config import build_config
    from engine.build import TrainerBuilder
    from engine.run_trainer import Launch

    cfg = build_config("tiny", sets=["dist.sync_bn=true"])
    builder, launch = TrainerBuilder(), Launch(DistContext(backend="gloo", distributed=True), mode="ddp")
    model = builder.build_parallel(small_net(), cfg, launch)
    assert isinstance(model[1], CrossProcessBatchNorm) and isinstance(model[4], CrossProcessBatchNorm)
    net = builder.build_parallel(model, cfg, launch, wrap=True)
    assert isinstance(net, nn.parallel.DistributedDataParallel) and net.module is model
    assert builder.build_parallel(model, cfg, Launch(DistContext(), mode="dataparallel"), wrap=True) is model
