"""IMHN: the stacked improved hourglass network of Simple Pose (SPEC "Network"). Names are stable
(users freeze and load weights by them): `stem` (to stride 4), then per stack `stacks.{i}.hourglass`
(level k at stride 4*2^k with `channels + k*increase` channels, D+1 feature maps, stride 4 first),
`stacks.{i}.heads.{s}` and `stacks.{i}.merge.{s}` (all stacks but the last; merge_0 is added to this
stack's input to make the next one's, every merge_s to the next hourglass's output at scale s, before
its head: the reference's function, `tests/test_reference_golden.py`). Input: RGB / 255; output: a
list over stacks of lists over scales (stride 4, 8, ...) of [B, C, H/stride, W/stride], near 0 at first."""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from common.errors import ConfigError
from config.schema import ModelConfig
from data.skeleton import Skeleton
from models.blocks import Bottleneck, ConvBN, SqueezeExcitation, Stem


def count_parameters(model: torch.nn.Module, trainable: bool | None = None) -> int:
    """The model's parameters (elements); `trainable` True or False: only those that do or do not
    take gradients."""
    return sum(p.numel() for p in model.parameters() if trainable in (None, p.requires_grad))


@contextlib.contextmanager
def eval_mode(model):
    """Model in eval mode under no_grad; its previous train/eval mode is restored after."""
    module = model if isinstance(model, torch.nn.Module) else torch.nn.Module()  # ONNX: no mode
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            yield model
    finally:
        module.train(was_training)


class HourglassLevel(nn.Module):
    """One level of the hourglass: `channels` at its own scale, `inner` one scale down."""

    def __init__(self, channels: int, inner: int):
        super().__init__()
        self.skip = Bottleneck(channels, channels)
        self.down = Bottleneck(channels, inner)
        self.up_reduce = Bottleneck(inner, channels)
        self.up_conv = ConvBN(channels, channels, 3)


class Hourglass(nn.Module):
    """Hourglass over `len(widths)` scales; returns the features of every scale, finest first."""

    def __init__(self, widths: list[int]):
        super().__init__()
        self.levels = nn.ModuleList(HourglassLevel(widths[k], widths[k + 1]) for k in range(len(widths) - 1))
        self.bottom = Bottleneck(widths[-1], widths[-1])

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        skips = []
        for level in self.levels:
            skips.append((level, level.skip(x)))
            x = level.down(F.max_pool2d(x, 2))
        h = self.bottom(x)
        features = [h]
        for level, skip in reversed(skips):
            up = F.interpolate(level.up_reduce(h), scale_factor=2.0, mode="nearest")
            h = skip + level.up_conv(up)
            features.append(h)
        return features[::-1]


class ScaleHead(nn.Module):
    """Two 3x3 convs, SE, linear 1x1 prediction. Returns (prediction, features)."""

    def __init__(self, cin: int, width: int, out_channels: int, se: bool, se_reduction: int):
        super().__init__()
        self.conv1 = ConvBN(cin, width, 3)
        self.conv2 = ConvBN(width, width, 3)
        self.se = SqueezeExcitation(width, se_reduction) if se else nn.Identity()
        self.predict = nn.Conv2d(width, out_channels, 1, bias=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.se(self.conv2(self.conv1(x)))
        return self.predict(features), features


class Merge(nn.Module):
    """Prediction and head features mapped back to the scale's channels (1x1 conv + BN each)."""

    def __init__(self, out_channels: int, head_width: int, channels: int):
        super().__init__()
        self.from_prediction = ConvBN(out_channels, channels, 1, activation=False)
        self.from_features = ConvBN(head_width, channels, 1, activation=False)

    def forward(self, prediction: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        return self.from_prediction(prediction) + self.from_features(features)


class Stack(nn.Module):
    def __init__(self, widths: list[int], cfg: ModelConfig, out_channels: int, last: bool):
        super().__init__()
        self.hourglass = Hourglass(widths)
        self.heads = nn.ModuleList(ScaleHead(w, cfg.head_channels, out_channels, cfg.se,
                                             cfg.se_reduction) for w in widths)
        self.merge = None if last else nn.ModuleList(
            Merge(out_channels, cfg.head_channels, w) for w in widths)


class IMHN(nn.Module):
    def __init__(self, cfg: ModelConfig, out_channels: int):
        super().__init__()
        if cfg.channels <= 2 * cfg.stem_channels:    # the one rule the schema's bounds cannot say
            raise ConfigError(f"option model.channels: {cfg.channels} must exceed 2 x model.stem_channels "
                              f"({2 * cfg.stem_channels}): the stem concatenates its dilated convs to "
                              "2 x stem_channels")
        widths = [cfg.channels + k * cfg.increase for k in range(cfg.depth + 1)]    # stride 4 first
        self.config = cfg                  # the settings it was built with (error messages name them)
        self.out_channels = out_channels
        self.stem = Stem(cfg.stem_channels, cfg.channels)
        self.stacks = nn.ModuleList(Stack(widths, cfg, out_channels, last=i == cfg.stacks - 1)
                                    for i in range(cfg.stacks))
        if not next(self.parameters()).is_meta:      # on the meta device it is only counted
            self.reset_parameters(cfg.init_std)

    def reset_parameters(self, std: float) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                nn.init.normal_(module.weight, 0.0, std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor) -> list[list[torch.Tensor]]:
        x = self.stem(x)
        outputs, merges = [], None
        for stack in self.stacks:
            if merges is not None:
                x = x + merges[0]
            features = stack.hourglass(x)
            if merges is not None:      # every scale's merge reaches that scale's head only
                features = [f + m for f, m in zip(features, merges)]
            predictions, head_features = zip(*(head(f) for head, f in zip(stack.heads, features)))
            outputs.append(list(predictions))
            if stack.merge is not None:
                merges = [m(p, f) for m, p, f in zip(stack.merge, predictions, head_features)]
        return outputs


def build_model(cfg: ModelConfig, skeleton: Skeleton) -> IMHN:
    """The network of `cfg` with `skeleton`'s output channels (kept as `model.skeleton`, not in the
    state dict); `ConfigError` above `cfg.max_params_m` million parameters."""
    with torch.device("meta"):           # counted without memory or initialisation
        count = count_parameters(IMHN(cfg, skeleton.num_channels))
    if count > cfg.max_params_m * 1e6:
        raise ConfigError(f"option model.max_params_m: the network of these model.* settings has "
                          f"{count / 1e6:,.1f} million parameters, more than the limit of "
                          f"{cfg.max_params_m:g}; raise it with --set model.max_params_m=N if you mean it")
    model = IMHN(cfg, skeleton.num_channels)
    model.skeleton = skeleton
    return model
