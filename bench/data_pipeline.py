"""Benchmark of the data pipeline: samples/s of one process with one thread, and file size.

    python bench/data_pipeline.py [--input-size 512] [--samples 300] [--repeats 3] [--h5 FILE.h5]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import cv2  # noqa: E402
import torch  # noqa: E402

from config.loader import build_config  # noqa: E402
from config.views import SampleSettings  # noqa: E402
from data.dataset import KeypointDataset  # noqa: E402
from data.transfer import batch_bytes, expand, trim_people  # noqa: E402
from bench.helpers import make_bench_h5  # noqa: E402


DECODE, WARP = "read: picture (HDF5, JPEG decode)", "augment: picture warp"    # stages of a sample


def measure(dataset: KeypointDataset, samples: int, repeats: int) -> dict:
    """CPU seconds per stage, target drawing and whole item: the fastest of `repeats` passes."""
    count = len(dataset)
    dataset.sample_arrays(0)                                   # open the file, warm caches
    stages: dict = {}
    for _ in range(repeats):
        one_pass: dict = {}
        for n in range(samples):
            dataset.augmented(divmod(n, count), one_pass)
        for name, seconds in one_pass.items():
            stages[name] = min(seconds, stages.get(name, seconds))
    drawn: dict = {}
    for n in range(samples):
        dataset.sample_arrays(divmod(n, count), drawn)
    stages["targets"] = drawn["targets"]
    passes = []
    for _ in range(repeats):
        start, wall = time.process_time(), time.perf_counter()
        for n in range(samples):
            dataset.compact_item(divmod(n, count))
        passes.append((time.process_time() - start, time.perf_counter() - wall))
    stages["total"], stages["total_wall"] = min(passes)
    stages["total_median"] = statistics.median(cpu for cpu, _ in passes)
    stages["total_passes"] = [cpu for cpu, _ in passes]
    stages["bytes"] = batch_bytes(dataset.compact_item(0))
    stages["float32_bytes"] = batch_bytes(dataset[0])
    return stages


def cpu_path(dataset: KeypointDataset, samples: int, repeats: int, batch: int) -> tuple[float, list]:
    """(fastest, every pass's) CPU seconds of a CPU-only run's data: items expanded on the CPU."""
    count, painter = len(dataset), dataset.painter_for(torch.device("cpu"))
    passes = []
    for _ in range(repeats):
        start = time.process_time()
        for first in range(0, samples, batch):
            items = [dataset.compact_item(divmod(n, count))
                     for n in range(first, min(first + batch, samples))]
            image, people, masks = (torch.stack(t) for t in zip(*items))
            expand(image, trim_people(people), masks, painter)
        passes.append(time.process_time() - start)
    return min(passes), passes


def drawing_time(painter, batches: list) -> float:
    """CPU seconds per batch of `painter`'s target drawing of `batches`, run on the CPU."""
    start = time.process_time()
    for people, person_mask in batches:
        painter(people, person_mask)
    return (time.process_time() - start) / len(batches)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input-size", type=int, default=512)
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3, help="passes over the samples (the fastest shown)")
    parser.add_argument("--batch", type=int, default=16, help="samples per batch of the device drawing")
    parser.add_argument("--h5", default="", help="time this file instead of coco4")
    parser.add_argument("--coco-dir", help="coco4's folder (default: $SIMPLEPOSE_COCO4, tests/data/coco4)")
    args = parser.parse_args(argv)
    cv2.setNumThreads(1)
    torch.set_num_threads(1)
    cfg = build_config(None, {"data": {"input_size": args.input_size}})
    with tempfile.TemporaryDirectory() as tmp:
        h5_path, source = ((Path(args.h5), Path(args.h5).name) if args.h5
                           else make_bench_h5(Path(tmp), 1, args.coco_dir))
        dataset = KeypointDataset(h5_path, SampleSettings.of(cfg), train=True)
        stages = measure(dataset, args.samples, max(1, args.repeats))
        cpu_best, cpu_passes = cpu_path(dataset, args.samples, max(1, args.repeats), args.batch)
        items = [dataset.compact_item((0, n % len(dataset)))          # (people, person masks) batches
                 for n in range(max(args.batch, min(args.samples, 4 * args.batch)))]
        batches = [(trim_people(torch.stack([p for _, p, _ in items[n:n + args.batch]])),
                    torch.stack([m[1:] for _, _, m in items[n:n + args.batch]]))
                   for n in range(0, len(items) - args.batch + 1, args.batch)]
        drawing = drawing_time(dataset.painter, batches)
        host_drawing = drawing_time(dataset.host_painter, batches)
        pixels = [dataset.h5.image_size(i) for i in range(dataset.h5.num_images)]
        raw = sum(h * w * 3 for h, w in pixels) / len(pixels)
        raw_masks = sum(h * w * 2 for h, w in pixels) / len(pixels)
        stored = h5_path.stat().st_size / len(pixels)
    out = args.input_size // cfg.data.stride
    print(f"data pipeline, one process, one thread: input {args.input_size}, targets 50x{out}x{out}, "
          f"{args.samples} samples of {source}")
    print(f"{'stage':<32}{'ms/sample':>10}{'samples/s':>12}")
    rates = {}
    for stage in ("read", "augment", "targets", "total"):
        parts = {name.split(": ", 1)[1]: seconds for name, seconds in stages.items()
                 if name.startswith(stage + ": ")}
        stages.setdefault(stage, sum(parts.values()))
        ms = stages[stage] / args.samples * 1e3
        rates[stage] = 1e3 / ms if ms > 0 else float("inf")
        note = {"targets": "  (CPU drawing; not in total: the device draws)",
                "total": "  (host work of a worker per sample)"}.get(stage, "")
        print(f"{stage:<32}{ms:>10.2f}{rates[stage]:>12.1f}{note}")
        for name, seconds in parts.items():
            print(f"  {name:<30}{seconds / args.samples * 1e3:>10.2f}")
    floor = (stages[DECODE] + stages[WARP]) / args.samples if {DECODE, WARP} <= set(stages) else None
    if floor:            # (an older checkout's dataset times its stages whole)
        print(f"(the picture's read, decode and warp alone: {floor * 1e3:.2f} ms/sample, {1 / floor:.1f} "
              "samples/s, the most any worker of this pipeline could reach with this decoder and warp)")
    wall_rate = args.samples / stages["total_wall"]
    median_rate = args.samples / stages["total_median"]
    print(f"(total: the fastest of {max(1, args.repeats)} passes; their median {median_rate:.1f} samples/s; "
          f"by wall clock {wall_rate:.1f} samples/s; rates are per CPU second)")
    print(f"CPU path (worker's share + expansion on the CPU device: input, targets, mask, batches of "
          f"{args.batch}): {cpu_best / args.samples * 1e3:.2f} ms/sample, "
          f"{args.samples / cpu_best:.1f} samples/s (fastest of {len(cpu_passes)})")
    print("passes, samples/s per CPU second: worker's share "
          + " ".join(f"{args.samples / t:.1f}" for t in stages["total_passes"])
          + "; CPU path " + " ".join(f"{args.samples / t:.1f}" for t in cpu_passes))
    print(f"device target drawing, run on this CPU: {drawing * 1e3:.1f} ms per batch of {args.batch} "
          f"({drawing * 1e3 / args.batch:.2f} ms/sample); windowed, as a CPU device draws: "
          f"{host_drawing * 1e3:.1f} ms")
    print(f"sent to the device: {stages['bytes'] / 1e6:.3f} MB/sample "
          f"(float32 tensors: {stages['float32_bytes'] / 1e6:.2f} MB)")
    ratio = stored / (raw + raw_masks)
    print(f"HDF5 {stored / 1e3:.1f} kB/image; raw pixels {raw / 1e3:.1f} kB/image "
          f"(+ uncompressed masks {raw_masks / 1e3:.1f} kB): {ratio:.3f} of raw pixels + masks")
    print(json.dumps({"input_size": args.input_size, "samples": args.samples,
                      "read_per_s": round(rates["read"], 1), "augment_per_s": round(rates["augment"], 1),
                      "picture_read_decode_warp_per_s": round(1 / floor, 1) if floor else None,
                      "targets_per_s": round(rates["targets"], 1), "total_per_s": round(rates["total"], 1),
                      "total_median_per_s": round(median_rate, 1), "repeats": max(1, args.repeats),
                      "total_wall_per_s": round(wall_rate, 1), "bytes_per_sample": stages["bytes"],
                      "total_passes_per_s": [round(args.samples / t, 1) for t in stages["total_passes"]],
                      "cpu_path_per_s": round(args.samples / cpu_best, 1),
                      "cpu_path_passes_per_s": [round(args.samples / t, 1) for t in cpu_passes],
                      "device_targets_cpu_ms_per_batch": round(drawing * 1e3, 1),
                      "host_targets_cpu_ms_per_batch": round(host_drawing * 1e3, 1), "batch": args.batch,
                      "float32_bytes_per_sample": stages["float32_bytes"],
                      "h5_bytes_per_image": round(stored), "raw_bytes_per_image": round(raw),
                      "raw_with_masks_bytes_per_image": round(raw + raw_masks),
                      "size_ratio": round(ratio, 4)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
