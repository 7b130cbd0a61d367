"""The maps of `data.targets.render_targets`, drawn in torch on whatever device holds the people:
whole-grid maps one person slot at a time (no host sync), equal to float32 rounding."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from data.targets import GAUSSIAN_CUTOFF, MIN_VALUE, HostTargetPainter


class TargetPainter(HostTargetPainter):
    """`HostTargetPainter`'s maps (same settings) drawn in torch as the module docstring says."""

    def __call__(self, people: torch.Tensor, person_mask: torch.Tensor) -> torch.Tensor:
        """float32 [B, C, h, w] targets of people [B, P, K, 3] and uint8 person_mask [B, 1, h, w]."""
        sk = self.skeleton
        batch, (height, width) = people.shape[0], person_mask.shape[-2:]
        people = people.to(torch.float32)
        out = torch.zeros(batch, sk.num_channels, height, width, device=people.device)
        cells_x, cells_y = ((torch.arange(count, device=people.device, dtype=torch.float32) + 0.5)
                            * self.stride - 0.5 for count in (width, height))     # cell centres
        keypoints = out[:, sk.keypoint_channels]
        limbs = out[:, sk.limb_channels]
        counts = torch.zeros_like(limbs)
        scale = -0.5 / self.cfg.keypoint_sigma ** 2
        for slot in range(people.shape[1]):
            person = people[:, slot]
            labelled = (person[:, :, 2] > 0).to(torch.float32)
            gx = torch.exp(scale * (cells_x - person[:, :, 0, None]) ** 2) * labelled[:, :, None]
            gy = torch.exp(scale * (cells_y - person[:, :, 1, None]) ** 2)
            maps = gy[:, :, :, None] * gx[:, :, None, :]          # [B, K, h, w]: 0 where not labelled
            torch.maximum(keypoints, maps.masked_fill_(maps < MIN_VALUE, 0.0), out=keypoints)
            values, reached = self._limb_maps(person, cells_x, cells_y)
            limbs += values
            counts += reached
        limbs.copy_(torch.where(counts > 1, limbs / counts.clamp(min=1), limbs))
        mask = person_mask.to(torch.float32).mul_(1 / 255).clamp_(0.0, 1.0)
        out[:, sk.person_mask_channel] = -F.max_pool2d(-mask, 3, stride=1, padding=1)[:, 0]
        out[:, sk.keypoint_max_channel] = keypoints.amax(dim=1)
        return out

    def _limb_maps(self, person, cells_x, cells_y):
        """([B, L, h, w] limb Gaussians of one person slot, bool [B, L, h, w] where one is drawn)."""
        a, b = (person[:, list(ends)] for ends in zip(*self.skeleton.limbs))   # [B, L, 3]
        labelled = (a[..., 2] > 0) & (b[..., 2] > 0)
        delta = (b[..., :2] - a[..., :2]).to(torch.float64)
        length = torch.hypot(delta[..., 0], delta[..., 1])
        point = length < 1e-6
        unit = delta / length.clamp(min=1e-6)[..., None]
        root = math.sqrt(0.5) / self.cfg.limb_sigma         # a point: unit (1, 0)
        ux = (torch.where(point, 1.0, unit[..., 0]) * root).to(torch.float32)[..., None, None]
        uy = (torch.where(point, 0.0, unit[..., 1]) * root).to(torch.float32)[..., None, None]
        dx = (cells_x - a[..., 0, None])[:, :, None, :]                       # [B, L, 1, w]
        dy = (cells_y - a[..., 1, None])[:, :, :, None]                       # [B, L, h, 1]
        across = dx * uy - dy * ux
        along = dx * ux * point[..., None, None]     # a point: unit (1, 0), so along = dx * ux
        dist2 = across.square_().add_(along.square_())
        inside_x = self._in_box(a[..., 0], b[..., 0], cells_x.numel()) & labelled[..., None]
        inside_y = self._in_box(a[..., 1], b[..., 1], cells_y.numel())
        reached = (inside_y[..., :, None] & inside_x[..., None, :]).logical_and_(dist2 <= GAUSSIAN_CUTOFF)
        return torch.exp(dist2.neg_()).mul_(reached), reached

    def _in_box(self, a, b, count: int) -> torch.Tensor:
        """[B, L, count] cells within the limbs' boxes widened by `margin` (as `data.targets`' windows)."""
        a, b = a.to(torch.float64), b.to(torch.float64)
        margin, stride = self.cfg.limb_margin, self.stride
        first = torch.ceil((torch.minimum(a, b) - margin + 0.5) / stride - 0.5)
        last = torch.floor((torch.maximum(a, b) + margin + 0.5) / stride - 0.5)
        cells = torch.arange(count, device=a.device, dtype=torch.float64)
        return (cells >= first[..., None]) & (cells <= last[..., None])
