"""What Apex's O2 state-dict hook costs, and what the precision backends read instead: on a network
of a preset after Apex's real `amp.initialize` at O2 (on a CPU with the stand-ins of
tests/apex_cpu_standins.py; needs Apex 25.04 on PYTHONPATH), the time of `model.state_dict()`
(one hook per module, each over every key) against `precision.float32_state_dict(model)` (the
live tensors, what checkpoints and the EMA use), alternating, median of `--repeats`.

    PYTHONPATH=vendor_local/apex-25.04 python bench/apex_state_dict.py --preset imhn512
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from apex_cpu_standins import install, remove      # noqa: E402
from config.loader import build_config              # noqa: E402
from data.skeleton import builtin                 # noqa: E402
from engine.precision.apex import ApexPrecision     # noqa: E402
from models import build_model                      # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="imhn512")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    install()
    try:
        cfg = build_config(args.preset, sets=["amp.backend=apex", "amp.opt_level=O2", "amp.dtype=float16",
                                              "amp.channels_last=false"])
        model = build_model(cfg.model, builtin("coco"))
        precision = ApexPrecision(cfg.amp, torch.device("cpu"))
        model = precision.prepare_model(model)
        optimizer = torch.optim.SGD(precision.optimizer_params(list(model.parameters())), lr=0.1)
        model, optimizer = precision.attach(model, optimizer)
        times = {"model.state_dict()": [], "float32_state_dict": []}
        for _ in range(args.repeats):
            for name, call in (("model.state_dict()", model.state_dict),
                               ("float32_state_dict", lambda: precision.float32_state_dict(model))):
                start = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - start)
        modules = len(list(model.modules()))
        print(f"{args.preset}: {modules} modules, Apex O2; {precision.build.describe()}")
        for name, values in times.items():
            print(f"  {name:>20}: median {statistics.median(values):.3f} s over {args.repeats}")
    finally:
        remove()


if __name__ == "__main__":
    main()
