"""The multi-task focal L2 loss of Simple Pose (SPEC "Loss"), per sample. For outputs P[i][j]
(stack i of S, scale j), target G (stride 4) and mask M (1 = supervise):
    G_j = area average of G down to the size of scale j   (adaptive average pooling)
    M_j = bilinear resize of M to scale j, values < 0.5 set to 0
    e   = (P - G_j)^2 * w_c * f * M_j          per element
    f   = |1 - P|^gamma where G_j >= focal_threshold, |P|^gamma elsewhere (gamma 0: plain L2)
    w_c = keypoint_weight on the keypoint maps, mask_weight on the person mask, 1 elsewhere
    L_ij[b] = sum of e over channels and pixels of sample b
    loss[b] = (1 / S) * sum_i sum_j (s_j / sum_k s_k) * L_ij[b]     s = scale_weights
Training takes the mean of loss[b] (the same however a batch is split; the reference's per-sample
size, so its LR keeps its meaning), in float32. `parts` ([B], detached): the shares of loss[b] of
`keypoints`, `limbs`, `person_mask`, `keypoint_max` and `scale{j}` (each family sums to loss[b]),
and `stack{i}`, stack i's own loss. `focal_detach` makes f a constant, so gradients point to G."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from config.schema import LossConfig
from data.skeleton import Skeleton


def resized(target: torch.Tensor, mask: torch.Tensor, size: tuple[int, int]) -> tuple:
    """`target` area-averaged and `mask` resized bilinearly (values < 0.5 set to 0) to `size`."""
    if tuple(target.shape[-2:]) != tuple(size):
        target = F.adaptive_avg_pool2d(target, size)
    if tuple(mask.shape[-2:]) != tuple(size):
        mask = F.interpolate(mask, size=size, mode="bilinear", align_corners=False)
    return target, mask * (mask >= 0.5)


class FocalL2Loss(nn.Module):
    def __init__(self, cfg: LossConfig, skeleton: Skeleton):
        super().__init__()
        self.groups = {               # the channels of each part of the loss, in `skeleton`'s layout
            "limbs": skeleton.limb_channels,
            "keypoints": skeleton.keypoint_channels,
            "person_mask": slice(skeleton.person_mask_channel, skeleton.person_mask_channel + 1),
            "keypoint_max": slice(skeleton.keypoint_max_channel, skeleton.keypoint_max_channel + 1),
        }
        self.gamma = float(cfg.gamma)
        self.threshold = float(cfg.focal_threshold)
        self.detach_focal = bool(cfg.focal_detach)
        scale_weights = torch.tensor([float(w) for w in cfg.scale_weights], dtype=torch.float32)
        self.register_buffer("scale_weights", scale_weights / scale_weights.sum(), persistent=False)
        weights = torch.ones(skeleton.num_channels)
        weights[skeleton.keypoint_channels] = cfg.keypoint_weight
        weights[skeleton.person_mask_channel] = cfg.mask_weight
        self.register_buffer("channel_weights", weights, persistent=False)

    def element_loss(self, prediction: torch.Tensor, target: torch.Tensor,
                     mask: torch.Tensor) -> torch.Tensor:
        """Weighted, masked focal L2 per element [B, C, h, w] (float32 inputs)."""
        loss = (prediction - target) ** 2
        if self.gamma != 0:
            base = prediction.detach() if self.detach_focal else prediction
            focal = torch.where(target >= self.threshold, (1 - base).abs(), base.abs()) ** self.gamma
            loss = loss * focal
        return loss * self.channel_weights.view(1, -1, 1, 1) * mask

    def forward(self, outputs: list[list[torch.Tensor]], target: torch.Tensor,
                mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if len(outputs[0]) != len(self.scale_weights):
            raise ValueError(f"{len(outputs[0])} output scales but {len(self.scale_weights)} "
                             "loss.scale_weights")
        target, mask = target.float(), mask.float()
        scale_targets = [resized(target, mask, tuple(prediction.shape[-2:])) for prediction in outputs[0]]
        per_channel = [torch.stack([self.element_loss(prediction.float(), *scale_target).sum(dim=(2, 3))
                                    for prediction, scale_target in zip(predictions, scale_targets)])
                       for predictions in outputs]
        weighted = torch.stack(per_channel) * self.scale_weights[:, None, None]      # [stacks, scales, B, C]
        stacks = weighted.sum(dim=(1, 3))                                             # [stacks, B]
        parts = {name: weighted[..., part].sum(dim=(1, 3)).mean(0) for name, part in self.groups.items()}
        parts.update({f"stack{i}": loss for i, loss in enumerate(stacks)})
        parts.update({f"scale{j}": loss for j, loss in enumerate(weighted.sum(dim=3).mean(0))})
        return stacks.mean(0), {name: value.detach() for name, value in parts.items()}
