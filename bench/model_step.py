"""Benchmark of the network: forward and forward+backward time per image, and one training step.

    python bench/model_step.py            # tiny and imhn on CPU (+ CUDA sections on a GPU machine)
    python bench/model_step.py --quick    # tiny only

CPU: `tiny` (batch 4 at its input size) and `imhn` (batch 1, one timed iteration, at 256 by
default: a 512 forward alone takes about 30 s on 2 cores) in float32 and under bfloat16 autocast.
bfloat16 runs only where the CPU has native bfloat16 (oneDNN; AVX512-BF16/AMX): elsewhere it is
emulated and 10-20x slower than float32, so it is reported as skipped unless --force-cpu-bf16.
CUDA, when present: both models (batch 4, imhn at 512) in float32, float16 autocast, bfloat16
autocast, and channels_last with float16 autocast, with the peak memory of forward+backward.
"forward" runs in eval mode without autograd; "train" is forward, the focal L2 loss, backward and
an SGD step in train mode. Timings are medians over the timed
iterations, after warm-up ones. The last line is one JSON object with every number.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from config.loader import build_config  # noqa: E402
from data.skeleton import builtin  # noqa: E402
from models import FocalL2Loss, build_model  # noqa: E402

CUDA_MODES = {   # name: (autocast dtype or None, channels_last)
    "float32": (None, False),
    "fp16_autocast": (torch.float16, False),
    "bf16_autocast": (torch.bfloat16, False),
    "channels_last_fp16": (torch.float16, True),
}
CPU_MODES = {"float32": (None, False), "bf16_autocast": (torch.bfloat16, False)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn, device: torch.device, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_model(preset: str, device: torch.device, batch: int, size: int, dtype, channels_last: bool,
                warmup: int, iters: int) -> dict:
    """Seconds per image of forward and of a training step, and the step's peak memory (CUDA)."""
    cfg = build_config(preset)
    torch.manual_seed(0)
    coco = builtin("coco")
    model = build_model(cfg.model, coco).to(device)
    loss_fn = FocalL2Loss(cfg.loss, coco).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.optim.lr, momentum=0.9)
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    model = model.to(memory_format=memory_format)
    images = torch.rand(batch, 3, size, size, device=device).to(memory_format=memory_format)
    target = torch.rand(batch, coco.num_channels, size // 4, size // 4, device=device)
    mask = torch.ones(batch, 1, size // 4, size // 4, device=device)
    autocast = torch.autocast(device.type, dtype=dtype) if dtype is not None else nullcontext()

    def forward():
        with torch.inference_mode(), autocast:
            model(images)

    def train_step():
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            per_sample, _ = loss_fn(model(images), target, mask)
        per_sample.mean().backward()
        optimizer.step()

    model.eval()
    forward_s = _median_time(forward, device, warmup, iters)
    model.train()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    train_s = _median_time(train_step, device, warmup, iters)
    result = {"batch": batch, "input": size, "forward_ms_per_image": round(1e3 * forward_s / batch, 3),
              "train_ms_per_image": round(1e3 * train_s / batch, 3),
              "train_step_s": round(train_s, 4)}
    if device.type == "cuda":
        result["peak_memory_mib"] = round(torch.cuda.max_memory_allocated(device) / 2 ** 20, 1)
    return result


def run_section(label: str, preset: str, device: torch.device, modes: dict, batch: int, size: int,
                warmup: int, iters: int) -> dict:
    out = {}
    for mode, (dtype, channels_last) in modes.items():
        try:
            out[mode] = bench_model(preset, device, batch, size, dtype, channels_last, warmup, iters)
        except RuntimeError as exc:      # e.g. out of memory, or a dtype the device lacks
            out[mode] = {"error": str(exc).splitlines()[0][:200]}
            if device.type == "cuda":
                torch.cuda.empty_cache()
        print(f"{label:<10} {mode:<20} {json.dumps(out[mode])}", flush=True)
    return out


def cpu_modes(force_bf16: bool) -> tuple[dict, str]:
    """CPU modes to run, and a note on bfloat16 when it is skipped."""
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if native or force_bf16:
        return CPU_MODES, ""
    modes = {k: v for k, v in CPU_MODES.items() if v[0] is None}
    return modes, (f"bf16_autocast skipped: no native bfloat16 on this CPU "
                   f"({torch.backends.cpu.get_cpu_capability()}); --force-cpu-bf16 runs it")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny only (CPU and CUDA)")
    parser.add_argument("--iters", type=int, default=5, help="timed iterations of tiny on CPU")
    parser.add_argument("--cuda-iters", type=int, default=20, help="timed iterations on CUDA")
    parser.add_argument("--imhn-cpu-iters", type=int, default=1, help="timed iterations of imhn on CPU")
    parser.add_argument("--imhn-cpu-input", type=int, default=256, help="imhn input size on CPU")
    parser.add_argument("--imhn-input", type=int, default=512, help="imhn input size on CUDA")
    parser.add_argument("--force-cpu-bf16", action="store_true",
                        help="run bfloat16 autocast on CPU even without native support (slow)")
    parser.add_argument("--cuda-batch", type=int, default=4)
    parser.add_argument("--threads", type=int, default=0,
                        help="CPU threads for torch (0: torch's default); "
                             "1 avoids thrashing on a busy machine")
    parser.add_argument("--no-cuda", action="store_true", help="skip the CUDA sections")
    args = parser.parse_args(argv)

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    tiny_size = build_config("tiny").data.input_size
    cpu = torch.device("cpu")
    modes, note = cpu_modes(args.force_cpu_bf16)
    results = {"torch": torch.__version__, "cpu_threads": torch.get_num_threads(), "cpu": {}}
    if note:
        results["cpu_note"] = note
        print(note, flush=True)
    results["cpu"]["tiny"] = run_section("cpu/tiny", "tiny", cpu, modes, 4, tiny_size, 1, args.iters)
    if not args.quick:
        results["cpu"]["imhn"] = run_section("cpu/imhn", "imhn", cpu, modes, 1, args.imhn_cpu_input,
                                             0, args.imhn_cpu_iters)
    if torch.cuda.is_available() and not args.no_cuda:
        gpu = torch.device("cuda")
        torch.backends.cudnn.benchmark = True
        results["cuda_device"] = torch.cuda.get_device_name(gpu)
        results["cuda"] = {"tiny": run_section("cuda/tiny", "tiny", gpu, CUDA_MODES, args.cuda_batch,
                                               tiny_size, 3, args.cuda_iters)}
        if not args.quick:
            results["cuda"]["imhn"] = run_section("cuda/imhn", "imhn", gpu, CUDA_MODES,
                                                  args.cuda_batch, args.imhn_input, 3, args.cuda_iters)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
