"""The optimiser, the LR as a pure function of the step, and `OptimStep.update`: one host sync per
step (a bad loss poisons its backward with NaN instead of being read; the flags are all-reduced)."""
from __future__ import annotations

import contextlib
import math
from typing import Callable

import torch
from torch import nn

from config.schema import OptimConfig
from runtime import distributed as dist
from engine.trainer import StepResult


def peak_lr(cfg: OptimConfig, total_batch: int | None = None, world_size: int = 1) -> float:
    """The LR after warm-up: `lr` x total batch / `reference_batch` (if set; or x the world size)."""
    base = cfg.lr * (world_size if cfg.scale_lr_by_world_size else 1)
    if cfg.reference_batch and total_batch:
        base *= total_batch / cfg.reference_batch
    return base


def milestone_epochs(cfg: OptimConfig, epochs: int | None) -> list[int]:
    """`optim.milestones` in epochs: a value below 1 is a share of the run's `epochs`, rounded."""
    if epochs is None and any(m < 1 for m in cfg.milestones):
        raise ValueError(f"optim.milestones {cfg.milestones} holds shares of the run: give its epochs")
    return [round(m * epochs) if m < 1 else int(m) for m in cfg.milestones]


def lr_at(cfg: OptimConfig, epoch: int, iteration: int, iters_per_epoch: int,
          world_size: int = 1, total_batch: int | None = None, epochs: int | None = None) -> float:
    """The LR at 0-based (`epoch`, `iteration`): linear warm-up, then step decay; a resumed run, or one
    with another number of processes, follows the same curve."""
    base = peak_lr(cfg, total_batch, world_size)
    drops = (sum(1 for m in milestone_epochs(cfg, epochs) if epoch >= m) if cfg.milestones
             else epoch // cfg.decay_every if cfg.decay_every > 0 else 0)
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
    cls, kwargs = ((torch.optim.SGD, {"momentum": cfg.momentum}) if cfg.name == "sgd"
                   else (torch.optim.AdamW, {"betas": tuple(cfg.betas)}))
    kwargs.update(lr=cfg.lr, weight_decay=cfg.weight_decay, **({"fused": True} if fused else {}))
    if zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        return ZeroRedundancyOptimizer(params, optimizer_class=cls, **kwargs)
    return cls(params, **kwargs)


def load_optimizer_state(optimizer, state: dict) -> None:
    """`optimizer.load_state_dict(state)`, with fused or capturable groups' `step` counters moved to
    their parameter's device in float32: ZeRO's loading puts them on the CPU, which fused AdamW refuses."""
    optimizer.load_state_dict(state)
    inner = getattr(optimizer, "optim", optimizer)          # ZeRO's local optimiser
    for group in inner.param_groups:
        if group.get("fused") or group.get("capturable"):
            for param in group["params"]:
                step = inner.state.get(param, {}).get("step")
                if torch.is_tensor(step):
                    inner.state[param]["step"] = step.to(param.device, torch.float32)


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
    if (shares := updates_rounded_away(params, lr, cfg)) is None:
        return ""
    dtype = str(next(p.dtype for p in params if p.dtype in (torch.float16, torch.bfloat16)))[6:]
    return (f"{dtype} weights without float32 masters: at the peak lr {lr:g}, {shares[0]:.0%} of "
            "the first step's updates round away (under half the spacing at the weight)"
            + (f", and {shares[1]:.0%} of its weight decay" if cfg.weight_decay else "")
            + "; --opt-level O2 keeps float32 master weights")


class OptimStep:
    def __init__(self, precision, optimizer, params: list, model: nn.Module, cfg: OptimConfig,
                 net: nn.Module | None = None, static_graph: bool = False, rounding_lr: float | None = None):
        """`rounding_lr`: the LR at which the first step measures half weights' rounding (`note`)."""
        self.precision, self.optimizer, self.params, self.cfg = precision, optimizer, params, cfg
        self.net, self.static_graph, self.rounding_lr = net, static_graph, rounding_lr
        self.buffers = list(model.buffers())    # restored when a step is skipped (BN statistics)
        self.buffers_before_step = [b.clone() for b in self.buffers]
        self.skipped_total, self.bad_streak = 0, 0
        self.overflow_streak = 0    # the last skips in a row with a finite loss: gradients that overflowed

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def update(self, batches: list, loss_of: Callable[..., torch.Tensor],
               stop_requested: Callable[[], bool] = lambda: False) -> StepResult:
        """One step over `batches` (`loss_of(*batch)` each): backward, unscale, norm, the one read,
        clipping, step or skip (BatchNorm statistics put back); the loss is the batches' mean."""
        if self.buffers:                 # one multi-tensor copy, not a kernel per buffer
            torch._foreach_copy_(self.buffers_before_step, self.buffers)
        loss_sum = bad = None
        no_sync = getattr(self.net, "no_sync", None)     # DDP's, on every batch but the step's last
        for i, batch in enumerate(batches):                # (not with static_graph, which fails under it)
            last = i == len(batches) - 1 or no_sync is None or self.static_graph
            with contextlib.nullcontext() if last else no_sync():
                loss = loss_of(*batch)
                value = loss.detach().float()
                bad_now = torch.logical_not(torch.isfinite(value)) | (value > self.cfg.skip_loss_above)
                loss_sum = value if loss_sum is None else loss_sum + value
                bad = bad_now if bad is None else bad | bad_now
                poison = torch.where(bad_now, torch.full_like(value, math.nan), torch.ones_like(value))
                self.precision.backward(loss * poison.to(loss.dtype) / len(batches))
        self.precision.unscale_(self.optimizer)
        grads = [p.grad for p in self.params if p.grad is not None]    # norm in float32: float16's overflows
        norm = (torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)))
                if grads else torch.zeros(())).to(loss_sum.device)
        # the step's one host read, flags over ranks; the stop flag joins as a fill of a device tensor:
        # no host-to-device copy that would sync
        bad_flag = bad.float().to(norm.device)
        flags = dist.all_reduce_max(torch.stack([bad_flag, (~torch.isfinite(norm)).float().reshape(()),
                                                 torch.full_like(bad_flag, float(stop_requested()))]))
        loss_sum, *read = torch.cat([loss_sum.reshape(1).to(norm.device), flags.to(norm.device)]).tolist()
        bad_loss, not_finite, stop = (flag > 0 for flag in read)
        skipped, note = bad_loss or not_finite, ""
        if not skipped and self.cfg.clip_grad_norm:   # no clipping pass when clipping is off
            torch.nn.utils.clip_grads_with_norm_(self.params, self.cfg.clip_grad_norm, norm)
        if not skipped and self.rounding_lr is not None:
            note, self.rounding_lr = rounding_note(self.params, self.rounding_lr, self.cfg), None
        self.precision.step(self.optimizer, not skipped, bad_loss=bad_loss)
        self.precision.zero_grad(self.optimizer)
        if skipped and self.buffers:   # a skipped step leaves no trace, not even in BN statistics
            with torch.no_grad():
                torch._foreach_copy_(self.buffers, self.buffers_before_step)
        self.skipped_total += skipped
        self.overflow_streak = self.overflow_streak + 1 if skipped and not bad_loss else 0
        self.bad_streak = self.bad_streak + 1 if skipped else 0
        return StepResult(loss_sum / len(batches), self.lr, skipped, stop, note=note)
