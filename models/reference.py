"""The Simple Pose authors' checkpoint on this project's IMHN: `weights` (under `posenet.`, maybe `module.`),
`optimizer_weight` (SGD state by parameter index), `train_loss`, `epoch` (0-based, finished), maybe an
Apex `amp` state; names map by structure (`reference_name`, `name_map`), the first conv BGR -> RGB."""
from __future__ import annotations

import re

import torch
from torch import nn

PREFIX = "posenet."
WRAPPER = re.compile(r"^(module\.)+")   # DataParallel / DDP, when the file was saved from one
FIRST_CONV = "stem.conv.0.weight"
SECTIONS = ("pre.", "hourglass.", "features.", "outs.", "merge_features.", "merge_preds.")
COUNTER = "num_batches_tracked"

# our bottleneck's children -> the reference residual's (conv, BN) slots
_RESIDUAL = {"reduce.0": "convBlock.0", "reduce.1": "convBlock.1", "conv.0": "convBlock.3",
             "conv.1": "convBlock.4", "expand.0": "convBlock.6", "expand.1": "convBlock.7",
             "shortcut.0": "skipConv.0", "shortcut.1": "skipConv.1"}
_CONV_BN = {"0": "conv", "1": "bn"}                       # our ConvBN children -> theirs
_LEVEL_PART = {"skip": "0", "down": "1", "up_reduce": "2"}
_HEAD_CONV = {"conv1": "0", "conv2": "1"}
_SE = {"squeeze": "0", "excite": "2"}
_MERGE = {"from_features": "merge_features", "from_prediction": "merge_preds"}


def _residual(rest: str) -> str:
    part, tensor = rest.rsplit(".", 1)
    return f"{_RESIDUAL[part]}.{tensor}"


def reference_name(name: str, depth: int) -> str:
    """The reference's key (without `posenet.`) of our state-dict key `name` in an IMHN of `depth`."""
    rules = (
        (r"stem\.conv\.(\d)\.(\w+)$", lambda m: f"pre.{'conv1' if m[1] == '0' else 'bn1'}.{m[2]}"),
        (r"stem\.(res[12])\.(.+)$", lambda m: f"pre.{m[1]}.{_residual(m[2])}"),
        (r"stem\.context\.convs\.(\d+)\.(\d)\.(\w+)$",
         lambda m: f"pre.dilation.{m[1]}.{_CONV_BN[m[2]]}.{m[3]}"),
        (r"stacks\.(\d+)\.hourglass\.levels\.(\d+)\.(skip|down|up_reduce)\.(.+)$",
         lambda m: f"hourglass.{m[1]}.hg.{m[2]}.{_LEVEL_PART[m[3]]}.{_residual(m[4])}"),
        (r"stacks\.(\d+)\.hourglass\.levels\.(\d+)\.up_conv\.(\d)\.(\w+)$",
         lambda m: f"hourglass.{m[1]}.hg.{m[2]}.3.{_CONV_BN[m[3]]}.{m[4]}"),
        (r"stacks\.(\d+)\.hourglass\.bottom\.(.+)$",
         lambda m: f"hourglass.{m[1]}.hg.{depth - 1}.4.{_residual(m[2])}"),
        (r"stacks\.(\d+)\.heads\.(\d+)\.(conv[12])\.(\d)\.(\w+)$",
         lambda m: f"features.{m[1]}.before_regress.{m[2]}.{_HEAD_CONV[m[3]]}.{_CONV_BN[m[4]]}.{m[5]}"),
        (r"stacks\.(\d+)\.heads\.(\d+)\.se\.(squeeze|excite)\.(\w+)$",
         lambda m: f"features.{m[1]}.before_regress.{m[2]}.2.fc.{_SE[m[3]]}.{m[4]}"),
        (r"stacks\.(\d+)\.heads\.(\d+)\.predict\.(\w+)$", lambda m: f"outs.{m[1]}.{m[2]}.conv.{m[3]}"),
        (r"stacks\.(\d+)\.merge\.(\d+)\.(from_features|from_prediction)\.(\d)\.(\w+)$",
         lambda m: f"{_MERGE[m[3]]}.{m[1]}.{m[2]}.conv.{_CONV_BN[m[4]]}.{m[5]}"),
    )
    for pattern, rename in rules:
        if match := re.match(pattern, name):
            return rename(match)
    raise KeyError(f"no reference counterpart for {name}")


def name_map(model: nn.Module, depth: int) -> dict[str, str]:
    """{reference key: our key} of `model`'s state dict, in the reference's order (stable sort by section)."""
    ours = {reference_name(k, depth): k for k in model.state_dict()}
    section = {k: next(i for i, s in enumerate(SECTIONS) if k.startswith(s)) for k in ours}
    return {k: ours[k] for k in sorted(ours, key=section.get)}


def reference_weights(obj) -> dict[str, torch.Tensor] | None:
    """The reference state dict (without `module.` / `posenet.`) of an authors' file, else None."""
    weights = obj.get("weights") if isinstance(obj, dict) else None
    if not isinstance(weights, dict) or not weights:
        return None
    keys = [WRAPPER.sub("", k) if isinstance(k, str) else "" for k in weights]
    if not all(k.startswith(PREFIX) for k in keys):
        return None
    return {k[len(PREFIX):]: v for k, v in zip(keys, weights.values()) if isinstance(v, torch.Tensor)}


def _count(keys, pattern: str) -> int:
    found = [int(m[1]) for m in (re.match(pattern, k) for k in keys) if m]
    return max(found) + 1 if found else 0


def model_settings(weights: dict[str, torch.Tensor]) -> tuple[dict, int] | None:
    """(`model.*` settings, output channels) of a reference state dict, from its shapes; or None."""
    try:
        shape = {k: tuple(v.shape) for k, v in weights.items()}
        channels = shape["hourglass.0.hg.0.0.convBlock.6.weight"][0]
        head = shape["features.0.before_regress.0.0.conv.weight"][0]
        se = "features.0.before_regress.0.2.fc.0.weight" in shape
        settings = {
            "stacks": _count(shape, r"hourglass\.(\d+)\."),
            "depth": _count(shape, r"hourglass\.0\.hg\.(\d+)\."),
            "channels": channels,
            "increase": shape["hourglass.0.hg.0.1.convBlock.6.weight"][0] - channels,
            "head_channels": head,
            "stem_channels": shape["pre.conv1.weight"][0],
            "se": se,
        }
        if se:
            settings["se_reduction"] = head // shape["features.0.before_regress.0.2.fc.0.weight"][0]
        return settings, shape["outs.0.0.conv.weight"][0]
    except (KeyError, IndexError):
        return None


def to_ours(weights: dict[str, torch.Tensor], model: nn.Module, depth: int) -> dict[str, torch.Tensor]:
    """A reference state dict renamed to `model`'s keys, first conv BGR -> RGB, counters added."""
    names = name_map(model, depth)
    ours = {names.get(k, k): v for k, v in weights.items()}
    for key, value in model.state_dict().items():
        if key.endswith(COUNTER) and key not in ours:
            ours[key] = torch.zeros_like(value)
    first = ours.get(FIRST_CONV)
    if first is not None and first.dim() == 4 and first.shape[1] == 3:
        ours[FIRST_CONV] = first.flip(1)
    return ours


def parameter_keys(model: nn.Module, depth: int) -> list[str]:
    """Our parameter names in the reference's parameter order: the index its optimiser uses."""
    params = {name for name, _ in model.named_parameters()}
    return [ours for ours in name_map(model, depth).values() if ours in params]


def momentum_by_name(optimizer_state: dict, model: nn.Module, depth: int) -> dict[str, torch.Tensor]:
    """{our parameter name: SGD momentum buffer} from the reference's `optimizer_weight` (keyed by
    the reference's parameter index); ValueError with the reason when it does not fit."""
    if not isinstance(optimizer_state, dict) or "state" not in optimizer_state:
        raise ValueError("optimizer_weight is not an optimiser state dict")
    ids = [i for group in optimizer_state.get("param_groups", []) for i in group.get("params", [])]
    keys = parameter_keys(model, depth)
    if len(ids) != len(keys):
        raise ValueError(f"its optimiser has {len(ids)} parameters, the model {len(keys)}")
    shapes = dict(model.named_parameters())
    found = {}
    for index, key in zip(ids, keys):
        buffer = optimizer_state["state"].get(index, {}).get("momentum_buffer")
        if buffer is None:
            continue
        if tuple(buffer.shape) != tuple(shapes[key].shape):
            raise ValueError(f"the momentum of parameter {index} has shape {list(buffer.shape)}, "
                             f"its parameter {key} {list(shapes[key].shape)}")
        found[key] = buffer.flip(1) if key == FIRST_CONV else buffer
    return found
