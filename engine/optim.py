"""Optimiser construction, the learning rate as a pure function of (epoch, iteration), and the
gradient norm (in float32 at every opt level) with its clipping.

`lr_at` is the schedule: linear warm-up over `warmup_epochs`, then step decay; a resumed run, or
one with another number of processes, follows the same curve. With `reference_batch` N the peak is
`lr x total batch / N`. `updates_rounded_away` measures what O3's half weights lose per step.
"""
from __future__ import annotations

import torch

from config.schema import OptimConfig


def peak_lr(cfg: OptimConfig, total_batch: int | None = None, world_size: int = 1) -> float:
    """The LR after warm-up: `lr` x total batch / `reference_batch` (if set; or x the world size)."""
    base = cfg.lr * (world_size if cfg.scale_lr_by_world_size else 1)
    if cfg.reference_batch and total_batch:
        base *= total_batch / cfg.reference_batch
    return base


def lr_at(cfg: OptimConfig, epoch: int, iteration: int, iters_per_epoch: int,
          world_size: int = 1, total_batch: int | None = None) -> float:
    """The LR at 0-based (`epoch`, `iteration`) for a total batch of `total_batch`."""
    base = peak_lr(cfg, total_batch, world_size)
    if cfg.milestones:
        drops = sum(1 for m in cfg.milestones if epoch >= int(m))
    elif cfg.decay_every > 0:
        drops = epoch // cfg.decay_every
    else:
        drops = 0
    factor = cfg.decay_factor ** drops
    warmup_steps = cfg.warmup_epochs * iters_per_epoch
    step = epoch * iters_per_epoch + iteration
    if warmup_steps > 0 and step < warmup_steps:
        factor *= cfg.warmup_start + (1.0 - cfg.warmup_start) * (step + 1) / warmup_steps
    return base * factor


def build_optimizer(params, cfg: OptimConfig, zero: bool = False, device_type: str = "cpu",
                    native: bool = True):
    """SGD or AdamW over `params` (ZeRO-sharded when `zero`; fused as `optim.fused` says)."""
    params = list(params)
    fused = device_type == "cuda" and (cfg.fused is True or (cfg.fused == "auto" and native))
    if cfg.name == "sgd":
        cls, kwargs = torch.optim.SGD, dict(lr=cfg.lr, momentum=cfg.momentum,
                                           weight_decay=cfg.weight_decay)
    else:
        cls, kwargs = torch.optim.AdamW, dict(lr=cfg.lr, betas=tuple(cfg.betas),
                                             weight_decay=cfg.weight_decay)
    if fused:
        kwargs["fused"] = True
    if zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        return ZeroRedundancyOptimizer(params, optimizer_class=cls, **kwargs)
    return cls(params, **kwargs)


def grad_norm(params) -> torch.Tensor:
    """L2 norm of the gradients of `params`, in float32 (a float16 norm overflows at 65504)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)))


def updates_rounded_away(params, lr: float, cfg: OptimConfig) -> tuple[float, float] | None:
    """For the half weights in `params`: (the share whose non-zero first update of `lr` rounds away,
    being under half their type's spacing; the same for the weight decay alone), the update being
    lr x (grad + wd x w) for SGD, lr x (sign(grad) + wd x w) for AdamW. None without such weights."""
    halves = [p for p in params if p.dtype in (torch.float16, torch.bfloat16) and p.grad is not None]
    if not halves:
        return None
    counts = torch.zeros(4, dtype=torch.float64, device=halves[0].device)
    for p in halves:
        w, grad = p.detach().float(), p.grad.detach().float()
        direction = grad if cfg.name == "sgd" else grad.sign()
        for i, update in enumerate((lr * (direction + cfg.weight_decay * w), lr * cfg.weight_decay * w)):
            meant = update != 0
            kept = (w - update).to(p.dtype).float() == w
            counts[2 * i:2 * i + 2] += torch.stack([(meant & kept).sum(), meant.sum()])
    lost, moving, decay_lost, decaying = counts.tolist()
    return lost / max(moving, 1), decay_lost / max(decaying, 1)


def rounding_note(params, lr: float, cfg: OptimConfig) -> str:
    """One line on `updates_rounded_away(params, lr, cfg)`; '' without half weights."""
    shares = updates_rounded_away(params, lr, cfg)
    if shares is None:
        return ""
    dtype = str(next(p.dtype for p in params if p.dtype in (torch.float16, torch.bfloat16)))[6:]
    return (f"{dtype} weights without float32 masters: at the peak lr {lr:g}, {shares[0]:.0%} of "
            "the first step's updates round away (under half the spacing at the weight)"
            + (f", and {shares[1]:.0%} of its weight decay" if cfg.weight_decay else "")
            + "; --opt-level O2 keeps float32 master weights")


def clip_grads(params, max_norm: float, norm: torch.Tensor) -> None:
    """Scale the gradients down to `max_norm` when their `norm` (finite, from `grad_norm`) exceeds it."""
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
