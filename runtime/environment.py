"""What a run's numbers depend on besides its config (versions, Apex build, git commit, command line,
devices) for RUN/environment.json; `changed_versions` says what differs from an earlier start."""
from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import platform
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
LIBRARIES = {"numpy": "numpy", "opencv": "cv2", "h5py": "h5py", "pycocotools": "pycocotools",
             "tqdm": "tqdm", "PyYAML": "yaml", "matplotlib": "matplotlib"}
APEX_EXTENSIONS = ("amp_C", "apex_C", "syncbn")     # the compiled ones that amp, SyncBN, DDP use


def installed_version(distribution: str) -> str | None:
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        return importlib.metadata.version(distribution)
    return None


def _version(module: str) -> str | None:
    """The version of an installed module (its __version__, else its distribution's), or None."""
    try:
        loaded = sys.modules.get(module) or importlib.import_module(module)
    except Exception:          # not installed, or broken: the file says so with None
        return None
    version = getattr(loaded, "__version__", None)
    return installed_version(module) if version is None else str(version)


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def describe_environment(device: torch.device, world_size: int) -> dict:
    """The environment of a run on `device` (this process's) with `world_size` processes."""
    commit, changes = _git("rev-parse", "HEAD"), _git("status", "--porcelain")
    cuda, apex = torch.cuda.is_available(), importlib.util.find_spec("apex")     # found, not imported
    return {
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if cuda else None,
                     **{name: _version(module) for name, module in LIBRARIES.items()}},
        "apex": apex and {"path": str(Path(apex.origin or "").parent), "version": installed_version("apex"),
                          "extensions": [name for name in APEX_EXTENSIONS if importlib.util.find_spec(name)]},
        "git": {"commit": commit, "clean": None if changes is None else changes == ""},
        "command": [sys.executable, *sys.argv], "device": str(device), "world_size": world_size,
        "devices": ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda
                    else [_cpu_name()]),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(), "platform": platform.platform(),
    }


def changed_versions(before, now: dict) -> list[str]:
    """'name old -> new' for each version that differs between `earlier` and `now`."""
    old = before.get("versions") if isinstance(before, dict) else None
    old = old if isinstance(old, dict) else {}
    return [f"{name} {old.get(name)} -> {value}" for name, value in now["versions"].items()
            if old.get(name) != value]
