"""Pictures to network input, the one convention training and inference share: BGR uint8 becomes
RGB value / 255 (`normalise`); whatever lies outside the picture (warp border, padding) is `GREY`."""
from __future__ import annotations

import numpy as np
import torch

GREY = (128, 128, 128)       # BGR uint8 outside the picture: training's warp border, inference's padding
_FULL_SCALE = 255            # the uint8 value that becomes 1.0


def normalise(rgb: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 RGB values -> the network's input, value / 255 (the authors' convention), in `dtype`."""
    return rgb.to(dtype).div_(_FULL_SCALE)


def bgr_to_input(pictures_bgr: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [..., H, W, 3] BGR (any device) -> contiguous [..., 3, H, W] RGB input in `dtype`
    (float32 on the CPU: numpy, the same values in a third of the time)."""
    if pictures_bgr.device.type == "cpu" and dtype == torch.float32:
        bgr = pictures_bgr.numpy()
        rgb = np.empty(bgr.shape[:-3] + (3,) + bgr.shape[-3:-1], np.float32)
        for channel in range(3):
            np.divide(bgr[..., 2 - channel], np.float32(_FULL_SCALE), out=rgb[..., channel, :, :],
                      dtype=np.float32)
        return torch.from_numpy(rgb)
    return normalise(pictures_bgr.movedim(-1, -3).flip(-3).contiguous(), dtype)


def padded_size(height: int, width: int, multiple: int) -> tuple[int, int]:
    """(height, width) rounded up to multiples of `multiple` (`config.loader.input_multiple`)."""
    return -(-height // multiple) * multiple, -(-width // multiple) * multiple


def pictures_to_batch(pictures_bgr: list[np.ndarray], size: tuple[int, int], device) -> torch.Tensor:
    """uint8 BGR pictures, each at most `size` -> [B, 3, *size] input on `device`, top left on `GREY`."""
    canvas = np.empty((len(pictures_bgr), *size, 3), np.uint8)
    canvas[:] = GREY
    for slot, picture in zip(canvas, pictures_bgr):
        slot[: picture.shape[0], : picture.shape[1]] = picture
    return bgr_to_input(torch.from_numpy(canvas).to(device, non_blocking=True))
