"""The environment of the processes the tests start: none of the caller's launcher or SLURM
variables (a test run inside torchrun or srun must not leak them); tests/conftest.py has already
set OMP_NUM_THREADS=1 for every process they start. Also the free ports their launchers listen on."""
from __future__ import annotations

import os
import random
import socket

LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT")


def child_env(**extra: str) -> dict:
    """This environment without launcher variables, plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARS and not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


def find_free_port() -> int:
    """A TCP port nothing listens on now, below the ephemeral range (32768-60999 on Linux) that the
    system gives outgoing connections and `bind(port 0)` their ports from: a store's client or
    another test's listener started meanwhile cannot take it before the caller's launcher does."""
    while True:     # drawn from os.urandom: a run in this process seeds `random` (the same in every worker)
        port = random.SystemRandom().randrange(15000, 32768)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
