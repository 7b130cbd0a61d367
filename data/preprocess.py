"""Pictures to network input: the one convention that training and inference share.

A BGR uint8 picture becomes an RGB float32 tensor [3, H, W] by `normalise` (value / 255, no offset:
`_FULL_SCALE` is the one place the scale is set), through `bgr_to_input` on any device. Whatever
lies outside the picture (the training warp's border, inference's padding to the sizes the network
takes, `padded_size`) is `GREY` before normalisation, in training and at inference alike.
"""
from __future__ import annotations

import numpy as np
import torch

GREY = (128, 128, 128)       # BGR uint8 outside the picture: training's warp border, inference's padding
_FULL_SCALE = 255            # the uint8 value that becomes 1.0


def normalise(rgb: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 RGB values (any shape, any device) -> the network's input: value / 255, no offset (the
    authors' convention, so their weights compute their maps here), in `dtype`."""
    return rgb.to(dtype).div_(_FULL_SCALE)


def bgr_to_input(pictures_bgr: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [..., H, W, 3] BGR (one picture or a batch, any device) -> contiguous [..., 3, H, W]
    RGB network input in `dtype` (the reordering is done on the uint8 values, then `normalise`).

    float32 on the CPU is one numpy division per channel into a numpy array (numpy's huge pages
    spare most page faults of a fresh batch): the values of `normalise`, in a third of the time."""
    if pictures_bgr.device.type == "cpu" and dtype == torch.float32:
        bgr = pictures_bgr.numpy()
        rgb = np.empty(bgr.shape[:-3] + (3,) + bgr.shape[-3:-1], np.float32)
        for channel in range(3):
            np.divide(bgr[..., 2 - channel], np.float32(_FULL_SCALE), out=rgb[..., channel, :, :],
                      dtype=np.float32)
        return torch.from_numpy(rgb)
    return normalise(pictures_bgr.movedim(-1, -3).flip(-3).contiguous(), dtype)


def picture_to_input(picture_bgr: np.ndarray, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [H, W, 3] BGR -> [3, H, W] RGB network input (on the CPU), float32 unless `dtype`."""
    return bgr_to_input(torch.from_numpy(picture_bgr), dtype)


def padded_size(height: int, width: int, multiple: int) -> tuple[int, int]:
    """(height, width) rounded up to multiples of `multiple` (`config.loader.input_multiple`)."""
    return -(-height // multiple) * multiple, -(-width // multiple) * multiple


def pictures_to_batch(pictures_bgr: list[np.ndarray], size: tuple[int, int], device) -> torch.Tensor:
    """uint8 BGR pictures, each at most `size` (height, width) -> float32 [B, 3, *size] network input
    on `device`: each picture at the top left, `GREY` to the right of and below it.

    The uint8 canvas goes to the device and is normalised there (a quarter of the bytes to move).
    """
    canvas = np.empty((len(pictures_bgr), *size, 3), np.uint8)
    canvas[:] = GREY
    for slot, picture in zip(canvas, pictures_bgr):
        slot[: picture.shape[0], : picture.shape[1]] = picture
    return bgr_to_input(torch.from_numpy(canvas).to(device, non_blocking=True))
