"""Evaluation's stream on a CPU: pictures/s of `inference.evaluation.decode_images` (HDF5 read, JPEG
decode, network, grouping) over coco4's val pictures, with N torch and grouping threads.

    python bench/evaluation_stream.py [--threads 1] [--repeat 4] [--batch 2] [--preset tiny] [--rounds 3]

The network is the preset's, untrained (grouping then finds few people: the stream's cost is the
decode and the network). It converts coco4 to a val HDF5 file, warms up once, then runs
`decode_images` over the pictures `--repeat` times, --rounds times; it prints the fastest round's
pictures/s by wall clock and one JSON line. Run it in two trees one after the other (alternating)
to compare two versions of the evaluation on the same machine.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from config.loader import build_config  # noqa: E402
from data.skeleton import builtin  # noqa: E402
from config.views import PredictSettings  # noqa: E402
from data.h5format import KeypointH5  # noqa: E402
from data.make_hdf5 import convert  # noqa: E402
from inference.evaluation import decode_images, eval_mode  # noqa: E402
from models import build_model  # noqa: E402

COCO4 = ROOT / "tests" / "data" / "coco4"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads and grouping threads")
    parser.add_argument("--repeat", type=int, default=4, help="times each coco4 picture is decoded")
    parser.add_argument("--batch", type=int, default=2, help="inference.batch_size: pictures per forward")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = build_config(args.preset, sets=[f"inference.decode_threads={args.threads}",
                                          f"inference.batch_size={args.batch}"])
    settings = PredictSettings.of(cfg)
    model = build_model(cfg.model, builtin("coco"))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "val.h5"
        convert(COCO4 / "test_coco.json", COCO4, path, split="val", progress=False)
        h5 = KeypointH5(path)
        indices = list(range(h5.num_images)) * args.repeat
        rates = []
        with eval_mode(model):
            decode_images(model, h5, indices[:h5.num_images], settings, "cpu", progress=False)
            for _ in range(max(1, args.rounds)):
                start = time.perf_counter()
                decode_images(model, h5, indices, settings, "cpu", progress=False)
                rates.append(len(indices) / (time.perf_counter() - start))
        h5.close()
    print(f"{args.preset} on the CPU, {args.threads} torch + grouping threads, {len(indices)} coco4 "
          f"pictures, batch {settings.inference.batch_size}: {max(rates):.2f} pictures/s "
          f"(fastest of {len(rates)} rounds: " + " ".join(f"{r:.2f}" for r in rates) + ")")
    print(json.dumps({"threads": args.threads, "pictures": len(indices), "preset": args.preset,
                      "pictures_per_s": round(max(rates), 3), "rounds": [round(r, 3) for r in rates]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
