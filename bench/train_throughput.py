"""Training throughput of the engine's own step per precision setting, synthetic or (--h5) through the
DataLoader: per row images/s, memory, first step, data wait, share of bf16 peak, host syncs; one JSON line.

    python bench/train_throughput.py --preset tiny --input 128 --batch 4 --steps 3 --device cpu
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.helpers import (bench_config, build_quietly, count_host_syncs, free_memory,  # noqa: E402
                           make_bench_h5, optimizer_step_counters, sync, synthetic_batches)
from config import build_config                        # noqa: E402
from data.skeleton import builtin                      # noqa: E402
from models import build_model                         # noqa: E402
from models.summary import count_macs                  # noqa: E402

CONFIGS = [  # name, opt level, dtype, tf32
    ("O0 fp32", "O0", "auto", False),
    ("O0 tf32", "O0", "auto", True),
    ("O1 fp16", "O1", "float16", True),
    ("O1 bf16", "O1", "bfloat16", True),
    ("O2 fp16", "O2", "float16", True),
]


def matmul_peak_tflops(device: torch.device, n: int = 8192, reps: int = 20) -> float:
    """Measured bf16 matmul throughput of this device (TFLOP/s)."""
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n ** 3 * reps / (time.perf_counter() - start) / 1e12


def run_config(args, h5: str, name, level, dtype, tf32, channels_last, compile_model) -> dict:
    label = (name + (" apex" if args.amp_backend == "apex" else "") + (" +cl" if channels_last else "")
             + (" +compile" if compile_model else ""))
    cfg = bench_config(args.preset, args.input, args.batch, args.device, h5, f"amp.backend={args.amp_backend}",
                       f"amp.opt_level={level}", f"amp.dtype={dtype}", f"amp.tf32={tf32}",
                       f"amp.channels_last={channels_last}", f"amp.compile={compile_model}",
                       f"data.workers={args.workers}")
    trainer, parts, device = build_quietly(cfg)
    trainer.net.train()
    # with --h5: the engine's DataLoader through its device feed, epoch after epoch, as train_one_epoch
    data = (itertools.chain.from_iterable(trainer.inputs.batches(epoch, 0) for epoch in itertools.count())
            if args.h5 else synthetic_batches(args.batch, cfg, device))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    skipped, waited = 0, 0.0
    try:
        tick = time.perf_counter()
        trainer.run_step([next(data)])
        sync(device)
        first_step = time.perf_counter() - tick       # under --compile: mostly the compilation
        for _ in range(1, args.warmup):
            trainer.run_step([next(data)])
        for _ in range(51):     # then on while the fp16 loss scale still falls (only whole steps are timed)
            if not trainer.run_step([next(data)]).skipped:
                break
        sync(device)
        start = time.perf_counter()
        # the steps' reads of tensor values on the host (the optimiser's CPU step counters aside)
        with count_host_syncs(optimizer_step_counters(parts.optimizer), device) as syncs:
            for _ in range(args.steps):
                tick = time.perf_counter()
                batch = next(data)
                waited += time.perf_counter() - tick
                skipped += trainer.run_step([batch]).skipped
        sync(device)
        seconds = (time.perf_counter() - start) / args.steps
        time_by_op = profile_steps(lambda i: trainer.run_step([next(data)]), args.profile, device)
    except torch.OutOfMemoryError:
        return {"config": label, "error": "out of memory"}
    finally:
        data = trainer = parts = None     # freed before free_memory, not kept by this frame
        if compile_model:
            torch._dynamo.reset()
        free_memory(device)
    memory = torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None
    return {"config": label, "images_per_s": args.batch / seconds, "step_ms": seconds * 1e3,
            "first_step_s": first_step,
            "data_wait_share": waited / (seconds * args.steps), "peak_mem_gib": memory,
            "skipped_steps": int(skipped), "host_syncs_per_step": syncs.count / args.steps,
            "host_syncs_by_kind": syncs.by_kind, **({"time_by_op": time_by_op} if time_by_op else {})}


OP_KINDS = (("inductor_fused", r"^triton_"),    # torch.compile's kernels, named after the ops they fuse
            ("convolution", r"conv"), ("matmul", r"::(mm|addmm|bmm|matmul|linear)\b"),
            ("batch_norm", r"batch_norm"), ("optimizer", r"::_foreach|::_fused_"))


def profile_steps(step, steps: int, device: torch.device) -> dict:
    """Share of the device's (CPU: the host's) op time per kind of op over `steps` more steps."""
    if not steps:
        return {}
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for i in range(steps):
            step(i)
        sync(device)
    attr = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    times: dict = {}
    for event in prof.key_averages():
        if event.device_type != DeviceType.CPU:    # a kernel: counted in the op that launched it
            continue
        kind = next((k for k, pattern in OP_KINDS if re.search(pattern, event.key)), "other")
        times[kind] = times.get(kind, 0.0) + getattr(event, attr)
    total = sum(times.values()) or 1.0
    return {kind: round(t / total, 4) for kind, t in sorted(times.items(), key=lambda kv: -kv[1])}


def print_row(row: dict, peak: float | None) -> None:
    if "error" in row:
        print(f"{row['config']:<24} {row['error']}", flush=True)
        return
    share = f"{100 * row['share_of_bf16_peak']:5.1f} % of bf16 matmul peak" if peak else ""
    print(f"{row['config']:<24} {row['images_per_s']:9.2f} img/s {row['step_ms']:9.1f} ms/step "
          f"{row['peak_mem_gib'] or float('nan'):7.2f} GiB {row['tflops']:7.2f} TFLOP/s "
          f"data wait {100 * row['data_wait_share']:4.1f} % "
          f"host syncs/step {row['host_syncs_per_step']:g} {share}"
          + (f" first step {row['first_step_s']:.0f} s" if row['first_step_s'] >= 10 else "")
          + (f"  ({row['skipped_steps']} steps skipped: timing invalid)" if row["skipped_steps"] else ""),
          flush=True)
    if row.get("time_by_op"):
        print("    op time: " + ", ".join(f"{k} {100 * v:.0f} %" for k, v in row["time_by_op"].items()),
              flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="imhn512")
    for flag, default in (("--input", 512), ("--batch", 16), ("--steps", 20), ("--warmup", 5)):
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--channels-last", choices=["off", "on", "both"], default="both")
    p.add_argument("--compile", choices=["off", "on", "both"], default="off")
    p.add_argument("--configs", nargs="+", help="subset of: " + ", ".join(c[0] for c in CONFIGS))
    p.add_argument("--amp-backend", choices=["native", "apex"], default="native", help="apex: NVIDIA Apex's")
    p.add_argument("--h5", help="feed the step through the engine's DataLoader ('coco4': coco4 x --repeat)")
    p.add_argument("--repeat", type=int, default=64, help="with --h5 coco4")
    p.add_argument("--coco-dir", help="where coco4 is (default: $SIMPLEPOSE_COCO4, else tests/data/coco4)")
    p.add_argument("--workers", type=int, default=None, help="DataLoader workers (default: CPU cores)")
    p.add_argument("--profile", type=int, default=0, metavar="STEPS", help="then op time by kind")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if args.workers is None:
        args.workers = len(os.sched_getaffinity(0)) if args.h5 else 0
    # CPU: no fp16 tensor cores, no TF32; bf16 autocast is the mixed mode
    names = args.configs or (["O0 fp32", "O1 bf16"] if device.type == "cpu" else [c[0] for c in CONFIGS])
    configs = [c for c in CONFIGS if c[0] in names]
    both = {"off": [False], "on": [True], "both": [False, True]}
    if args.amp_backend == "apex" and len(configs) * len(both[args.channels_last]) * len(both[args.compile]) != 1:
        p.error("--amp-backend apex: name one configuration (--configs, --channels-last on|off, "
                "--compile off): Apex's O1 patches torch process-wide, so one per process")
    macs, _ = count_macs(build_model(build_config(args.preset).model, builtin("coco")), args.input)
    flops_per_image = 3 * 2 * macs              # forward + backward (2x forward)
    # the bf16 matmul peak is a GPU figure: a CPU without native bf16 emulates it, so no share there
    peak = matmul_peak_tflops(device) if device.type == "cuda" else None
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.h5 and args.h5 != "coco4":
            h5, source = args.h5, args.h5
        else:       # synthetic batches still need a training file for the trainer to open
            repeat = args.repeat if args.h5 else max(1, -(-args.batch // 4))
            h5, source = make_bench_h5(Path(tmp), repeat, args.coco_dir)
        print(f"{args.preset} at {args.input}, batch {args.batch}, {args.steps} steps after {args.warmup}; "
              "data: " + (source + f" through the DataLoader, {args.workers} workers" if args.h5
                          else "synthetic batches on the device")
              + (f"; bf16 matmul peak {peak:.0f} TFLOP/s" if peak else ""), flush=True)
        for config, cl, comp in itertools.product(configs, both[args.channels_last], both[args.compile]):
            row = run_config(args, str(h5), *config, cl, comp)
            if "error" not in row:
                row["tflops"] = row["images_per_s"] * flops_per_image / 1e12
                row["share_of_bf16_peak"] = row["tflops"] / peak if peak else None
            rows.append(row)
            print_row(row, peak)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(json.dumps({"device": name, "torch": torch.__version__, "amp_backend": args.amp_backend,
                      "preset": args.preset, "input": args.input, "batch": args.batch, "steps": args.steps,
                      "gmac_per_image": macs / 1e9, "bf16_matmul_tflops": peak,
                      "data": source if args.h5 else "synthetic", "workers": args.workers, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
