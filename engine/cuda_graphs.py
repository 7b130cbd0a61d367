"""CUDA graphs for the training step (`GraphedNetwork`) and where a run uses them (`use_cuda_graphs`);
each gradient accumulates in its own storage, so `--accumulate K` sums as the eager run does."""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from common.errors import ConfigError
from config.schema import AmpConfig


def use_cuda_graphs(amp: AmpConfig, launch) -> bool:
    """`amp.cuda_graphs` for this run: auto where they can be used, True refuses where not."""
    unsupported = [why for why, bad in (
        ("the device is not CUDA", launch.ctx.device.type != "cuda"),
        (f"the launch mode is {launch.mode}", launch.mode != "single"),
        ("--amp-backend apex", amp.backend != "native"), ("--compile", amp.compile)) if bad]
    if amp.cuda_graphs is True and unsupported:
        raise ConfigError(f"option amp.cuda_graphs (--cuda-graphs): CUDA graphs need one CUDA process "
                          f"with the native backend and no --compile, and here {', '.join(unsupported)}; "
                          "leave it at auto")
    return amp.cuda_graphs is not False and not unsupported


class GraphedNetwork:
    """The training forward and backward as CUDA graphs: `warm_calls` eager calls, then one capture for
    that input's shape, layout and type, replayed by later calls with it (others run eagerly); the capture's
    BatchNorm updates are put back; a step's first gradient is copied from the graph's (reused) buffer."""

    def __init__(self, model: nn.Module, precision, warm_calls: int = 3, make_graphed=None):
        self.model, self.precision, self.warm_calls = model, precision, warm_calls
        self.make_graphed = make_graphed or torch.cuda.make_graphed_callables
        self.calls, self.key, self.replay = 0, None, None

    def __call__(self, images: torch.Tensor):
        key = (tuple(images.shape), images.stride(), images.dtype, images.device)
        if self.replay is None:
            self.calls += 1
            if self.calls <= self.warm_calls:
                return self.model(images)
            self.key, self.replay = key, self._capture(images)
        return self.replay(images) if key == self.key else self.model(images)

    def _capture(self, images: torch.Tensor):
        saved = [b.detach().clone() for b in self.model.buffers()]
        # the capture refuses autocast's weight cache: O1 captures with it off (same casts)
        autocast = (torch.autocast(images.device.type, dtype=self.precision.dtype, cache_enabled=False)
                    if torch.is_autocast_enabled(images.device.type) else contextlib.nullcontext())
        with autocast:
            self.make_graphed(self.model, (images,))
        replay = self.model.forward          # the graphed forward, set on the module by the capture
        del self.model.forward               # every other call runs the module's own forward
        for param in self.model.parameters():
            if param.requires_grad:          # a gradient not yet kept is the graph's buffer: copied
                param.register_hook(lambda grad, param=param: grad.clone() if param.grad is None else None)
        with torch.no_grad():
            for buffer, value in zip(self.model.buffers(), saved):
                buffer.copy_(value)
        # torch warns once that the capture's side stream made the weights' accumulation nodes
        if quiet := getattr(torch.autograd.graph, "set_warn_on_accumulate_grad_stream_mismatch", None):
            quiet(False)
        return replay
