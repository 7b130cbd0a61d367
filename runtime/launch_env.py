"""What the launcher tells this process (rank, world, master, device), from the environment only:
torchrun or the same variables by hand, SLURM, else one process (docs/distributed.md)."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
from dataclasses import dataclass

import torch

from common.errors import ConfigError, os_reason
from config.loader import check_device, device_spelling

# set by torchrun's agent, which holds the rendezvous store on MASTER_PORT itself
_AGENT_VARS = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE")


@dataclass
class ProcessPlace:
    launcher: str = "none"
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int | None = None   # None: unknown (hand-set env without LOCAL_WORLD_SIZE)
    master_addr: str = ""
    master_port: int = 0
    agent_store: bool = False


def _env_int(env, name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        if default is None:
            raise ConfigError(f"environment variable {name} is not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from None


def _first_slurm_host(env) -> str:
    names = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    nodelist = next((env[name] for name in names if env.get(name)), "")
    if nodelist and "[" not in nodelist:
        return nodelist.split(",")[0].strip()
    if nodelist and shutil.which("scontrol"):
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True)
        hosts = out.stdout.split()
        if out.returncode == 0 and hosts:
            return hosts[0]
    return env.get("SLURM_LAUNCH_NODE_IPADDR", "")


def _read_slurm(env) -> ProcessPlace:
    world = _env_int(env, "SLURM_STEP_NUM_TASKS", _env_int(env, "SLURM_NTASKS", 1))
    place = ProcessPlace("slurm", _env_int(env, "SLURM_PROCID"), _env_int(env, "SLURM_LOCALID", 0), world)
    if per_node := env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE"):
        try:
            counts = []                          # SLURM's '2(x3),1' -> [2, 2, 2, 1]
            for part in filter(None, map(str.strip, per_node.split(","))):
                num, _, times = part.rstrip(")").partition("(x")
                counts += [int(num)] * int(times or 1)
            place.local_world_size = counts[min(_env_int(env, "SLURM_NODEID", 0), len(counts) - 1)]
        except (ValueError, IndexError):
            raise ConfigError(f"cannot read SLURM_TASKS_PER_NODE={per_node!r}") from None
    nodes = _env_int(env, "SLURM_STEP_NUM_NODES", _env_int(env, "SLURM_NNODES", 0))
    place.master_addr = env.get("MASTER_ADDR") or ("127.0.0.1" if nodes == 1 else _first_slurm_host(env))
    if world > 1 and not place.master_addr:
        raise ConfigError("SLURM job: cannot tell the master host (no SLURM_NODELIST, no scontrol, "
                          "no SLURM_LAUNCH_NODE_IPADDR); export MASTER_ADDR=<host of rank 0>")
    place.master_port = _env_int(env, "MASTER_PORT", 20000 + _env_int(env, "SLURM_JOB_ID", 0) % 10000)
    return place


def read_launch(env, local_rank_arg: int | None) -> ProcessPlace:
    """Rank, world and master of this process from the launcher's environment."""
    if local_rank_arg is not None and local_rank_arg < 0:
        local_rank_arg = None
    if "WORLD_SIZE" in env or "RANK" in env:
        rank = _env_int(env, "RANK", 0)
        local_rank = local_rank_arg if local_rank_arg is not None else _env_int(env, "LOCAL_RANK", rank)
        agent = any(name in env for name in _AGENT_VARS)
        place = ProcessPlace("torchrun" if agent else "env", rank, local_rank, _env_int(env, "WORLD_SIZE", 1),
                             agent_store=agent)
        if "LOCAL_WORLD_SIZE" in env:
            place.local_world_size = _env_int(env, "LOCAL_WORLD_SIZE")
        if place.world_size > 1:
            if not env.get("MASTER_ADDR"):
                raise ConfigError(f"WORLD_SIZE={place.world_size} but MASTER_ADDR is not set; "
                                  "launch with torchrun or export MASTER_ADDR and MASTER_PORT")
            place.master_addr = env["MASTER_ADDR"]
            place.master_port = _env_int(env, "MASTER_PORT")
    elif "SLURM_PROCID" in env:
        place = _read_slurm(env)
    else:
        place = ProcessPlace(local_rank=local_rank_arg or 0)
    if place.world_size < 1 or not 0 <= place.rank < place.world_size or place.local_rank < 0:
        names = ("SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS" if place.launcher == "slurm"
                 else "RANK, LOCAL_RANK, WORLD_SIZE")
        raise ConfigError(f"rank {place.rank} / local rank {place.local_rank} do not fit a world "
                          f"of {place.world_size} processes (check {names})")
    if place.world_size > 1 and not 0 < place.master_port < 65536:
        raise ConfigError(f"MASTER_PORT {place.master_port} is not a port (1 to 65535)")
    return place


def device_kind(spec: str) -> str:
    """"cpu" or "cuda": what --device `spec` runs on (auto: CUDA where a GPU is visible)."""
    spec = device_spelling(spec or "auto")
    if spec == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cpu" if spec == "cpu" else "cuda"


def resolve_device(spec: str, place: ProcessPlace) -> torch.device:
    """The device of this process from --device and its local rank; refuses impossible choices."""
    check_device(spec or "auto", "--device")
    if device_kind(spec) == "cpu":
        return torch.device("cpu")
    spec = device_spelling(spec or "auto").replace("auto", "cuda")
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible == 0:
        raise ConfigError(f"--device {spec}: no CUDA GPU is visible here; use --device cpu")
    needed = place.local_world_size or place.local_rank + 1
    pick_hint = "pick GPUs with --device 0,1 or CUDA_VISIBLE_DEVICES"
    if spec == "cuda":
        if place.launcher == "slurm" and os.environ.get("SLURM_GPUS_PER_TASK"):
            return torch.device("cuda", 0)   # srun binds each task to its own GPUs
        bound = [n for n in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if n.strip()]
        if place.launcher in ("slurm", "env") and visible == 1 and needed > 1 and len(bound) == 1:
            return torch.device("cuda", 0)   # srun --gpu-bind / mpirun wrappers: one GPU per process
        if needed > visible:
            raise ConfigError(f"{needed} processes on this node but only {visible} CUDA GPU(s) are "
                              f"visible; start at most {visible} per node (--nproc_per_node) or {pick_hint}")
        return torch.device("cuda", place.local_rank)
    if spec.startswith("cuda:"):              # the spelling was checked above
        ids = [int(spec[5:])]
        if needed > 1:
            raise ConfigError(f"--device {spec} names one GPU for {needed} processes on this node; "
                              "list one per process, e.g. --device 0,1")
    else:
        ids = [int(part) for part in spec.split(",")]
    if bad := [i for i in ids if not 0 <= i < visible]:
        raise ConfigError(f"--device {spec}: GPU {bad} does not exist; "
                          f"{visible} are visible (0..{visible - 1})")
    if needed > len(ids):
        raise ConfigError(f"{needed} processes on this node but --device {spec} lists {len(ids)} GPU(s); "
                          f"list one per process or start fewer (--nproc_per_node)")
    return torch.device("cuda", ids[place.local_rank])


def check_port_free(port: int) -> None:
    """Raise ConfigError when something on this machine already listens on `port`."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # TIME_WAIT is no conflict
        try:
            probe.bind(("", port))
        except OSError as err:
            raise ConfigError(f"MASTER_PORT {port} is already in use on this machine ({os_reason(err)}); "
                              "pick a free port with --master_port or MASTER_PORT") from None
