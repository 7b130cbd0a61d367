"""A checkpoint of the Simple Pose authors, written as a checkpoint of this trainer (an entry script).

    python -m engine.convert_reference IN.pth OUT.pth [--config imhn512] [--set KEY=VALUE]

OUT.pth holds the weights (names mapped by `models.reference`, first conv BGR -> RGB), the SGD
momentum, the loss scale of an Apex amp state, the epoch to continue at and the config: the
preset (default imhn512) with the network read from IN.pth's shapes. So `evaluate.py`, `demo.py`,
`train.py --weights` and `train.py --resume` take OUT.pth alone. An existing OUT.pth is kept
unless `--overwrite`."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common.errors import ArgumentParser, run_cli
from common.paths import refuse_clashes, refuse_existing
from config.schema import REFERENCE_PRESET, add_flags


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m engine.convert_reference", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", metavar="IN.pth", help="checkpoint in the authors' layout")
    p.add_argument("out", metavar="OUT.pth", help="checkpoint of this trainer to write")
    p.add_argument("--config", default=REFERENCE_PRESET,
                   help=f"preset or YAML of the run it continues (default {REFERENCE_PRESET})")
    add_flags(p, keys=())
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT.pth")
    return p


def run(args) -> dict:
    from config.loader import build_config
    from data.skeleton import builtin
    from models import build_model
    from runtime import checkpoint as ckpt
    from engine.optim import build_optimizer
    from engine.checkpoints import reference_checkpoint

    source, out = Path(args.source), Path(args.out)
    refuse_clashes({"IN.pth": source, "--config": args.config}, {"OUT.pth": out})
    refuse_existing("OUT.pth", out, args.overwrite)
    # the network the file holds; a file of another layout is refused by `read_reference`, naming it
    settings = ckpt.reference_file_settings(source)
    cfg = build_config(args.config, overrides={"model": settings} if settings else None, sets=args.set)
    coco = builtin("coco")          # the authors trained on COCO persons
    reference = ckpt.read_reference(str(source))
    model = build_model(cfg.model, coco)
    ckpt.load_weights(model, reference)
    optimizer = build_optimizer(model.parameters(), cfg.optim)
    state = reference_checkpoint(reference, source, model, optimizer, cfg, coco)
    ckpt.save_checkpoint(str(out), state)
    print(f"{source}: the authors' layout converted (names mapped, first conv BGR -> RGB; "
          f"{state['origin']}); wrote {out}: config {args.config}, continues at epoch {state['epoch'] + 1}")
    return state


def main(argv=None) -> int:
    """The command line: a user error prints one line and returns its exit code."""
    return run_cli(lambda a: run(build_parser().parse_args(a)), argv,
                   kept="the converted checkpoint was not written; an existing --out is as it was")


if __name__ == "__main__":
    sys.exit(main())
