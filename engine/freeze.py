"""Freezing parts of the model (`--freeze PATTERN...`): a pattern names modules or parameters by
prefix on whole name parts or by an fnmatch glob; a tensor `--allow-partial` left fresh stays trainable."""
from __future__ import annotations

from fnmatch import fnmatchcase

from torch import nn

from common.errors import ConfigError
from models.imhn import count_parameters
from runtime.checkpoint import unwrap_model


def _matches(name: str, pattern: str) -> bool:
    """Whether `pattern` names `name` or one of its enclosing modules."""
    parts = name.split(".")
    prefixes = (".".join(parts[:n]) for n in range(1, len(parts) + 1))
    return any(prefix == pattern or fnmatchcase(prefix, pattern) for prefix in prefixes)


def freeze(model: nn.Module, patterns: list[str], fresh=()) -> dict:
    """Freeze what `patterns` name but the `fresh` tensors; return {"frozen", "trainable", "modules"
    (the outermost frozen), "all_modules" (every module frozen, by name: for `set_frozen_bn_eval`),
    "fresh"}. ConfigError when a pattern matches nothing or nothing is left to train."""
    model = unwrap_model(model)
    modules = [(name, module) for name, module in model.named_modules() if name]
    names = [name for name, _ in modules] + [name for name, _ in model.named_parameters()]
    for pattern in patterns:
        if not any(_matches(name, pattern) for name in names):
            top = [name for name, _ in model.named_children()]
            shown = ", ".join(top[:12]) + (" ..." if len(top) > 12 else "")
            raise ConfigError(f"--freeze pattern '{pattern}' matches no module of the model; "
                              f"top-level modules: {shown}")
    fresh = set(fresh)
    matched = [name for name, module in modules if any(_matches(name, p) for p in patterns)
               and not any(f"{name}.{own}" in fresh for own, _ in module.named_parameters(recurse=False))]
    named = [(name, p) for name, p in model.named_parameters() if any(_matches(name, q) for q in patterns)]
    to_freeze = [p for name, p in named if name not in fresh]
    frozen_ids = {id(p) for p in to_freeze}
    if patterns and not any(p.requires_grad and id(p) not in frozen_ids for p in model.parameters()):
        raise ConfigError(f"--freeze {' '.join(patterns)} freezes all {count_parameters(model, True)} "
                          "trainable parameters of the model: nothing would be left to train")
    for parameter in to_freeze:
        parameter.requires_grad_(False)
    return {"frozen": count_parameters(model, False), "trainable": count_parameters(model, True),
            "modules": [name for name in matched if not any(
                name.startswith(other + ".") for other in matched)], "all_modules": matched,
            "fresh": [name for name, _ in named if name in fresh]}


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def set_frozen_bn_eval(model: nn.Module, frozen_modules=()) -> int:
    """Put frozen BatchNorm layers in eval mode (after every `model.train()`); return how many. By name in
    `frozen_modules` (`freeze()`'s "all_modules"; SyncBN keeps it), so one without parameters counts too."""
    count, frozen_modules = 0, set(frozen_modules)
    for name, module in unwrap_model(model).named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            params = list(module.parameters())
            if name in frozen_modules or (params and not any(p.requires_grad for p in params)):
                module.eval()
                count += 1
    return count
