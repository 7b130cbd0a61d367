"""What a training sample carries from the loader's workers to the device (uint8 image and masks,
packed people: 0.82 MB at 512 input, 6.6 MB as float32), and how `expand` unpacks it there."""
from __future__ import annotations

import numpy as np
import torch

from data.preprocess import bgr_to_input


def pack_people(people: np.ndarray, slots: int) -> np.ndarray:
    """float32 [slots, K, 3]: the people with a labelled keypoint, then zeros; ValueError beyond `slots`."""
    labelled = people[(people[:, :, 2] > 0).any(axis=1)]
    if len(labelled) > slots:
        raise ValueError(f"{len(labelled)} labelled people in a sample, more than the {slots} "
                         "person slots of a compact sample")
    packed = np.zeros((slots,) + people.shape[1:], np.float32)
    packed[:len(labelled)] = labelled
    return packed


def is_compact(batch) -> bool:
    """Whether `batch` (a sample or a collated batch) still holds the compact uint8 image."""
    return batch[0].dtype == torch.uint8


def trim_people(people: torch.Tensor) -> torch.Tensor:
    """A host batch's packed people [B, P, K, 3] without the slots no sample uses."""
    if people.device.type != "cpu":
        return people
    used = int((people[..., 2] > 0).any(dim=-1).sum(dim=-1).max()) if people.numel() else 0
    return people[:, :used]


def supervised(ignore: torch.Tensor) -> torch.Tensor:
    """float32 mask, 1 = supervise, of a uint8 ignore mask (255 = ignore), on its device."""
    return ignore.to(torch.float32).mul_(1 / 255).neg_().add_(1.0)


def expand(image: torch.Tensor, people: torch.Tensor, masks: torch.Tensor, painter):
    """Compact tensors (one sample or a batch, any device) -> float32 (input [..., 3, S, S] RGB,
    target [..., C, h, w] drawn by `painter`, mask [..., 1, h, w] with 1 = supervise) on their device."""
    if masks.dim() == 3:                                      # one sample
        return tuple(t[0] for t in expand(image[None], people[None], masks[None], painter))
    return bgr_to_input(image), painter(people, masks[:, 1:2]), supervised(masks[:, 0:1])


def batch_bytes(batch) -> int:
    """Bytes of the tensors of `batch` (what crosses from a worker to the device)."""
    return sum(t.numel() * t.element_size() for t in batch)
