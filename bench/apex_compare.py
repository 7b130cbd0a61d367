"""Native AMP against NVIDIA Apex's amp: loss curves, images/s and memory, side by side.

Each configuration (backend x opt level, plus native O0 float32 as the reference) trains the same
`Trainer` that train.py builds, from the same initial weights, on the same batches (one training
file, seed, sampler and augmentation), for `--steps` steps, in its own process: Apex's O1 patches
torch's functions process-wide, so no configuration may run after another in one process.

Agreement criterion, per opt level: RMS over the steps of |apex - native| / float32 must not exceed
`--factor` (3) x the RMS of |native - float32| / float32, plus `--floor` (2e-3). The two backends
differ only in where they round to float16 (autocast's op lists against Apex's patched-function
lists; the same dynamic loss scaling), so each is a float16 perturbation of the same float32
run; the float32 run gives the size of that perturbation on this network and data, measured
rather than assumed. Two independent perturbations of one size differ by about sqrt(2) of it;
3 leaves room for Apex rounding more operations than autocast. A backend that mis-scaled,
skipped or failed to step would drift from the other by the training progress itself, which the
script prints (the float32 loss's change from the first to the last tenth of the steps) and
flags when it is not larger than the bound.
The floor covers step 0, where both start from identical weights and only the forward differs.
Each configuration's line ends with its precision's description; an Apex one names the Apex build
(with its CUDA extensions, or Python-only and what that costs), so figures say which Apex made them.

    python bench/apex_compare.py                              # GPU: imhn512 at 512, O1 and O2, 60 steps
    python bench/apex_compare.py --backends native --levels O1 --preset tiny --input 128 \\
        --batch 2 --steps 3 --device cpu                      # the script itself, on a CPU
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_data import make_bench_h5                 # noqa: E402
from bench.train_throughput import loader_batches, sync     # noqa: E402
from config import build_config                             # noqa: E402
from engine.precision.loss_scale import grad_scaler_fields      # noqa: E402


def child(args) -> dict:
    """One configuration: train `args.steps` steps, return its curve and speed."""
    from engine.cli import single_process_context
    from engine.run_trainer import Launch, build_loop
    sets = [f"amp.backend={args.backend}", f"amp.opt_level={args.level}", "amp.tf32=false",
            f"data.input_size={args.input}", f"data.train_h5={args.h5}", f"data.workers={args.workers}",
            f"train.batch_size={args.batch}", f"train.device={args.device}", f"train.seed={args.seed}",
            "train.tensorboard=false", "optim.warmup_epochs=0", *args.set]
    cfg = build_config(args.preset, sets=sets)
    with contextlib.redirect_stdout(io.StringIO()):
        launch = Launch(single_process_context(cfg.train.device))
        trainer, parts = build_loop(cfg, launch)
    device = launch.ctx.device
    trainer.net.train()
    batches = loader_batches(trainer)
    losses, skipped, scales, timed, tick = [], [], [], 0, None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for i in range(args.steps):
        if i == args.warmup:
            sync(device)
            tick = time.perf_counter()
        out = trainer.run_step([next(batches)])
        losses.append(out.loss)
        skipped.append(bool(out.skipped))
        scales.append(grad_scaler_fields(parts.precision.state_dict()).get("scale"))
        timed += i >= args.warmup
    sync(device)
    seconds = time.perf_counter() - tick if tick else float("nan")
    return {"backend": args.backend, "level": args.level, "precision": parts.precision.describe(),
            "losses": losses, "skipped": skipped, "scales": scales,
            "images_per_s": args.batch * timed / seconds if timed else None,
            "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None}


def rms(values) -> float:
    return math.sqrt(sum(v * v for v in values) / len(values))


def compare(runs: dict, levels, factor: float, floor: float) -> list[dict]:
    """Per opt level: the relative deviations and whether the backends agree (module docstring)."""
    reference = runs.get(("native", "O0"))
    verdicts = []
    for level in levels:
        native, apex = runs.get(("native", level)), runs.get(("apex", level))
        if not (native and apex and reference):
            continue
        ref = reference["losses"]
        rel = lambda a, b: [abs(x - y) / abs(r) for x, y, r in zip(a, b, ref)]   # noqa: E731
        between = rel(apex["losses"], native["losses"])
        native_fp16 = rel(native["losses"], ref)
        apex_fp16 = rel(apex["losses"], ref)
        bound = factor * rms(native_fp16) + floor
        # how far float32 training moved the loss: a backend that did not step would be off by
        # about this much, so the check can only tell such a backend apart where it exceeds the bound
        tenth = max(1, len(ref) // 10)
        progress = abs(sum(ref[:tenth]) - sum(ref[-tenth:])) / abs(sum(ref[:tenth]))
        verdicts.append({"level": level, "rms_apex_vs_native": rms(between), "max_apex_vs_native": max(between),
                         "rms_native_vs_fp32": rms(native_fp16), "rms_apex_vs_fp32": rms(apex_fp16),
                         "bound": bound, "fp32_progress": progress, "sensitive": progress > bound,
                         "skipped_native": sum(native["skipped"]),
                         "skipped_apex": sum(apex["skipped"]), "agree": rms(between) <= bound})
    return verdicts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="imhn512")
    p.add_argument("--input", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10, help="steps before the timing starts")
    p.add_argument("--levels", nargs="+", default=["O1", "O2"])
    p.add_argument("--backends", nargs="+", default=["native", "apex"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--factor", type=float, default=3.0)
    p.add_argument("--floor", type=float, default=2e-3)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config field for every run")
    p.add_argument("--coco-dir", help="coco4 (default: see bench/bench_data.py)")
    p.add_argument("--child", nargs=2, metavar=("BACKEND", "LEVEL"), help=argparse.SUPPRESS)
    p.add_argument("--h5", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        args.backend, args.level = args.child
        print(json.dumps(child(args)))
        return 0
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        h5, source = make_bench_h5(Path(tmp), max(1, -(-args.batch * args.steps // 4)), args.coco_dir)
        print(f"{args.preset} at {args.input}, batch {args.batch}, {args.steps} steps, seed {args.seed}, "
              f"data {source}; one process per configuration", flush=True)
        configs = [("native", "O0")] + [(b, lv) for lv in args.levels for b in args.backends]
        for backend, level in configs:
            command = [sys.executable, __file__, "--child", backend, level, "--h5", str(h5), "--work", tmp,
                       *[f"--{k}={getattr(args, k)}" for k in ("preset", "input", "batch", "steps", "warmup",
                                                              "device", "seed", "workers")],
                       *[f"--set={s}" for s in args.set]]
            proc = subprocess.run(command, capture_output=True, text=True)
            if proc.returncode != 0:
                tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
                print(f"{backend:>6} {level}: failed: {tail}", flush=True)
                runs[(backend, level)] = None
                continue
            run = json.loads(proc.stdout.strip().splitlines()[-1])
            runs[(backend, level)] = run
            speed = f"{run['images_per_s']:.2f} img/s" if run["images_per_s"] else "-"
            memory = f"{run['peak_mem_gib']:.2f} GiB" if run["peak_mem_gib"] else "-"
            print(f"{backend:>6} {level}: {speed:>12} {memory:>10}  {sum(run['skipped'])} skipped  "
                  f"first/last loss {run['losses'][0]:.6g} / {run['losses'][-1]:.6g}  ({run['precision']})",
                  flush=True)
    every = max(1, args.steps // 10)
    print("step " + " ".join(f"{b} {lv}".rjust(12) for (b, lv), run in runs.items() if run))
    for i in range(0, args.steps, every):
        print(f"{i:4d} " + " ".join(f"{run['losses'][i]:12.6g}" for run in runs.values() if run))
    verdicts = compare({k: v for k, v in runs.items() if v}, args.levels, args.factor, args.floor)
    for v in verdicts:
        print(f"{v['level']}: apex vs native RMS {v['rms_apex_vs_native']:.2e} (max {v['max_apex_vs_native']:.2e}), "
              f"native vs fp32 {v['rms_native_vs_fp32']:.2e}, apex vs fp32 {v['rms_apex_vs_fp32']:.2e}; "
              f"bound {v['bound']:.2e}: {'AGREE' if v['agree'] else 'DIFFER'}; float32 loss moved "
              f"{v['fp32_progress']:.1%}" + ("" if v["sensitive"] else
                                           " (less than the bound: raise --set optim.lr=... to test the steps)"),
              flush=True)
    print(json.dumps({"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                      "torch": torch.__version__, "runs": {f"{b} {lv}": r for (b, lv), r in runs.items()},
                      "verdicts": verdicts}))
    failed = any(r is None for r in runs.values()) or not all(v["agree"] for v in verdicts)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
