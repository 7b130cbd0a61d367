"""The network and its loss as one module: what every launch mode wraps.

Wrapping model and loss together is what lets DataParallel compute the loss on every replica
(only per-sample loss vectors come back to the first GPU), and it puts the precision policy in one
place: inputs cast for O2/O3, the forward under autocast for O1, the loss always in float32.
"""
from __future__ import annotations

import torch
from torch import nn


class ModelWithLoss(nn.Module):
    def __init__(self, model: nn.Module, loss: nn.Module, precision):
        super().__init__()
        self.model = model
        self.loss = loss
        self.precision = precision

    def forward(self, images: torch.Tensor, target: torch.Tensor, mask: torch.Tensor):
        """-> (per-sample loss [B], dict of per-sample loss parts), all float32."""
        images = self.precision.cast_input(images)
        with self.precision.autocast_context():
            outputs = self.model(images)
        return self.loss(outputs, target, mask)
