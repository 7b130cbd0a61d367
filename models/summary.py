"""Parameter and MAC counts of a model, measured from the model itself, and a CLI that prints them.
MACs are counted with forward hooks on conv and linear layers, on the `meta` device."""
from __future__ import annotations

import contextlib
import json
import sys
from collections import defaultdict
from itertools import accumulate

import torch
from torch import nn
from torch.func import functional_call

from common.errors import ArgumentParser, run_cli
from config.loader import build_config, check_input_size
from config.schema import add_flags
from data.skeleton import load_skeleton
from models.imhn import build_model, count_parameters, eval_mode


def count_macs(model: nn.Module, input_size: int | tuple[int, int]) -> tuple[int, dict[str, int]]:
    """(MACs of one `input_size` image, {leaf module name: MACs}) of the model's forward."""
    height, width = (input_size, input_size) if isinstance(input_size, int) else input_size
    per_module: dict[str, int] = defaultdict(int)
    meta_state = {name: torch.empty_like(t, device="meta")
                  for name, t in list(model.named_parameters()) + list(model.named_buffers())}
    with contextlib.ExitStack() as hooks, eval_mode(model):
        for name, module in model.named_modules():
            if isinstance(module, (nn.Conv2d, nn.Linear)):      # a MAC per output element and weight it meets
                def hook(mod, inputs, output, name=name):
                    per_module[name] += output.numel() * mod.weight[0].numel()    # Linear's: in_features
                hooks.callback(module.register_forward_hook(hook).remove)
        functional_call(model, meta_state, (torch.zeros(1, 3, height, width, device="meta"),))
    return sum(per_module.values()), dict(per_module)


def group_counts(counts: dict[str, int], depth: int) -> dict[str, int]:
    """Sum `counts` by name prefix of `depth` non-numeric parts (`stem.res1`, `stacks.0.heads`)."""
    grouped: dict[str, int] = defaultdict(int)
    for name, value in counts.items():
        parts = name.split(".")
        named_before = accumulate((not part.isdigit() for part in parts), initial=0)
        grouped[".".join(part for part, named in zip(parts, named_before) if named < depth)] += value
    return grouped


def _main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m models.summary", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", "--config", default="imhn",
                        help="config preset name or YAML path (default imhn, the paper's network)")
    parser.add_argument("--input", type=int, default=0, help="input size in pixels (default: the preset's)")
    parser.add_argument("--depth", type=int, default=2,
                        help="breakdown by this many named levels (2: stacks.0.heads)")
    add_flags(parser, (), "model.stacks=2")
    parser.add_argument("--skeleton", default="coco", metavar="NAME|FILE.yaml",
                        help="the skeleton whose channels the heads output (default coco)")
    args = parser.parse_args(argv)
    cfg = build_config(args.preset, sets=args.set)
    size = args.input or cfg.data.input_size
    check_input_size(size, cfg.model.depth, "--input")
    with torch.device("meta"):
        model = build_model(cfg.model, load_skeleton(args.skeleton))
    total_macs, macs = count_macs(model, size)
    macs = group_counts(macs, args.depth)
    params = group_counts({name: p.numel() for name, p in model.named_parameters()}, args.depth)
    total_params = count_parameters(model)
    print(f"{'module':<28} {'params (M)':>12} {'GMAC':>10}")
    for name in dict.fromkeys(list(params) + list(macs)):
        print(f"{name:<28} {params.get(name, 0) / 1e6:12.3f} {macs.get(name, 0) / 1e9:10.3f}")
    print(f"{'total':<28} {total_params / 1e6:12.3f} {total_macs / 1e9:10.3f}")
    print(json.dumps({"preset": args.preset, "input": size, "parameters": total_params,
                      "params_m": round(total_params / 1e6, 3),
                      "macs": total_macs, "gmacs": round(total_macs / 1e9, 3)}))
    return 0


def main(argv=None) -> int:
    return run_cli(_main, argv, kept="nothing was written")


if __name__ == "__main__":
    sys.exit(main())
