"""Network maps of pictures at their own size: per scale resized, padded, batched by padded size (with
the mirrors when flipping), sampled back to picture pixels and averaged. A network maps [B, 3, H, W]
to [B, C, H/4, W/4]: `TorchNetwork` or `inference.onnx_network`."""
from __future__ import annotations

import cv2
import numpy as np
import torch
import torch.nn.functional as F

from config.views import PredictSettings
from config.loader import input_multiple
from data.preprocess import padded_size, pictures_to_batch

MAX_ASPECT = 4      # a picture runs at most this many times as wide as its scale's height


class TorchNetwork:
    """A model of this project (in eval mode) as a network: the last stack's stride-4 maps."""

    def __init__(self, model: torch.nn.Module, device=None):
        self.model = model
        self.skeleton = model.skeleton          # `models.build_model` gives every model its skeleton
        self.size_multiple = input_multiple(getattr(getattr(model, "config", None), "depth", 4))
        params = [p for p in model.parameters() if p.is_floating_point()]
        self.device = torch.device(device) if device is not None else params[0].device
        self.dtype = params[0].dtype if params else torch.float32

    @torch.no_grad()
    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        return self.model(batch.to(self.dtype))[-1][0].float()


def resample_to_image(maps: torch.Tensor, stride: int, resized_hw, image_hw) -> torch.Tensor:
    """Stride-`stride` maps [B, C, h, w] of an input resized to `resized_hw` -> [B, C, *image_hw],
    bilinear with image pixel y at map cell (y + 0.5) * rh / (stride * H) - 0.5."""
    (rh, rw), (height, width) = resized_hw, image_hw
    # One extra replicated cell so that rounding never leaves the output a pixel short.
    padded = F.pad(maps.float(), (0, 1, 0, 1), mode="replicate")
    scale = (stride * height / rh, stride * width / rw)
    out = F.interpolate(padded, scale_factor=scale, mode="bilinear", align_corners=False,
                        recompute_scale_factor=False)
    return out[:, :, :height, :width]


def resize_for_scale(picture_bgr: np.ndarray, scale: float, input_size: int) -> np.ndarray:
    """The picture resized to height scale * input_size (width at most MAX_ASPECT times that)."""
    height, width = picture_bgr.shape[:2]
    rh = max(1, int(round(float(scale) * input_size)))
    if width > MAX_ASPECT * height:
        rh, rw = max(1, int(round(height * MAX_ASPECT * rh / width))), MAX_ASPECT * rh
    else:
        rw = max(1, int(round(width * rh / height)))
    return cv2.resize(picture_bgr, (rw, rh), interpolation=cv2.INTER_AREA if rh < height
                      else cv2.INTER_LINEAR)


def as_network(model, device=None):
    """A model of this project as a `TorchNetwork` (`device`: where it is); a network as it is."""
    return TorchNetwork(model, device) if isinstance(model, torch.nn.Module) else model


@torch.no_grad()
def network_maps(network, pictures_bgr: list[np.ndarray], settings: PredictSettings) -> list[list[tuple]]:
    """Per picture, per scale: its network maps, stride and resized size (`picture_maps` input)."""
    inference = settings.inference
    flip_index = torch.tensor(network.skeleton.channel_flip, device=network.device)
    multiple = getattr(network, "size_multiple", input_multiple())
    parts: list = [[] for _ in pictures_bgr]
    for scale in inference.scales:
        resized = [resize_for_scale(p, scale, settings.input_size) for p in pictures_bgr]
        by_size: dict[tuple[int, int], list[int]] = {}
        for k, picture in enumerate(resized):
            by_size.setdefault(padded_size(*picture.shape[:2], multiple), []).append(k)
        for size, members in by_size.items():
            # batch_size pictures of input_size x input_size a pass, fewer of a larger padded size
            step = max(1, inference.batch_size * settings.input_size ** 2 // (size[0] * size[1]))
            for lo in range(0, len(members), step):
                chunk = members[lo: lo + step]
                batch = pictures_to_batch([resized[k] for k in chunk], size, network.device)
                if inference.flip:
                    batch = torch.cat([batch, batch.flip(-1)])
                out = network(batch)
                stride = size[0] // out.shape[-2]
                if inference.flip:
                    # Mirror back the whole padded map, so the crop region is the same for both.
                    out = out[: len(chunk)] + out[len(chunk):].flip(-1)[:, flip_index]
                for row, k in enumerate(chunk):
                    parts[k].append((out[row: row + 1], stride, resized[k].shape[:2]))
    return parts


@torch.no_grad()
def picture_maps(parts: list[tuple], image_hw, flip: bool) -> np.ndarray:
    """float32 [C, *image_hw]: the mean of a picture's `network_maps` parts (`flip`: each holds two)."""
    total = None
    for out, stride, resized_hw in parts:
        maps = resample_to_image(out, stride, resized_hw, image_hw)[0]
        total = maps if total is None else total + maps
    return (total / (len(parts) * (2 if flip else 1))).cpu().numpy()
