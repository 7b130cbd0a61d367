"""The environment of the processes the tests start: none of the caller's launcher or SLURM
variables (a test run inside torchrun or srun must not leak them); tests/conftest.py has already
set OMP_NUM_THREADS=1 for every process they start."""
from __future__ import annotations

import os

LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT")


def child_env(**extra: str) -> dict:
    """This environment without launcher variables, plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARS and not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env
