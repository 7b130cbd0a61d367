"""A run's validation, owned as mmengine's ValLoop owns it: `Validator` (the set, its persistent
loader, the network, the evaluator, the pictures), asked by `engine.hooks.EpochEnd` when due."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from config.schema import Config
from config.views import EvalOptions, PredictSettings
from runtime import distributed as dist
from engine.loaders import to_model_input, val_loader
from engine.precision import cudnn_autotuning_off


class Validator:
    """`net`: the model and its loss as validation runs them (eager, wrapped only under DataParallel);
    `model`: the network the `evaluator` (the AP pass) and `draw` (the pictures) run."""

    def __init__(self, cfg: Config, ctx, data, net: nn.Module, model: nn.Module,
                 evaluator: Callable | None = None, draw: Callable | None = None,
                 run_dir: Path | None = None):
        self.cfg, self.ctx, self.net, self.model, self.run_dir = cfg, ctx, net, model, run_dir
        self.val_set, self.val_h5, self.skeleton = data.val_set, data.val_h5, data.skeleton
        self.evaluator, self.draw, self.loader = evaluator, draw, None

    @torch.no_grad()
    def loss(self, stop: Callable[[], bool]) -> float | None:
        """The mean validation loss over every rank's samples; None once `stop()` on some rank."""
        ctx, val_set = self.ctx, self.val_set
        self.net.eval()
        loss_sum, count = 0.0, 0      # summed in Python floats: Apex's O1 patches torch's float64 sums
        if self.loader is None:       # made once: its workers serve every validation
            self.loader = val_loader(val_set, self.cfg.data, self.cfg.train.batch_size, ctx)
        # a stop vote per batch while every rank still has one (shards differ by one at most)
        voted_batches = -(-(len(val_set) // ctx.world_size) // self.loader.batch_size)
        for n, batch in enumerate(self.loader):
            images, target, mask = to_model_input(batch, ctx.device, val_set.painter_for(ctx.device),
                                                  non_blocking=False)
            per_sample, _ = self.net(images, target, mask)
            loss_sum += math.fsum(per_sample.detach().float().cpu().tolist())
            count += per_sample.numel()
            if n < voted_batches and dist.any_rank(stop()):
                return None
        loss_sum, count = dist.all_reduce_sum(torch.tensor([loss_sum, count], dtype=torch.float64)).tolist()
        return loss_sum / max(count, 1.0)

    @torch.no_grad()
    def metrics(self, stop: Callable[[], bool]) -> dict | None:
        """The skeleton's metrics by the evaluator ({} without one); None once `stop()`."""
        if self.evaluator is None:
            return {}
        ctx = self.ctx
        with cudnn_autotuning_off():    # pictures of several sizes: none worth timing algorithms for
            options = EvalOptions(max_images=self.cfg.train.ap_max_images, progress=ctx.is_main,
                                  skeleton=self.skeleton)
            stats = self.evaluator(self.model, self.val_h5, PredictSettings.of(self.cfg), ctx.device, options,
                                   stop=stop)
        return None if stats is None else {k: v for k, v in stats.items()
                                           if k != "num_images" and isinstance(v, float)}

    @torch.no_grad()
    def pictures(self, epoch: int) -> Path | None:
        """The validation pictures of `epoch` (0-based) drawn on the main process, or None."""
        count = self.cfg.train.val_pictures
        if self.draw is None or not count or not self.ctx.is_main:
            return None
        with cudnn_autotuning_off():
            return self.draw(self.model, self.val_h5, self.skeleton, PredictSettings.of(self.cfg), epoch + 1,
                             self.run_dir, self.ctx.device, count)
