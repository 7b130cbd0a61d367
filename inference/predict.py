"""Network maps of one image at image size: multi-scale, optional flip, averaged.

Per scale s the image is resized to height s * input_size, padded (bottom, right) to a multiple of
64 and run together with its mirror image in one batch; the last stack's stride-4 output is
sampled back to image pixels (cell (i, j) of the stride-4 map sits at input point
((j + 0.5) * 4 - 0.5, (i + 0.5) * 4 - 0.5)), the mirror's output is un-mirrored and its channels
permuted by CHANNEL_FLIP, and everything is averaged.
"""
from __future__ import annotations

import cv2
import numpy as np
import torch
import torch.nn.functional as F

from config.schema import Config
from config.skeleton import CHANNEL_FLIP

PAD_MULTIPLE = 64


def image_to_tensor(image_bgr: np.ndarray, device) -> torch.Tensor:
    """BGR uint8 [H, W, 3] -> RGB float [1, 3, H, W] in [0, 1] on `device`."""
    rgb = np.ascontiguousarray(image_bgr[:, :, ::-1])
    return torch.from_numpy(rgb).to(device).permute(2, 0, 1)[None].float().div_(255.0)


def resample_to_image(maps: torch.Tensor, stride: int, resized_hw, image_hw) -> torch.Tensor:
    """Stride-`stride` maps [B, C, h, w] of an input resized to `resized_hw` -> [B, C, *image_hw].

    Exact in continuous coordinates: image pixel y maps to resized pixel (y + 0.5) * rh / H - 0.5,
    then to map cell (that + 0.5) / stride - 0.5, i.e. (y + 0.5) * rh / (stride * H) - 0.5: bilinear
    interpolation with that scale factor (borders clamped), cropped to the image.
    """
    (rh, rw), (height, width) = resized_hw, image_hw
    # One extra replicated cell so that rounding never leaves the output a pixel short.
    padded = F.pad(maps.float(), (0, 1, 0, 1), mode="replicate")
    scale = (stride * height / rh, stride * width / rw)
    out = F.interpolate(padded, scale_factor=scale, mode="bilinear", align_corners=False,
                        recompute_scale_factor=False)
    return out[:, :, :height, :width]


def _model_dtype(model: torch.nn.Module) -> torch.dtype:
    for param in model.parameters():
        if param.is_floating_point():
            return param.dtype
    return torch.float32


@torch.no_grad()
def predict_maps(model: torch.nn.Module, image_bgr: np.ndarray, cfg: Config, device) -> np.ndarray:
    """float32 [50, H, W]: the model's maps of `image_bgr` at its own size (see module doc).

    The caller puts the model in eval mode (`inference.evaluation.eval_mode`).
    """
    height, width = image_bgr.shape[:2]
    dtype = _model_dtype(model)
    flip_index = torch.tensor(CHANNEL_FLIP, device=device)
    total = None
    for scale in cfg.inference.scales:
        rh = max(1, int(round(float(scale) * cfg.data.input_size)))
        rw = max(1, int(round(width * rh / height)))
        resized = cv2.resize(image_bgr, (rw, rh), interpolation=cv2.INTER_AREA if rh < height
                             else cv2.INTER_LINEAR)
        batch = image_to_tensor(resized, device)
        ph, pw = -(-rh // PAD_MULTIPLE) * PAD_MULTIPLE, -(-rw // PAD_MULTIPLE) * PAD_MULTIPLE
        batch = F.pad(batch, (0, pw - rw, 0, ph - rh))
        if cfg.inference.flip:
            batch = torch.cat([batch, batch.flip(-1)])
        out = model(batch.to(dtype))[-1][0].float()
        stride = ph // out.shape[-2]
        if cfg.inference.flip:
            # Mirror back the whole padded map, so the crop region is the same for both.
            out = out[:1] + out[1:].flip(-1)[:, flip_index]
        maps = resample_to_image(out, stride, (rh, rw), (height, width))[0]
        total = maps if total is None else total + maps
    count = len(cfg.inference.scales) * (2 if cfg.inference.flip else 1)
    return (total / count).cpu().numpy()
