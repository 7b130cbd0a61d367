"""Training throughput of the full training step per precision setting (issue 8).

For each configuration (O0 float32 with TF32 off and on, O1 fp16, O1 bf16, O2, each optionally
with channels_last and torch.compile) it trains the model for a fixed number of steps on
synthetic batches (or on real HDF5 batches with --h5) and prints images/s, peak memory and the
share of the GPU's bf16 matrix-multiply peak that the step reaches (model FLOPs per step, counted
from the model as 3 x forward MACs x 2, over the step time, against a large bf16 matmul timed in
the same run). One JSON line last.

    python bench/train_throughput.py                         # GPU: imhn at 512, batch 16
    python bench/train_throughput.py --preset tiny --input 128 --batch 4 --steps 3 --device cpu
    python bench/train_throughput.py --h5 coco_train.h5 --workers 16   # with real data loading
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from config import build_config                      # noqa: E402
from engine.amp import Precision                     # noqa: E402
from engine.model_with_loss import ModelWithLoss     # noqa: E402
from engine.optim import build_optimizer             # noqa: E402
from models import FocalL2Loss, build_model          # noqa: E402
from models.summary import count_macs                # noqa: E402

CONFIGS = [  # name, opt level, dtype, tf32
    ("O0 fp32", "O0", "auto", False),
    ("O0 tf32", "O0", "auto", True),
    ("O1 fp16", "O1", "float16", True),
    ("O1 bf16", "O1", "bfloat16", True),
    ("O2 fp16", "O2", "float16", True),
]


def matmul_peak_tflops(device: torch.device, n: int = 8192, reps: int = 20) -> float:
    """Measured bf16 matmul throughput of this device (TFLOP/s)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n ** 3 * reps / (time.perf_counter() - start) / 1e12


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def batches(args, cfg, device):
    """An endless iterator of (images, target, mask) on the device."""
    s, o = args.input, args.input // 4
    if not args.h5:
        images = torch.rand(args.batch, 3, s, s, device=device)
        target = torch.rand(args.batch, 50, o, o, device=device) * 0.5
        mask = torch.ones(args.batch, 1, o, o, device=device)
        while True:
            yield images, target, mask
    from torch.utils.data import DataLoader
    from data.dataset import KeypointDataset
    dataset = KeypointDataset(args.h5, cfg, train=True)
    if args.workers:
        import cv2
        cv2.setNumThreads(1)     # as the engine does: set once, before the workers fork
    while True:
        loader = DataLoader(dataset, batch_size=args.batch, shuffle=True, drop_last=True,
                            num_workers=args.workers, pin_memory=device.type == "cuda",
                            persistent_workers=False, prefetch_factor=4 if args.workers else None)
        for batch in loader:
            yield tuple(t.to(device, non_blocking=True) for t in batch)


def run_config(args, name, level, dtype, tf32, channels_last, compile_model, device):
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    sets = [f"amp.opt_level={level}", f"amp.dtype={dtype}", f"data.input_size={args.input}",
            f"amp.channels_last={channels_last}", "optim.name=sgd", "optim.lr=1e-6"]
    cfg = build_config(args.preset, sets=sets)
    torch.manual_seed(0)
    model = build_model(cfg.model).to(device)
    precision = Precision(cfg.amp, device)
    model = precision.prepare_model(model)
    net = ModelWithLoss(torch.compile(model) if compile_model else model, FocalL2Loss(cfg.loss), precision)
    params = precision.optimizer_params([p for p in model.parameters() if p.requires_grad])
    optimizer = build_optimizer(params, cfg.optim, device_type=device.type)
    data = batches(args, cfg, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def step():
        images, target, mask = next(data)
        per_sample, _ = net(images, target, mask)
        precision.backward(per_sample.mean())
        precision.unscale_(optimizer)
        precision.step(optimizer, True)
        precision.zero_grad(optimizer)

    for _ in range(args.warmup):
        step()
    sync(device)
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync(device)
    seconds = (time.perf_counter() - start) / args.steps
    memory = torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None
    return {"config": name + (" +cl" if channels_last else "") + (" +compile" if compile_model else ""),
            "images_per_s": args.batch / seconds, "step_ms": seconds * 1e3, "peak_mem_gib": memory}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="imhn512")
    p.add_argument("--input", type=int, default=512)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--channels-last", choices=["off", "on", "both"], default="both")
    p.add_argument("--compile", choices=["off", "on", "both"], default="off")
    p.add_argument("--configs", nargs="+", help="subset of: " + ", ".join(c[0] for c in CONFIGS))
    p.add_argument("--h5", help="train from this HDF5 file instead of synthetic batches")
    p.add_argument("--workers", type=int, default=0)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":   # CPU: no fp16 tensor cores, no TF32; bf16 autocast is the mixed mode
        configs = [c for c in CONFIGS if c[0] in ("O0 fp32", "O1 bf16")]
    else:
        configs = CONFIGS
    if args.configs:
        configs = [c for c in CONFIGS if c[0] in args.configs]
    both = {"off": [False], "on": [True], "both": [False, True]}
    cfg = build_config(args.preset, sets=[f"data.input_size={args.input}"])
    macs, _ = count_macs(build_model(cfg.model), args.input)
    flops_per_image = 3 * 2 * macs              # forward + backward (2x forward)
    # the bf16 matmul peak is a GPU figure: a CPU without native bf16 emulates it, so no share there
    peak = matmul_peak_tflops(device) if device.type == "cuda" else None
    rows = []
    for name, level, dtype, tf32 in configs:
        for cl in both[args.channels_last]:
            for comp in both[args.compile]:
                row = run_config(args, name, level, dtype, tf32, cl, comp, device)
                row["tflops"] = row["images_per_s"] * flops_per_image / 1e12
                row["share_of_bf16_peak"] = row["tflops"] / peak if peak else None
                rows.append(row)
                print(f"{row['config']:<24} {row['images_per_s']:9.2f} img/s {row['step_ms']:9.1f} ms/step "
                      f"{row['peak_mem_gib'] or float('nan'):7.2f} GiB {row['tflops']:7.2f} TFLOP/s "
                      + (f"{100 * row['share_of_bf16_peak']:5.1f} % of bf16 matmul peak" if peak else ""),
                      flush=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(json.dumps({"device": name, "torch": torch.__version__, "preset": args.preset,
                      "input": args.input, "batch": args.batch, "steps": args.steps,
                      "gmac_per_image": macs / 1e9, "bf16_matmul_tflops": peak,
                      "data": args.h5 or "synthetic", "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
