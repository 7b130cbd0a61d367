"""Optimiser construction, the learning rate as a pure function of (epoch, iteration), and the
gradient norm (in float32 at every opt level) with its clipping.

`lr_at` is the whole schedule: linear warm-up by iteration over the first `warmup_epochs`, then
step decay (x `decay_factor` at each milestone epoch, or every `decay_every` epochs). Because it
depends only on where the run is, a resumed run, or one continued with another number of
processes (the total batch, hence iterations per epoch, stays the same), follows the same curve.
The peak is `lr`, or with `reference_batch` N the linear scaling rule `lr x total batch / N`, the
total batch being batch_size x accumulate: the same in train.py, train_parallel.py and DDP.

`updates_rounded_away` measures what half-precision weights stepped without float32 master copies
(O3) lose: the share of the updates of a step that round away in the weights (`rounding_note`:
the line the first step says).
"""
from __future__ import annotations

import torch

from config.schema import OptimConfig


def peak_lr(cfg: OptimConfig, total_batch: int | None = None, world_size: int = 1) -> float:
    """The LR after warm-up and before decay: `lr`, scaled by total batch / `reference_batch` when
    that is set (0: not scaled), or by the world size under the legacy `scale_lr_by_world_size`."""
    base = cfg.lr * (world_size if cfg.scale_lr_by_world_size else 1)
    if cfg.reference_batch and total_batch:
        base *= total_batch / cfg.reference_batch
    return base


def lr_at(cfg: OptimConfig, epoch: int, iteration: int, iters_per_epoch: int,
          world_size: int = 1, total_batch: int | None = None) -> float:
    """The learning rate for iteration `iteration` (0-based) of epoch `epoch` (0-based), at a total
    batch (batch_size x accumulate, over all processes) of `total_batch`."""
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


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def build_optimizer(params, cfg: OptimConfig, zero: bool = False, device_type: str = "cpu",
                    native: bool = True):
    """SGD (momentum, weight decay) or AdamW over `params`; ZeroRedundancyOptimizer when `zero`.
    Fused kernels on CUDA when `optim.fused` says so (auto: with the `native` precision backend)."""
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
    """L2 norm of the gradients of `params`, accumulated in float32 whatever their dtype: under O3
    float16 a norm computed in float16 reads inf above 65504 although every gradient is finite."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)))


def updates_rounded_away(params, lr: float, cfg: OptimConfig) -> tuple[float, float] | None:
    """For the half-precision weights in `params` (float16, bfloat16: O3's): (the share of their
    values that a first step of `lr` from the current gradients would leave unchanged, though its
    update is not zero, because the update is under half the spacing of the weight's type at the
    weight; the same share for the weight decay alone). The first step's update is
    lr x (grad + weight_decay x w) for SGD (momentum scales later ones by up to 1 / (1 -
    momentum)), lr x (sign(grad) + weight_decay x w) for AdamW. None without such weights with
    gradients. One host read."""
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
