"""Building blocks of IMHN: conv+BN(+LeakyReLU(0.01), SPEC "Network"; no bias: a BatchNorm follows),
bottleneck residual, SE, stem; child names say where a weight lives (`stem.context.convs.2.0.weight`)."""
from __future__ import annotations

from functools import partial

import torch
from torch import nn

LEAKY_SLOPE = 0.01
STEM_DILATIONS = (3, 3, 4, 4, 5, 5)   # SPEC: six dilated 3x3 convs at the end of the stem
leaky_relu = partial(nn.LeakyReLU, LEAKY_SLOPE, inplace=True)


class ConvBN(nn.Sequential):
    """Conv (no bias) + BatchNorm, optionally followed by LeakyReLU; 'same' padding."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1, dilation: int = 1,
                 activation: bool = True):
        padding = dilation * (kernel - 1) // 2
        super().__init__(nn.Conv2d(cin, cout, kernel, stride, padding, dilation=dilation, bias=False),
                         nn.BatchNorm2d(cout), *([leaky_relu()] if activation else []))


class Bottleneck(nn.Module):
    """Residual bottleneck: 1x1 to cout/2, 3x3, 1x1 to cout; 1x1 conv+BN shortcut if cin != cout."""

    def __init__(self, cin: int, cout: int):
        super().__init__()
        mid = cout // 2
        self.reduce = ConvBN(cin, mid, 1)
        self.conv = ConvBN(mid, mid, 3)
        self.expand = ConvBN(mid, cout, 1, activation=False)
        self.shortcut = nn.Identity() if cin == cout else ConvBN(cin, cout, 1, activation=False)
        self.act = leaky_relu()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.expand(self.conv(self.reduce(x))) + self.shortcut(x))


class SqueezeExcitation(nn.Module):
    """Channel gate: global average pool, Linear(c, c/r), LeakyReLU, Linear(c/r, c), sigmoid."""

    def __init__(self, channels: int, reduction: int):
        super().__init__()
        hidden = max(1, channels // reduction)
        self.squeeze = nn.Linear(channels, hidden)
        self.act = leaky_relu()
        self.excite = nn.Linear(hidden, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.excite(self.act(self.squeeze(x.mean(dim=(2, 3))))))
        return x * gate[:, :, None, None]


class DilatedContext(nn.Module):
    """Sequential dilated 3x3 convs; their output is concatenated to their input (cin + width)."""

    def __init__(self, cin: int, width: int, dilations: tuple[int, ...] = STEM_DILATIONS):
        super().__init__()
        self.convs = nn.Sequential(*[ConvBN(cin if i == 0 else width, width, 3, dilation=d)
                                     for i, d in enumerate(dilations)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, self.convs(x)], dim=1)


class Stem(nn.Sequential):
    """Image to stride 4: 7x7/2 conv, residual to 2*base, maxpool, residual, six dilated convs
    concatenated to their input (base 64: 3->64->128, pool, 128->128, +128 = 256)."""

    def __init__(self, base: int, out_channels: int):
        wide = 2 * base
        super().__init__()
        self.conv = ConvBN(3, base, 7, stride=2)
        self.res1 = Bottleneck(base, wide)
        self.pool = nn.MaxPool2d(2)
        self.res2 = Bottleneck(wide, wide)
        self.context = DilatedContext(wide, out_channels - wide)
