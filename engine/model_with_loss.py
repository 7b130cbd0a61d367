"""The network and its loss as one module: what every launch mode wraps, so that DataParallel
computes the loss on every replica, with the precision policy in one place (inputs cast for O2/O3,
autocast for O1, the loss in float32). With `cuda_graphs` the training forward and backward are
replayed as CUDA graphs (`GraphedNetwork`).
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn


class ModelWithLoss(nn.Module):
    def __init__(self, model: nn.Module, loss: nn.Module, precision, cuda_graphs: bool = False):
        super().__init__()
        self.model = model
        self.loss = loss
        self.precision = precision
        self.graphed = GraphedNetwork(model, precision) if cuda_graphs else None   # not a submodule

    def forward(self, images: torch.Tensor, target: torch.Tensor, mask: torch.Tensor):
        """-> (per-sample loss [B], dict of per-sample loss parts), all float32."""
        images = self.precision.cast_input(images)
        with self.precision.autocast_context():
            if self.graphed is not None and self.training:
                outputs = self.graphed(images)
            else:
                outputs = self.model(images)
        return self.loss(outputs, target, mask)


class GraphedNetwork:
    """The network's training forward and backward as CUDA graphs: `warm_calls` eager calls, then
    one capture for that input's shape, layout and type, replayed by later calls with it (others
    run eagerly). The capture's BatchNorm updates are put back."""

    def __init__(self, model: nn.Module, precision, warm_calls: int = 3,
                 make_graphed=None):
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
        with torch.no_grad():
            for buffer, value in zip(self.model.buffers(), saved):
                buffer.copy_(value)
        # torch warns once that the capture's side stream made the weights' accumulation nodes
        quiet = getattr(torch.autograd.graph, "set_warn_on_accumulate_grad_stream_mismatch", None)
        if quiet is not None:
            quiet(False)
        return replay
