"""The options evaluate.py, demo.py and export.py share (--weights, --preset, --set, --overwrite, and
--scales, --flip, --device for those that decode pictures) and their `main`."""
from __future__ import annotations

import argparse

from common.errors import ArgumentParser, run_cli
from config.schema import add_flags

CONFIG_CARRIED = "a checkpoint of this trainer carries its own config"


def weights_options(doc: str, weights_help: str, *, required: bool = True, preset_help: str = "",
                    set_example: str = "inference.peak_threshold=0.05",
                    decoding: bool = True) -> ArgumentParser:
    """A script's parser (`doc`: its --help) with the shared options (`decoding`: --scales, --flip)."""
    p = ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", required=required, help=weights_help)
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--preset", help=f"config preset for a bare state dict{preset_help}")
    add_flags(p, ("inference.scales", "inference.flip", "train.device") if decoding else (), set_example)
    p.set_defaults(device="auto")
    return p


def command_main(build_parser, run, kept: str):
    """A script's `main(argv=None)`: a user error is one line and its exit code; a stop says `kept`."""
    return lambda argv=None: run_cli(lambda args: run(build_parser().parse_args(args)), argv, kept=kept)
