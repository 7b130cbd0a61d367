"""Files in the Simple Pose authors' layout, built by the tests themselves (nothing is downloaded).

Weights follow the rule of `tests/data/fidelity/NOTICE.md` (splitmix64 of salt, tensor index and
element index; no random generator), so that the reference's own outputs for them
(`golden_s1.npz`) can be compared with ours. For the full network the tensor list is the
reference's (`reference_state_dict.tsv`); for smaller sizes it is the same layout made from our
model by `models.reference`, which a test checks to give exactly the TSV for the full network.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from models.reference import FIRST_CONV, PREFIX, name_map

FIDELITY = Path(__file__).resolve().parent / "data" / "fidelity"
TSV = FIDELITY / "reference_state_dict.tsv"
GOLDEN = FIDELITY / "golden_s1.npz"


def tsv_entries() -> list[tuple[str, tuple[int, ...]]]:
    """(reference key, shape) of each of the 1560 tensors, in the file's order."""
    rows = [line.rstrip("\n").split("\t") for line in TSV.read_text().splitlines()[1:]]
    return [(key, tuple(int(d) for d in shape.strip("()").split(",") if d.strip()))
            for key, shape, _ in rows]


def model_entries(model, depth: int) -> list[tuple[str, tuple[int, ...]]]:
    """The same list for any IMHN (BatchNorm counters left out, as in the TSV)."""
    state = model.state_dict()
    return [(ref, tuple(state[ours].shape)) for ref, ours in name_map(model, depth).items()
            if not ref.endswith("num_batches_tracked")]


def to_reference(state: dict[str, torch.Tensor], model, depth: int) -> dict:
    """Our state dict in the authors' layout: the inverse of `models.reference.to_ours`."""
    return {PREFIX + ref_key: state[key].flip(1) if key == FIRST_CONV else state[key]
            for ref_key, key in name_map(model, depth).items()}


def _splitmix64_(x: np.ndarray) -> np.ndarray:
    """splitmix64 of every element of a uint64 array, in place (wrap-around arithmetic)."""
    with np.errstate(over="ignore"):
        x += np.uint64(0x9E3779B97F4A7C15)
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x


def rule_tensor(key: str, shape: tuple[int, ...], index: int, salt: int) -> torch.Tensor:
    """Tensor `index` of the weight rule, float64."""
    n = int(np.prod(shape, dtype=np.int64))
    x = np.arange(n, dtype=np.uint64)
    x += np.uint64((salt * 2 ** 48 + index * 2 ** 32) % 2 ** 64)
    _splitmix64_(x)
    x >>= np.uint64(11)
    u = x.astype(np.float64)
    u *= 2.0 ** -53
    if key.endswith(".running_var") or (key.endswith(".weight") and len(shape) == 1):
        u += 0.5
    elif key.endswith(".bias") or key.endswith(".running_mean"):
        u *= 0.2
        u -= 0.1
    else:                                                  # conv and linear weights
        bound = np.sqrt(3.0 / np.prod(shape[1:]))
        u *= 2 * bound
        u -= bound
    return torch.from_numpy(u.reshape(shape))


def rule_weights(entries, salt: int = 1, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """{reference key: tensor} by the rule, in the entries' order."""
    return {key: rule_tensor(key, shape, k, salt).to(dtype) for k, (key, shape) in enumerate(entries)}


def reference_file(path, weights: dict, module_prefix: bool = False, counters: bool = True,
                   epoch: int = 7, momentum: bool = True, amp: dict | None = None) -> Path:
    """Write a checkpoint as the reference's training script does: `weights` under `posenet.`
    (and `module.`), BatchNorm counters or not, SGD state by parameter index, loss and epoch."""
    prefix = ("module." if module_prefix else "") + PREFIX
    state = {}
    for key, value in weights.items():
        state[prefix + key] = value
        if counters and key.endswith(".running_var"):
            state[prefix + key[:-len("running_var")] + "num_batches_tracked"] = torch.tensor(100)
    params = [(k, v) for k, v in weights.items() if not k.endswith(("running_mean", "running_var"))]
    optimizer = {"state": {i: {"momentum_buffer": torch.full_like(v, float(i))}
                           for i, (_, v) in enumerate(params)} if momentum else {},
                 "param_groups": [{"lr": 1e-5, "momentum": 0.9, "dampening": 0, "weight_decay": 5e-4,
                                   "nesterov": False, "params": list(range(len(params)))}]}
    checkpoint = {"weights": state, "optimizer_weight": optimizer, "train_loss": 0.5, "epoch": epoch}
    if amp is not None:
        checkpoint["amp"] = amp
    torch.save(checkpoint, path)
    return Path(path)
