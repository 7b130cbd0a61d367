"""The options evaluate.py, demo.py and export.py share, declared once as an argparse parent parser
(`ArgumentParser(parents=[weights_options(...)])`): the network to load (--weights), the config a
bare state dict is read with (--preset, --set), --overwrite of the output, and for the scripts that
decode pictures --scales, --flip and --device. Each script words what its --weights accepts."""
from __future__ import annotations

import argparse

from common.errors import ArgumentParser

CONFIG_CARRIED = "a checkpoint of this trainer carries its own config"


def weights_options(weights_help: str, *, required: bool = True, preset_help: str = "",
                    set_example: str = "inference.peak_threshold=0.05",
                    decoding: bool = True) -> ArgumentParser:
    """The parent parser: `weights_help` says what --weights may be; `preset_help` ends the
    --preset help; `set_example` is --set's example; `decoding` adds --scales, --flip, --device."""
    p = ArgumentParser(add_help=False)
    p.add_argument("--weights", required=required, help=weights_help)
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--preset", help=f"config preset for a bare state dict{preset_help}")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help=f"override any config field, e.g. {set_example}")
    if decoding:
        p.add_argument("--scales", type=float, nargs="+", help="image heights to run, in units of "
                       "input_size (1: input_size px; default: the config's)")
        p.add_argument("--flip", action=argparse.BooleanOptionalAction, default=None,
                       help="also run the mirror image (default: config)")
        p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    return p
