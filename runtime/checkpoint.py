"""Checkpoint files (plain values and tensors; engine/checkpoints.py owns their entries): atomic
saving, weights-only loading (no file runs code), weights of other layouts, RNG states."""
from __future__ import annotations

import contextlib
import errno
import os
import pickle
import random
import re
import zipfile
from collections import OrderedDict
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from torch import nn

from common.errors import CheckpointError, chained_os_reason
from common.paths import written_whole
from models.reference import model_settings, reference_weights, to_ours

FORMAT_VERSION = 1
WEIGHTS_KEYS = ("model", "state_dict", "weights")   # where weights may sit inside a file
WRAPPERS = re.compile(r"^(module\.|_orig_mod\.)+")   # prefixes of DataParallel / DDP and torch.compile
_PLAIN_SCALARS = (type(None), bool, int, float, str, bytes)
TEMP_SUFFIX = ".ckpt-tmp"                            # temporary files of saves in progress
_LISTED = 10                                         # names shown in an error before "and N more"


# ----------------------------------------------------------------------------------------- saving
def _plain(value, where: str):
    """`value` with numpy scalars made Python scalars; TypeError for what weights_only cannot load."""
    if type(value) in _PLAIN_SCALARS or isinstance(value, (torch.Tensor, torch.dtype, torch.device)):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        items = ((_plain(k, where), _plain(v, f"{where}[{k!r}]")) for k, v in value.items())
        return OrderedDict(items) if isinstance(value, OrderedDict) else dict(items)
    if type(value) in (list, tuple, torch.Size):
        items = [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if type(value) is list else type(value)(items)
    raise TypeError(f"checkpoint value {where} is a {type(value).__name__}: only plain types and "
                    "tensors can be saved (so that weights_only loading can read them)")


def save_checkpoint(path, state: dict) -> None:
    """Write `state` + `format_version` to `path` atomically; CheckpointError if it cannot be."""
    path = Path(path)
    state = _plain(dict(state, format_version=FORMAT_VERSION), "state")
    replaced = False
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(path.parent)
        temp = path.with_name(f".{path.name}.{os.getpid()}{TEMP_SUFFIX}")
        with written_whole(path, temp=temp) as temp, open(temp, "wb") as file:
            torch.save(state, file)
        replaced = True
        try:
            fd = os.open(path.parent, os.O_RDONLY)      # the rename made durable
        except OSError:
            return                                   # platforms that cannot open a directory
        try:
            os.fsync(fd)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
                raise
        finally:
            os.close(fd)
    except Exception as exc:
        kept = "; the previous file there, if any, is intact" if not replaced else ""
        raise CheckpointError(f"cannot save checkpoint {path}: {chained_os_reason(exc)}{kept}") from exc


def remove_stale_temps(directory) -> None:
    """Delete the temporary files of killed saves in `directory`."""
    for stale in Path(directory).glob(f".*{TEMP_SUFFIX}"):
        with contextlib.suppress(OSError):
            stale.unlink()


# ---------------------------------------------------------------------------------------- loading
def read_file(path, mmap: bool = False):
    """torch.load(weights_only=True) of `path` to CPU; any failure a CheckpointError naming it."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if path.is_dir():
        raise CheckpointError(f"checkpoint {path} is a directory, not a file")
    try:
        mmap = mmap and zipfile.is_zipfile(path)     # only torch.save's zip format maps; others read whole
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        if code := re.search(r"GLOBAL ([\w.]+)", str(exc)):
            raise CheckpointError(
                f"checkpoint {path} was refused: loading it would execute code from the file "
                f"(it refers to {code.group(1)}); only a file you trust may be converted by hand to a "
                "plain state dict") from None
        detail = re.search(r"WeightsUnpickler error:\s*([^\n]+)", str(exc))
        raise CheckpointError(f"checkpoint {path} is truncated or corrupt, or not written by "
                              f"torch.save ({detail.group(1) if detail else exc})") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, KeyError, IndexError,
            AttributeError, TypeError, OSError) as exc:
        if isinstance(exc, PermissionError):
            raise CheckpointError(f"checkpoint {path} cannot be read: permission denied") from None
        detail = str(exc).split(". ")[0]
        if not isinstance(exc, RuntimeError):
            detail = f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__
        raise CheckpointError(f"checkpoint {path} is truncated or corrupt ({detail})") from None


def load_checkpoint(path, mmap: bool = False) -> dict:
    """A checkpoint written by `save_checkpoint`, on CPU; CheckpointError naming the file otherwise."""
    state = read_file(path, mmap=mmap)
    if not isinstance(state, dict) or "format_version" not in state:
        raise CheckpointError(f"{path} is not a checkpoint of this trainer (no format_version); "
                              "to start from its weights use --weights instead of --resume")
    version = state["format_version"]
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format version {version}, newer than this "
                              f"trainer's {FORMAT_VERSION}: update the trainer to load it")
    return state


def capture_rng_state() -> dict:
    """Python, numpy, torch CPU (and CUDA) generator states as tensors and plain values."""
    version, words, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": {"version": version, "state": torch.tensor(words, dtype=torch.int64), "gauss_next": gauss},
        "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    """Set the generators from `capture_rng_state()`; CUDA states only for devices present."""
    py = state["python"]
    random.setstate((py["version"], tuple(int(w) for w in py["state"].tolist()), py["gauss_next"]))
    npy = state["numpy"]
    np.random.set_state((npy["name"], npy["keys"].numpy().astype(np.uint32), npy["pos"],
                         npy["has_gauss"], npy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        for index, cuda_state in enumerate(state["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, index)


# ------------------------------------------------------------------------------------------ weights
def unwrap_model(model: nn.Module) -> nn.Module:
    """The module inside DataParallel / DistributedDataParallel / torch.compile wrappers."""
    while True:
        if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        else:
            return model


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:_LISTED])
    return shown + (f" and {len(names) - _LISTED} more" if len(names) > _LISTED else "")


def load_weights(model: nn.Module, path_or_state, allow_partial: bool = False, source: str = "") -> dict:
    """Load weights into `model` (unwrapped) from a file or a dict; return {"source", "loaded", "missing",
    "unexpected", "mismatched"}; CheckpointError for a mismatch unless `allow_partial`, or if none load."""
    if isinstance(path_or_state, (str, os.PathLike)):
        source, obj = str(path_or_state), read_file(path_or_state)
    else:
        source, obj = source or "the given state dict", path_or_state
    target = unwrap_model(model)
    reference = reference_weights(obj)
    if reference is not None:       # the authors' layout: renamed by structure, first conv to RGB
        weights = to_ours(reference, target, len(target.stacks[0].hourglass.levels))
    else:                           # the file itself, or under WEIGHTS_KEYS: {"state_dict": {"model": ...}}
        weights = obj
        for _ in range(3):
            if isinstance(weights, dict) and weights and all(
                    isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in weights.items()):
                break
            inner = [weights[k] for k in WEIGHTS_KEYS
                     if isinstance(weights, dict) and isinstance(weights.get(k), dict)]
            weights = inner[0] if inner else None
        else:
            raise CheckpointError(f"{source} holds no weights: expected a state dict of tensors, or one "
                                  f"under a key {', '.join(WEIGHTS_KEYS)}")
    expected = target.state_dict()
    stripped = {WRAPPERS.sub("", k): v for k, v in weights.items()}   # `target` is unwrapped: never added
    weights = max((weights, stripped), key=lambda named: sum(k in expected for k in named))
    missing = [k for k in expected if k not in weights]
    unexpected = [k for k in weights if k not in expected]
    mismatched = [f"{k} (file {list(v.shape)}, model {list(expected[k].shape)})"
                  for k, v in weights.items() if k in expected and v.shape != expected[k].shape]
    matching = {k: v for k, v in weights.items() if k in expected and v.shape == expected[k].shape}
    if not matching:
        raise CheckpointError(
            f"nothing in {source} matches the model: none of its {len(weights)} tensors has the "
            f"name and shape of one of the model's {len(expected)} (file has e.g. "
            f"{_listed(list(weights)[:3])}; model has e.g. {_listed(list(expected)[:3])})")
    if (missing or unexpected or mismatched) and not allow_partial:
        differ = _reference_mismatch(reference, target) if reference is not None else None
        if differ:
            raise CheckpointError(f"{source} holds the authors' network built with other settings "
                                  f"({differ}); pass --allow-partial to load only the "
                                  f"{len(matching)} tensors that fit")
        problems = [f"{len(names)} {what}: {_listed(names)}" for what, names in (
            ("missing from the file", missing), ("not in the model", unexpected),
            ("with another shape", mismatched)) if names]
        raise CheckpointError(f"{source} does not match the model; " + "; ".join(problems)
                              + f"; pass --allow-partial to load only the {len(matching)} "
                              "matching tensors")
    for name, tensor in matching.items():     # load_state_dict would cast another dtype silently
        wanted = expected[name]
        if wanted.is_floating_point() and not (tensor.is_floating_point() or tensor.is_complex()):
            raise CheckpointError(f"{source}: tensor {name} holds {str(tensor.dtype).replace('torch.', '')} "
                                  f"values where the model has {str(wanted.dtype).replace('torch.', '')}: "
                                  "not weights this trainer wrote")
    if unusable := non_finite(matching):
        name, tensor = unusable[0], matching[unusable[0]]
        bad = int((~torch.isfinite(tensor)).sum())
        raise CheckpointError(f"{source}: tensor {name} holds {bad} NaN or infinite values of "
                              f"{tensor.numel()}: these weights are unusable (a run that diverged?); "
                              "use an earlier checkpoint")
    target.load_state_dict(matching, strict=False)
    return {"source": source, "loaded": len(matching), "missing": missing,
            "unexpected": unexpected, "mismatched": mismatched,
            "converted": REFERENCE_NOTE if reference is not None else ""}


def non_finite(weights: dict) -> list[str]:
    """Names of the floating-point tensors of `weights` that hold a NaN or an infinite value."""
    return [name for name, tensor in weights.items()
            if torch.is_tensor(tensor) and tensor.is_floating_point() and tensor.numel()
            and not bool(torch.isfinite(tensor).all())]


REFERENCE_NOTE = "the authors' layout (posenet.*), converted in memory: names mapped, first conv BGR -> RGB"


def settings_difference(there: dict, here: dict) -> dict:
    """{setting: (value there, value here)} for the settings both dicts have and that differ."""
    return {k: (v, here[k]) for k, v in there.items()
            if k in here and here[k] != v and k != "max_params_m"}     # a size limit, not the network


def listed_difference(differ: dict, prefix: str = "model.") -> str:
    return "; ".join(f"{prefix}{k} {there} there, {here} here" for k, (there, here) in differ.items())


def _reference_mismatch(reference: dict, model: nn.Module) -> str | None:
    """Which settings of the network in a file of the authors' layout differ from `model`'s."""
    found, config = model_settings(reference), getattr(model, "config", None)
    if found is None or config is None:
        return None
    settings, out_channels = found
    differ = settings_difference(settings, asdict(config))
    parts = [listed_difference(differ)] if differ else []
    if out_channels != getattr(model, "out_channels", out_channels):
        parts.append(f"{out_channels} output channels there, {model.out_channels} here")
    return "; ".join(parts) or None


def read_reference(path) -> dict:
    """A file of the authors' layout, loaded; CheckpointError naming the file for any other."""
    obj = read_file(path)
    if reference_weights(obj) is None:
        raise CheckpointError(f"{path} is not a checkpoint of the authors' layout (a dict whose "
                              "'weights' are a state dict under posenet.)")
    return obj


def reference_file_settings(path) -> dict | None:
    """The `model.*` settings of a file in the authors' layout, or None for any other file."""
    try:
        reference = reference_weights(read_file(path, mmap=True))
    except CheckpointError:
        return None
    found = model_settings(reference) if reference is not None else None
    return found[0] if found else None
