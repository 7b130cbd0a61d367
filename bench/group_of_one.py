"""Train through a real process group of ONE rank (NCCL on one GPU, gloo on a CPU): DDP, ZeRO, SyncBN
and the backend's collectives, with every train.py flag. A 1-process torchrun makes no group.

    python bench/group_of_one.py --device cpu --epochs 1 --set train.max_steps_per_epoch=2
"""
from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as torch_dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime import distributed as dist                     # noqa: E402
from engine.parallel import CrossProcessBatchNorm              # noqa: E402
from engine.cli import build_parser, config_from_args, run_main, single_process_context  # noqa: E402
from engine.run_trainer import Launch, build_trainer                  # noqa: E402
from inference.evaluation import training_evaluator        # noqa: E402


def force_sync_function(model: nn.Module) -> int:
    """Route every nn.SyncBatchNorm's training forward through its distributed function; how many."""
    from torch.nn.modules._functions import SyncBatchNorm as SyncFunction
    layers = [m for m in model.modules() if isinstance(m, nn.SyncBatchNorm)]
    for layer in layers:
        plain = layer.forward

        def forward(input, layer=layer, plain=plain):
            if not layer.training:
                return plain(input)
            if layer.num_batches_tracked is not None:
                layer.num_batches_tracked.add_(1)
            momentum = 1.0 / float(layer.num_batches_tracked) if layer.momentum is None else layer.momentum
            group = layer.process_group or torch_dist.group.WORLD
            return SyncFunction.apply(input, layer.weight, layer.bias, layer.running_mean,
                                      layer.running_var, layer.eps, momentum, group,
                                      torch_dist.get_world_size(group))
        layer.forward = forward
    return len(layers)


def join_group_of_one(device: torch.device, timeout_s: float) -> str:
    """This process as the one rank of a process group (NCCL on a GPU, gloo on a CPU); its backend."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    store = torch_dist.TCPStore("127.0.0.1", 0, 1, is_master=True)     # port 0: the system picks
    torch_dist.init_process_group(backend, store=store, rank=0, world_size=1,
                                  timeout=timedelta(seconds=timeout_s),
                                  device_id=device if backend == "nccl" else None)
    return backend


def main(argv=None) -> dict:
    parser = build_parser(__doc__)
    parser.add_argument("--force-sync-function", action="store_true",
                        help="force SyncBatchNorm's distributed function (a group of one skips it)")
    args = parser.parse_args(argv)
    cfg = config_from_args(args)
    ctx = single_process_context(cfg.train.device)
    ctx.backend, ctx.distributed = join_group_of_one(ctx.device, cfg.dist.timeout_s), True
    try:
        trainer = build_trainer(cfg, Launch(ctx, mode="ddp"), training_evaluator())
        sync_bn = sum(isinstance(m, CrossProcessBatchNorm) or "SyncBatchNorm" in type(m).__name__
                      for m in trainer.model.modules())
        if args.force_sync_function:
            print(f"{force_sync_function(trainer.model)} nn.SyncBatchNorm layers forced through "
                  "the distributed function", flush=True)
        print(f"group of one: backend {torch_dist.get_backend()}, model wrapped as "
              f"{type(trainer.net).__module__}.{type(trainer.net).__name__}, optimiser {type(trainer.optim_step.optimizer).__name__}, "
              f"{sync_bn} SyncBN layers", flush=True)
        return trainer.fit()
    finally:
        dist.cleanup()


if __name__ == "__main__":
    run_main(main)
