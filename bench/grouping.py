"""Grouping time per image (ready maps of real COCO poses, one CPU thread) against the number of people:
median and p90 ms, one JSON line. Targets: 5 people 20 ms; `--noise` (untrained maps) 150 and 400 ms.

    python bench/grouping.py [--people 1 2 5 10 20] [--noise] [--against ../other_checkout --cpu-time]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if "--code" in sys.argv[:-1]:            # time another checkout's grouping (see --against)
    sys.path.insert(0, str(Path(sys.argv[sys.argv.index("--code") + 1]).resolve()))

import cv2  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from config.schema import InferenceConfig, TargetConfig  # noqa: E402
try:
    from data.skeleton import builtin  # noqa: E402
except ImportError:                      # a --code checkout that keeps the skeleton in config/
    from config.skeleton import builtin  # noqa: E402
from data.targets import render_targets  # noqa: E402
from inference.grouping import group_people, limb_connections  # noqa: E402
from inference.peaks import find_peaks  # noqa: E402

COCO = builtin("coco")
COCO4 = Path(__file__).resolve().parents[1] / "tests" / "data" / "coco4" / "test_coco.json"
TARGET_MS_5_PEOPLE = 20.0
TARGET_MS_NOISE = {"blurred": 150.0, "pure": 400.0}


def load_poses(path: Path) -> list[np.ndarray]:
    """Poses [18, 3] of the labelled people, shifted to their box's top-left, with >= 10 keypoints."""
    poses = []
    for ann in json.loads(path.read_text())["annotations"]:
        if ann["num_keypoints"] >= 10:
            pose = COCO.from_annotation(ann["keypoints"])
            seen = pose[:, 2] > 0
            pose[seen, :2] -= pose[seen, :2].min(0)
            poses.append(pose)
    return poses


def compose(poses, count: int, height: int, width: int, rng) -> np.ndarray:
    """`count` random poses, each scaled to 80-300 px tall and placed inside the canvas."""
    people = []
    for _ in range(count):
        pose = poses[rng.integers(len(poses))].copy()
        seen = pose[:, 2] > 0
        extent = pose[seen, :2].max(0)
        scale = rng.uniform(80, min(300, 0.9 * height)) / max(extent[1], 1.0)
        pose[seen, :2] *= scale
        room = np.maximum(np.array([width, height]) - extent * scale - 1, 1)
        pose[seen, :2] += rng.uniform(0, 1, 2) * room
        people.append(pose)
    return np.stack(people)


def noise_maps(kind: str, height: int, width: int, rng) -> np.ndarray:
    """[50, H, W] maps of an untrained network: "blurred" or "pure" noise (see the module doc)."""
    if kind == "pure":
        return rng.random((COCO.num_channels, height, width), dtype=np.float32)
    maps = (rng.random((COCO.num_channels, height, width)) * 0.3).astype(np.float32)
    return np.stack([cv2.GaussianBlur(m, (0, 0), 2) for m in maps]) * 3


def time_grouping(make_maps, reps: int, cfg: InferenceConfig, clock=time.perf_counter,
                  stages: bool = False) -> tuple[dict, dict]:
    """({median_ms, p90_ms, mean_found}, with `stages` the median ms per stage) of `reps` maps."""
    times: dict = {"total": [], "peaks": [], "limbs": [], "read_once": []}
    found = []
    for _ in range(reps):
        maps = make_maps()
        group_people(maps, cfg, COCO)                   # warm caches
        runs = [("total", lambda: found.append(len(group_people(maps, cfg, COCO)[0])))]
        if stages:
            keypoint_maps, limb_maps = maps[COCO.keypoint_channels], maps[COCO.limb_channels]

            def peaks():
                return find_peaks(keypoint_maps, cfg.peak_threshold, cfg.refine_radius, cfg.max_peaks)
            channel, xy, score = peaks()
            bounds = np.searchsorted(channel, np.arange(COCO.num_keypoints + 1))
            runs += [("peaks", peaks), ("read_once", keypoint_maps.max),
                     ("limbs", lambda: limb_connections(limb_maps, bounds, xy, score, cfg, COCO.limbs))]
        for name, run in runs:
            start = clock()
            run()
            times[name].append((clock() - start) * 1e3)
    row = {"median_ms": round(float(np.median(times["total"])), 2),
           "p90_ms": round(float(np.percentile(times["total"], 90)), 2),
           "mean_found": round(float(np.mean(found)), 2)}
    if not stages:
        return row, {}
    split = {name: round(float(np.median(values)), 2) for name, values in times.items()}
    split["rest"] = round(split["total"] - split["peaks"] - split["limbs"], 2)
    return row, split


def pool_ms_per_image(maps: list, threads: int, cfg: InferenceConfig) -> float:
    """Wall ms per image of grouping `maps` in a pool of `threads`, as evaluation does."""
    with ThreadPoolExecutor(threads) as pool:
        start = time.perf_counter()
        list(pool.map(lambda m: group_people(m, cfg, COCO), maps))
        return round((time.perf_counter() - start) * 1e3 / len(maps), 2)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--people", type=int, nargs="+", default=[1, 2, 5, 10, 20])
    p.add_argument("--reps", type=int, default=15, help="images per row")
    p.add_argument("--size", type=int, nargs=2, default=[480, 640], metavar=("H", "W"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--noise", action="store_true", help="add the rows of blurred and pure noise maps")
    p.add_argument("--pool", type=int, default=0, metavar="THREADS", help="also group noise in a pool")
    p.add_argument("--cpu-time", action="store_true", help="time with CPU time, not the wall clock")
    p.add_argument("--stages", action="store_true", help="also split the time into peaks, limbs and the rest")
    p.add_argument("--code", metavar="DIR", help="time the grouping of the checkout DIR (its inference/)")
    p.add_argument("--against", metavar="DIR", help="alternate rounds of DIR's grouping and this one's")
    p.add_argument("--rounds", type=int, default=5, help="rounds of --against")
    args = p.parse_args(argv)
    if args.against:
        return alternate(args, argv if argv is not None else sys.argv[1:])
    torch.set_num_threads(1)
    cv2.setNumThreads(1)
    rng = np.random.default_rng(args.seed)
    poses = load_poses(COCO4)
    height, width = args.size
    cfg, targets = InferenceConfig(), TargetConfig()
    clock = time.process_time if args.cpu_time else time.perf_counter
    report, noise, stages, pool = {}, {}, {}, {}
    print(f"grouping on {height}x{width} maps, one thread, {args.reps} images each")
    print(f"{'people':>7} {'median ms':>10} {'p90 ms':>8} {'found':>7}")

    def truth_maps(count):
        return lambda: render_targets(compose(poses, count, height, width, rng), height, width, 1,
                                      targets, COCO)
    for count in args.people:
        row, stages[str(count)] = time_grouping(truth_maps(count), args.reps, cfg, clock, args.stages)
        report[str(count)] = row
        print(f"{count:>7} {row['median_ms']:>10.2f} {row['p90_ms']:>8.2f} {row['mean_found']:>7.2f}")
    if args.stages:
        print(f"{'people':>7} {'total':>7} {'peaks':>7} {'limbs':>7} {'rest':>7} {'read once':>10}")
        for count, row in stages.items():
            print(f"{count:>7} {row['total']:>7.2f} {row['peaks']:>7.2f} {row['limbs']:>7.2f} "
                  f"{row['rest']:>7.2f} {row['read_once']:>10.2f}")
    for kind, target in TARGET_MS_NOISE.items() if args.noise else ():
        row, _ = time_grouping(lambda: noise_maps(kind, height, width, rng), args.reps, cfg, clock)
        noise[kind] = dict(row, target_ms=target, meets_target=row["median_ms"] < target)
        print(f"{kind:>7} {row['median_ms']:>10.2f} {row['p90_ms']:>8.2f} {row['mean_found']:>7.2f}")
    if args.pool:
        maps = [noise_maps("blurred", height, width, rng) for _ in range(args.reps)]
        pool = {"threads": args.pool, "ms_per_image": pool_ms_per_image(maps, args.pool, cfg),
                "ms_per_image_1_thread": pool_ms_per_image(maps, 1, cfg)}
        print(f"blurred noise in a pool of {args.pool} threads: {pool['ms_per_image']:.1f} ms/image "
              f"(1 thread: {pool['ms_per_image_1_thread']:.1f})")
    five = report.get("5", {}).get("median_ms")
    print(json.dumps({"bench": "grouping", "image_hw": [height, width], "threads": 1,
                      "clock": "cpu" if args.cpu_time else "wall", "code": args.code or ".",
                      "reps": args.reps, "per_people": report, "target_ms_5_people": TARGET_MS_5_PEOPLE,
                      "meets_target": None if five is None else five < TARGET_MS_5_PEOPLE,
                      **{k: v for k, v in (("noise", noise), ("pool", pool),
                                           ("stages_ms", args.stages and stages)) if v}}))
    return 0


def alternate(args, argv: list) -> int:
    """Rounds of (DIR's grouping, this one's) in fresh processes; medians per row and the ratio."""
    options = ("--against", "--rounds")      # each with its value, left out of the children's argv
    base = [arg for n, arg in enumerate(argv)
            if arg not in options and (n == 0 or argv[n - 1] not in options)]
    runs: dict = {"against": [], "this": []}
    for round_ in range(args.rounds):
        for side, extra in (("against", ["--code", args.against]), ("this", [])):
            out = subprocess.run([sys.executable, str(Path(__file__).resolve()), *base, *extra],
                                 check=True, capture_output=True, text=True).stdout
            result = json.loads(out.strip().splitlines()[-1])
            rows = {k: v["median_ms"] for k, v in [*result["per_people"].items(),
                                                    *result.get("noise", {}).items()]}
            runs[side].append(rows)
            print(f"round {round_ + 1} {side:>7}: " + "  ".join(f"{k} {v:.2f}" for k, v in rows.items()),
                  flush=True)
    summary = {}
    for row in runs["this"][0]:
        theirs, ours = (float(np.median([rows[row] for rows in runs[side]])) for side in ("against", "this"))
        summary[row] = {"against_ms": round(theirs, 2), "this_ms": round(ours, 2), "ratio": round(ours / theirs, 3)}
    print(f"{'row':>8} {'against ms':>11} {'this ms':>8} {'ratio':>6}")
    for row, v in summary.items():
        print(f"{row:>8} {v['against_ms']:>11.2f} {v['this_ms']:>8.2f} {v['ratio']:>6.3f}")
    print(json.dumps({"bench": "grouping_against", "against": args.against, "rounds": args.rounds,
                      "clock": "cpu" if args.cpu_time else "wall", "rows": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
