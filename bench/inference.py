"""Inference throughput on coco4's pictures: pictures/s through the network, through grouping, and both
as `inference.PoseEstimator` runs them; then a picture's time stage by stage; one JSON line.

    python bench/inference.py [--preset tiny] [--weights W] [--batch-sizes 1 8] [--threads 1 2]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import time
from collections import deque
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cv2  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.helpers import markdown_table, sync  # noqa: E402
from config.schema import add_flags  # noqa: E402
from data.skeleton import builtin  # noqa: E402
from config.views import PredictSettings  # noqa: E402
from data.targets import render_targets  # noqa: E402
import inference.estimator  # noqa: E402
import inference.grouping  # noqa: E402
import inference.predict  # noqa: E402
from inference.coco_eval import coco_keypoint_stats  # noqa: E402
from inference.estimator import PoseEstimator, decode_threads, grouped_in_pool  # noqa: E402
from inference.evaluation import read_ahead  # noqa: E402
from inference.grouping import group_people, to_coco_results  # noqa: E402
from inference.loading import inference_config, pick_device  # noqa: E402
from models import build_model  # noqa: E402

COCO = builtin("coco")      # coco4's people; a model without --weights is built for them
COCO4 = Path(__file__).resolve().parents[1] / "tests" / "data" / "coco4"


def evaluation_rates(estimator: PoseEstimator, encoded: list, threads: int, rounds: int) -> dict:
    """Fastest pictures/s over `rounds` of evaluating `encoded` (JPEG), serially and read ahead."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    inference_cfg = estimator.settings.inference
    inference_cfg.decode_threads = threads
    best = {"serial": 0.0, "read_ahead": 0.0}
    for _ in range(rounds):
        for mode in best:
            pictures = (cv2.imdecode(data, cv2.IMREAD_COLOR) for data in encoded)
            if mode == "read_ahead":
                pictures = read_ahead(pictures, inference_cfg.batch_size)
            start = time.perf_counter()
            deque(grouped_in_pool(estimator.maps_stream(pictures), inference_cfg, estimator.skeleton), 0)
            best[mode] = max(best[mode], len(encoded) / (time.perf_counter() - start))
    torch.set_num_threads(before)
    return {"threads": threads, **{f"{mode}_pictures_per_s": rate for mode, rate in best.items()}}


STAGES = ("decode", "resize", "host_to_device", "network", "maps_back", "peaks", "grouping", "scoring")


def split(estimator: PoseEstimator, encoded: list, truth: dict) -> dict:
    """ms a picture per stage of one serial pass over `encoded` ("other": the rest of the clock)."""
    spent = dict.fromkeys(STAGES, 0.0)
    cfg, skeleton, results = estimator.settings.inference, estimator.skeleton, []
    ids = [info["id"] for info in truth["images"]]

    def timed(name, function):               # a stage's function, its time (synchronised) to `spent`
        def call(*args, **kwargs):
            tick = time.perf_counter()
            out = function(*args, **kwargs)
            sync(estimator.device)
            spent[name] += time.perf_counter() - tick
            return out
        return call
    with contextlib.ExitStack() as patches:
        for name, (owner, attribute) in {"resize": (inference.predict, "resize_for_scale"),
                                         "host_to_device": (inference.predict, "pictures_to_batch"),
                                         "network": (type(estimator.network), "__call__"),
                                         "maps_back": (inference.estimator, "picture_maps"),
                                         "peaks": (inference.grouping, "find_peaks"),
                                         "decode": (cv2, "imdecode")}.items():
            timed_call = timed(name, getattr(owner, attribute))
            patches.enter_context(mock.patch.object(owner, attribute, timed_call))
        start = time.perf_counter()
        pictures = (cv2.imdecode(data, cv2.IMREAD_COLOR) for data in encoded)
        group, to_results = timed("grouping", group_people), timed("scoring", to_coco_results)
        for k, make in enumerate(estimator.network_stream(pictures)):
            keypoints, scores = group(make(), cfg, skeleton)
            results += to_results(ids[k % len(ids)], keypoints, scores, skeleton)
        timed("scoring", coco_keypoint_stats)(truth, results, image_ids=ids, sigmas=skeleton.sigmas)
        spent["grouping"] -= spent["peaks"]
        spent["other"] = time.perf_counter() - start - sum(spent.values())
    return {stage: 1e3 * s / len(encoded) for stage, s in spent.items()}


def coco4_truth(targets) -> tuple[list[np.ndarray], list[np.ndarray], dict]:
    """coco4's JPEG bytes, the ground-truth maps [50, H, W] of their labelled people, the annotations."""
    data = json.loads((COCO4 / "test_coco.json").read_text())
    encoded = [np.fromfile(str(COCO4 / info["file_name"]), np.uint8) for info in data["images"]]
    truths = [render_targets(np.stack([COCO.from_annotation(a["keypoints"]) for a in data["annotations"]
                                       if a["image_id"] == info["id"] and a["num_keypoints"] > 0]),
                             info["height"], info["width"], 1, targets, COCO) for info in data["images"]]
    return encoded, truths, data


def measure(estimator: PoseEstimator, pictures, truths, batch_size: int) -> dict:
    """Seconds of the network alone, of grouping alone (one thread) and of both in the stream."""
    estimator.settings.inference.batch_size = batch_size
    inference_cfg = estimator.settings.inference
    list(estimator.maps_stream(pictures))      # warm-up: the first pass of each input shape is slow
    sync(estimator.device)
    start = time.perf_counter()
    maps = list(estimator.maps_stream(pictures))
    network_s = time.perf_counter() - start
    to_group = truths if truths is not None else maps
    start = time.perf_counter()
    found = [len(group_people(m, inference_cfg, estimator.skeleton)[1]) for m in to_group]
    grouping_s = time.perf_counter() - start

    def network_then_maps():
        for lo in range(0, len(pictures), batch_size):
            computed = estimator.maps(pictures[lo: lo + batch_size])
            yield from (truths[lo: lo + batch_size] if truths is not None else computed)

    start = time.perf_counter()
    deque(grouped_in_pool(network_then_maps(), inference_cfg, estimator.skeleton), 0)    # run through
    both_s = time.perf_counter() - start
    n = len(pictures)
    return {"batch_size": batch_size, "network_pictures_per_s": n / network_s,
            "grouping_pictures_per_s": n / grouping_s, "pictures_per_s": n / both_s,
            "network_share": network_s / (network_s + grouping_s), "people_found": sum(found)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny", help="network without --weights (default tiny)")
    p.add_argument("--weights", help="checkpoint: its network, and grouping on its own maps")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--repeat", type=int, default=4, help="times each coco4 picture is used")
    add_flags(p, ("inference.scales", "inference.flip", "train.device"), "inference.decode_threads=2")
    p.set_defaults(device="auto")
    p.add_argument("--threads", type=int, nargs="*", default=[1, 2],
                   help="thread counts of the evaluation stream rows (none: skip them)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of the evaluation stream")
    args = p.parse_args(argv)

    if args.weights:
        estimator = PoseEstimator.from_checkpoint(args.weights, args.device, sets=args.set,
                                                  scales=args.scales, flip=args.flip)
    else:
        cfg = inference_config(None, args.preset, args.set, args.scales, args.flip)
        estimator = PoseEstimator(build_model(cfg.model, COCO).to(pick_device(args.device)).eval(),
                                  PredictSettings.of(cfg))
    encoded, truths, data = coco4_truth(estimator.settings.targets)
    pictures = [cv2.imdecode(jpeg, cv2.IMREAD_COLOR) for jpeg in encoded] * args.repeat
    truths = None if args.weights else truths * args.repeat
    rows = [measure(estimator, pictures, truths, b) for b in args.batch_sizes]
    estimator.settings.inference.batch_size = args.batch_sizes[-1]
    evaluation = [evaluation_rates(estimator, encoded * args.repeat, t, max(1, args.rounds))
                  for t in args.threads]
    split(estimator, encoded, data)          # warm-up
    stages = split(estimator, encoded * args.repeat, data)
    settings = estimator.settings
    machine = platform.processor() or platform.machine()
    print(f"{args.weights or args.preset} on {estimator.device} ({machine}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} torch threads, "
          f"{decode_threads(settings.inference)} grouping threads): {len(pictures)} coco4 pictures, "
          f"input_size {settings.input_size}, scales {settings.inference.scales}, "
          f"flip {settings.inference.flip}; "
          f"grouping on {'the network' if args.weights else 'ground-truth'} maps")
    print(markdown_table(
        ["batch", "network pictures/s", "grouping pictures/s (1 thread)", "both, pictures/s",
         "network share"],
        [[row["batch_size"], f"{row['network_pictures_per_s']:.2f}",
          f"{row['grouping_pictures_per_s']:.2f}", f"{row['pictures_per_s']:.2f}",
          f"{100 * row['network_share']:.0f} %"] for row in rows]))
    if evaluation:
        print(f"evaluation stream from JPEG bytes, batch {args.batch_sizes[-1]}, fastest of "
              f"{max(1, args.rounds)} alternating rounds (wall clock):")
        print(markdown_table(
            ["threads", "decoded serially, pictures/s", "read ahead, pictures/s", "ratio"],
            [[f"{row['threads']} torch + {row['threads']} grouping", f"{row['serial_pictures_per_s']:.2f}",
              f"{row['read_ahead_pictures_per_s']:.2f}",
              f"{row['read_ahead_pictures_per_s'] / row['serial_pictures_per_s']:.2f}"]
             for row in evaluation]))
    total = sum(stages.values())
    print(f"where a picture's time goes: one serial pass, batch {args.batch_sizes[-1]}, stages synchronised")
    print(markdown_table(["stage", "ms a picture", "share"],
                         [[stage.replace("_", " "), f"{ms:.2f}", f"{100 * ms / total:.0f} %"]
                          for stage, ms in [*stages.items(), ("total", total)]]))
    print(json.dumps({"device": str(estimator.device), "preset": args.weights or args.preset,
                      "evaluation": evaluation, "split_ms": stages, "pictures": len(pictures),
                      "scales": settings.inference.scales, "flip": settings.inference.flip,
                      "grouping_maps": "network" if args.weights else "truth", "rows": rows}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
