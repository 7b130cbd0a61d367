"""Distributed building blocks: launcher variables (torchrun, legacy --local-rank, SLURM), device
choice and its refusals, the port-in-use refusal, and the collectives and DDP wrapper with real
gloo processes (torch.multiprocessing and the real legacy launcher)."""
from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from common.errors import ConfigError
from config.schema import AmpConfig, DistConfig
from runtime import distributed as D
from engine.parallel import wrap_ddp
from child_env import child_env, find_free_port
from gloo_ranks import start_forked
from runtime import launch_env
from runtime.launch_env import ProcessPlace, read_launch, resolve_device

REPO = Path(__file__).resolve().parents[1]
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "SLURM_PROCID", "SLURM_LOCALID",
               "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "SLURM_NNODES", "SLURM_STEP_NUM_NODES",
               "SLURM_NODELIST", "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_TASKS_PER_NODE",
               "SLURM_STEP_TASKS_PER_NODE", "SLURM_NODEID", "SLURM_JOB_ID", "SLURM_LAUNCH_NODE_IPADDR",
               "SLURM_GPUS_PER_TASK")


def _clear_launch_env(environ) -> None:
    for name in LAUNCH_VARS:
        environ.pop(name, None)


@pytest.fixture
def clean_env(monkeypatch):
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# ---- launcher variables, read without processes ------------------------------------------------

def test_torchrun_variables():
    env = dict(RANK="3", LOCAL_RANK="1", WORLD_SIZE="4", LOCAL_WORLD_SIZE="2", MASTER_ADDR="hostA",
               MASTER_PORT="29500", TORCHELASTIC_RUN_ID="job")
    got = read_launch(env, None)
    assert (got.launcher, got.rank, got.local_rank, got.world_size, got.local_world_size) == \
        ("torchrun", 3, 1, 4, 2)
    assert (got.master_addr, got.master_port, got.agent_store) == ("hostA", 29500, True)


def test_legacy_local_rank_argument_wins_and_negative_means_unset():
    env = dict(RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="1234")
    assert read_launch(env, 1).local_rank == 1
    assert read_launch({**env, "LOCAL_RANK": "0"}, 1).local_rank == 1
    assert read_launch({**env, "LOCAL_RANK": "0"}, -1).local_rank == 0
    assert read_launch(env, None).launcher == "env"


def test_slurm_variables_with_plain_node_list():
    env = dict(SLURM_PROCID="3", SLURM_LOCALID="1", SLURM_NTASKS="4", SLURM_TASKS_PER_NODE="2(x2)",
               SLURM_NODEID="1", SLURM_NNODES="2", SLURM_NODELIST="node7,node8", SLURM_JOB_ID="12345",
               SLURM_LAUNCH_NODE_IPADDR="10.0.0.9")
    got = read_launch(env, None)
    assert (got.launcher, got.rank, got.local_rank, got.world_size, got.local_world_size) == \
        ("slurm", 3, 1, 4, 2)
    assert (got.master_addr, got.master_port, got.agent_store) == ("node7", 22345, False)
    assert read_launch({**env, "MASTER_ADDR": "m", "MASTER_PORT": "4000"}, None).master_port == 4000
    assert read_launch({**env, "SLURM_NNODES": "1"}, None).master_addr == "127.0.0.1"


def test_slurm_master_without_scontrol(monkeypatch):
    monkeypatch.setattr(launch_env.shutil, "which", lambda name: None)
    env = dict(SLURM_PROCID="0", SLURM_NTASKS="8", SLURM_NNODES="2", SLURM_NODELIST="gpu[01-02]")
    assert read_launch({**env, "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.5"}, None).master_addr == "10.0.0.5"
    with pytest.raises(ConfigError, match="MASTER_ADDR"):
        read_launch(env, None)
    assert read_launch({**env, "SLURM_NTASKS": "1"}, None).world_size == 1   # one task: no group


def test_bad_launcher_variables_are_named():
    with pytest.raises(ConfigError, match="RANK='abc'"):
        read_launch(dict(RANK="abc", WORLD_SIZE="2"), None)
    with pytest.raises(ConfigError, match="MASTER_ADDR is not set"):
        read_launch(dict(RANK="0", WORLD_SIZE="2"), None)
    with pytest.raises(ConfigError, match=r"rank 2 .*\(check RANK, LOCAL_RANK, WORLD_SIZE\)"):
        read_launch(dict(RANK="2", WORLD_SIZE="2", MASTER_ADDR="h", MASTER_PORT="1"), None)
    slurm_names = r"world of 0 processes \(check SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS\)"
    with pytest.raises(ConfigError, match=slurm_names):
        read_launch(dict(SLURM_PROCID="0", SLURM_NTASKS="0"), None)
    assert read_launch({}, None) == ProcessPlace()


# ---- device choice (CUDA faked: nothing touches a GPU) -----------------------------------------

@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_device_by_local_rank_and_by_list(two_gpus):
    assert resolve_device("auto", ProcessPlace(local_rank=1, local_world_size=2)) == torch.device("cuda", 1)
    assert resolve_device("0,1", ProcessPlace(local_rank=1, local_world_size=2)) == torch.device("cuda", 1)
    assert resolve_device("1", ProcessPlace()) == torch.device("cuda", 1)
    assert resolve_device("cuda:1", ProcessPlace()) == torch.device("cuda", 1)
    assert resolve_device("cpu", ProcessPlace(local_rank=5, local_world_size=8)) == torch.device("cpu")


def test_device_refusals(two_gpus):
    with pytest.raises(ConfigError, match="3 processes on this node but only 2 CUDA GPU.*--device"):
        resolve_device("cuda", ProcessPlace(local_world_size=3))
    with pytest.raises(ConfigError, match="lists 1 GPU"):
        resolve_device("1", ProcessPlace(local_world_size=2))
    with pytest.raises(ConfigError, match="one GPU for 2 processes"):
        resolve_device("cuda:0", ProcessPlace(local_world_size=2))
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_device("2,3", ProcessPlace())
    with pytest.raises(ConfigError, match="--device: 'gpu' is not auto, cpu, cuda, cuda:N"):
        resolve_device("gpu", ProcessPlace())


def test_a_one_process_run_on_gpu_1_makes_it_the_current_device(two_gpus, monkeypatch):
    """Otherwise the DataLoader's pin-memory thread opens a second CUDA context on GPU 0."""
    from engine.cli import single_process_context
    current = []
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    assert single_process_context("cuda:1").device == torch.device("cuda", 1)
    assert current == [torch.device("cuda", 1)]


def test_train_parallel_refuses_compile_on_several_gpus_naming_the_alternative(two_gpus, tmp_path):
    import train_parallel
    with pytest.raises(ConfigError, match="option amp.compile: .*torchrun train_distributed.py"):
        train_parallel.main(["--gpus", "0,1", "--compile", "--out-dir", str(tmp_path)])
    assert not any(tmp_path.iterdir())                 # refused before any run directory exists


def test_a_process_bound_to_its_own_gpu_uses_it_whatever_its_local_rank(monkeypatch):
    """srun --gpu-bind or an mpirun wrapper: CUDA_VISIBLE_DEVICES=3 in local rank 3 of 4 -> cuda:0.
    Under torchrun (which never binds), or without the variable, 4 processes on 1 GPU are refused."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    for launcher in ("slurm", "env"):
        bound = ProcessPlace(launcher, rank=3, local_rank=3, world_size=4, local_world_size=4)
        assert resolve_device("cuda", bound) == torch.device("cuda", 0)
    with pytest.raises(ConfigError, match="4 processes on this node but only 1 CUDA GPU"):
        resolve_device("cuda", ProcessPlace("torchrun", rank=3, local_rank=3, world_size=4,
                                            local_world_size=4))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(ConfigError, match="4 processes on this node but only 1 CUDA GPU"):
        resolve_device("cuda", ProcessPlace("slurm", rank=3, local_rank=3, world_size=4, local_world_size=4))


def test_more_processes_than_gpus_refused_before_any_process_group(two_gpus, clean_env):
    clean_env.setenv("RANK", "0")
    clean_env.setenv("WORLD_SIZE", "3")
    clean_env.setenv("LOCAL_WORLD_SIZE", "3")
    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    clean_env.setenv("MASTER_PORT", str(find_free_port()))
    # rank 0 serves its error to the other ranks for up to the rendezvous timeout: none come here
    with pytest.raises(ConfigError, match="only 2 CUDA GPU"):
        D.init_distributed(DistConfig(rendezvous_timeout_s=2), device="auto")
    assert not D.is_initialized()


def test_cuda_asked_without_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="no CUDA GPU is visible"):
        resolve_device("cuda", ProcessPlace())
    assert resolve_device("auto", ProcessPlace()) == torch.device("cpu")


# ---- single process, port in use, seeding ---------------------------------------------------

def test_no_launcher_is_a_single_process_and_helpers_are_no_ops(clean_env):
    ctx = D.init_distributed(DistConfig(), device="cpu")
    assert (ctx.rank, ctx.world_size, ctx.distributed, ctx.is_main, ctx.backend) == (0, 1, False, True, "")
    assert not D.is_initialized() and D.get_world_size() == 1 and D.get_rank() == 0
    value = torch.tensor([2.0])
    assert D.all_reduce_mean(value) is value and D.all_reduce_sum(3.0) == 3.0
    assert D.any_rank(True) and not D.any_rank(False)
    assert D.broadcast_object({"a": 1}) == {"a": 1} and D.all_gather_object(5) == [5]
    model = nn.Linear(2, 2)
    assert wrap_ddp(model, ctx, AmpConfig(), DistConfig(delay_allreduce=True)) is model
    D.barrier()
    D.cleanup()


def test_master_port_in_use_is_refused(clean_env):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        manual = dict(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        for name, value in manual.items():
            clean_env.setenv(name, value)
        with pytest.raises(ConfigError, match=f"MASTER_PORT {port} is already in use"):
            D.init_distributed(DistConfig(), device="cpu")
    assert not D.is_initialized()


def test_seeds_differ_per_rank_and_repeat():
    def draw(seed, rank):
        D.seed_everything(seed, rank)
        return random.random(), float(np.random.rand()), torch.rand(1).item()

    assert draw(7, 0) == draw(7, 0)
    assert len({draw(7, 0), draw(7, 1), draw(8, 0)}) == 3


# ---- real processes: collectives, three launch styles, DDP ------------------------------------

def _set_launch_env(mode: str, rank: int, port: int) -> int | None:
    """Environment of `mode`; returns the legacy --local-rank value, if the mode passes one."""
    _clear_launch_env(os.environ)
    if mode == "slurm":
        os.environ.update(SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NTASKS="2",
                          SLURM_JOB_ID="1", SLURM_LAUNCH_NODE_IPADDR="127.0.0.1", MASTER_PORT=str(port))
        return None
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if mode == "legacy":
        return rank
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    return None


def _ddp_bucket_calls(ctx, delay: bool) -> tuple[list[int], list[torch.Tensor]]:
    """All-reduce calls per step (steps 2 and 3, after DDP rebuilds its buckets) and the params."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    torch.manual_seed(100 + ctx.rank)   # different start per rank: DDP must broadcast rank 0's
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    ddp = wrap_ddp(model, ctx, AmpConfig(), DistConfig(delay_allreduce=delay, bucket_cap_mb=0.01))
    calls = []
    ddp.register_comm_hook(None, lambda state, bucket: calls.append(1) or allreduce_hook(state, bucket))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    per_step = []
    for step in range(3):
        calls.clear()
        opt.zero_grad()
        ddp(torch.randn(8, 64)).square().mean().backward()   # each rank its own data
        opt.step()
        per_step.append(len(calls))
    return per_step[1:], [p.detach().clone() for p in model.parameters()]


def _worker(rank: int, ports: list[int], out_dir: str) -> None:
    record = {}
    for mode, port in zip(("env", "slurm", "legacy"), ports):
        local_rank_arg = _set_launch_env(mode, rank, port)
        ctx = D.init_distributed(DistConfig(), device="cpu", local_rank_arg=local_rank_arg)
        record[mode] = dict(rank=ctx.rank, local_rank=ctx.local_rank, world=ctx.world_size,
                            backend=ctx.backend, distributed=ctx.distributed, is_main=ctx.is_main,
                            launcher=ctx.launcher, gathered=D.all_gather_object(ctx.rank))
        if mode == "env":
            record["any_rank1"] = D.any_rank(rank == 1)
            record["any_none"] = D.any_rank(False)
            record["mean"] = D.all_reduce_mean(torch.tensor([rank + 1.0]))
            record["mean_number"] = D.all_reduce_mean(rank * 10)
            record["sum"] = D.all_reduce_sum(torch.tensor([rank + 1, 5]))
            record["broadcast"] = D.broadcast_object({"from": rank})
            D.barrier()
        if mode == "legacy":
            record["delay_calls"], record["delay_params"] = _ddp_bucket_calls(ctx, delay=True)
            record["overlap_calls"], _ = _ddp_bucket_calls(ctx, delay=False)
        D.cleanup()
    torch.save(record, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("dist")
    ports = [find_free_port() for _ in range(3)]
    start_forked(_worker, 2, (ports, str(out_dir)))
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["env", "slurm", "legacy"])
def test_two_processes_join_under_each_launch_style(records, mode):
    for rank, rec in enumerate(records):
        got = rec[mode]
        assert (got["rank"], got["local_rank"], got["world"], got["backend"]) == (rank, rank, 2, "gloo")
        assert got["distributed"] and got["is_main"] == (rank == 0) and got["gathered"] == [0, 1]
        assert got["launcher"] == ("slurm" if mode == "slurm" else "env")


@pytest.mark.slow
def test_collectives_agree_on_every_rank(records):
    for rec in records:
        assert rec["any_rank1"] is True and rec["any_none"] is False
        torch.testing.assert_close(rec["mean"], torch.tensor([1.5]))
        assert rec["mean_number"] == 5.0
        assert rec["sum"].tolist() == [3, 10]
        assert rec["broadcast"] == {"from": 0}


@pytest.mark.slow
def test_delay_allreduce_is_one_allreduce_per_step_and_ranks_stay_identical(records):
    for rec in records:
        assert rec["delay_calls"] == [1, 1]          # one bucket: one all-reduce after backward
        assert min(rec["overlap_calls"]) > 1         # small buckets overlap the backward pass
    for mine, theirs in zip(records[0]["delay_params"], records[1]["delay_params"]):
        assert torch.equal(mine, theirs)


LEGACY_SCRIPT = """
import argparse, json, sys
sys.path.insert(0, {repo!r})
from config.schema import DistConfig
from runtime import distributed as D
parser = argparse.ArgumentParser()
parser.add_argument("--local-rank", "--local_rank", dest="local_rank", type=int, default=None)
args = parser.parse_args()
ctx = D.init_distributed(DistConfig(), device="cpu", local_rank_arg=args.local_rank)
line = "RESULT " + json.dumps(dict(rank=ctx.rank, local_rank=ctx.local_rank, arg=args.local_rank,
      launcher=ctx.launcher, world=ctx.world_size, any=D.any_rank(ctx.rank == 1))) + "\\n"
# one write per line: both ranks share this stdout, and print() under PYTHONUNBUFFERED writes the
# text and its newline separately, so the two ranks' lines could interleave
sys.stdout.write(line)
sys.stdout.flush()
D.cleanup()
"""


@pytest.mark.slow
def test_real_legacy_launcher_passes_local_rank_and_joins_the_agent_store(tmp_path):
    script = tmp_path / "legacy_probe.py"
    script.write_text(textwrap.dedent(LEGACY_SCRIPT.format(repo=str(REPO))))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.launch", "--nproc_per_node", "2",
                           "--master_port", str(find_free_port()), str(script)],
                          capture_output=True, text=True, env=child_env(), timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = sorted((json.loads(line.split("RESULT ", 1)[1]) for line in proc.stdout.splitlines()
                      if "RESULT " in line), key=lambda r: r["rank"])
    assert [(r["rank"], r["local_rank"], r["arg"]) for r in results] == [(0, 0, 0), (1, 1, 1)]
    assert all(r["launcher"] == "torchrun" and r["world"] == 2 and r["any"] for r in results)
