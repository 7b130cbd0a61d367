"""What a training sample carries from the loader's workers to the device, and how it unpacks there.

A compact sample is three tensors, about 2.45 MB at 512 input (COCO, 50 channels at 128 x 128)
instead of the 6.6 MB of float32:
    image   uint8   [S, S, 3]       the warped BGR picture, as augmented (786 kB)
    target  float16 [C, S/4, S/4]   the maps of `data.targets.render_targets` (1.64 MB)
    ignore  uint8   [1, S/4, S/4]   the warped ignore mask, 255 = do not supervise (16 kB)
`expand` turns a compact sample or a collated batch of them, on whatever device it lies, into the
network's float32 input, target and mask: the image through `data.preprocess.bgr_to_input` (the
one convention, shared with inference), the mask as 1 - ignore / 255. `KeypointDataset[i]` is
`expand` of `compact_sample` on the CPU, so what the network trains on does not depend on where
the unpacking runs.

The targets lie in [0, 1]; float16 keeps them to a relative 2^-11 (4.9e-4) and every value of
the 0.01 cut-off upwards stays a normal number. `sample_arrays` still gives the float32 drawing.
"""
from __future__ import annotations

import numpy as np
import torch

from data.preprocess import bgr_to_input

TARGET_DTYPE = torch.float16
_IGNORE_SCALE = 1.0 / 255


def compact_sample(image_bgr: np.ndarray, target: np.ndarray, ignore: np.ndarray):
    """(uint8 image [S,S,3], float16 target [C,h,w], uint8 ignore [1,h,w]) tensors of one sample:
    uint8 BGR picture, float32 target maps, uint8 ignore plane (0-255)."""
    return (torch.from_numpy(image_bgr), torch.from_numpy(target).to(TARGET_DTYPE),
            torch.from_numpy(ignore[None]))


def is_compact(batch) -> bool:
    """Whether `batch` (a sample or a collated batch) still holds the compact uint8 image."""
    return batch[0].dtype == torch.uint8


def supervised(ignore: torch.Tensor) -> torch.Tensor:
    """float32 mask, 1 = supervise, of a uint8 ignore mask (255 = ignore), on its device."""
    return ignore.to(torch.float32).mul_(_IGNORE_SCALE).neg_().add_(1.0)


def expand(image: torch.Tensor, target: torch.Tensor, ignore: torch.Tensor):
    """Compact tensors (one sample or a batch, any device) -> float32 (input [..., 3, S, S] RGB,
    target, mask with 1 = supervise) on the same device."""
    return bgr_to_input(image), target.to(torch.float32), supervised(ignore)


def batch_bytes(batch) -> int:
    """Bytes of the tensors of `batch` (what crosses from a worker to the device)."""
    return sum(t.numel() * t.element_size() for t in batch)
