"""Score a model (or the ground-truth maps) on a validation split as the dataset's authors score it.

    python evaluate.py --weights checkpoints/RUN/best.pth --h5 coco_val.h5 [--scales 0.5 1 1.5 2 3] [--flip]
    python evaluate.py --weights best.pth --ann person_keypoints_val2017.json --images val2017/
    python evaluate.py --oracle --h5 coco_val.h5      # ground-truth maps through the decoder
    python evaluate.py --results other_tool_keypoints.json --h5 coco_val.h5   # predictions made elsewhere
    torchrun --nproc_per_node 2 evaluate.py --weights best.pth --h5 coco_val.h5

Prints the metrics the file's skeleton names (or --metric's), writes the results (--out) and ends
with one JSON line of the stats. Under torchrun every image is decoded by exactly one process.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from common.errors import ArgumentParser, ConfigError, DataError, os_reason, refuse_inapplicable
from common.paths import refuse_clashes, refuse_existing
from config.loader import build_config, out_of_bounds
from config.schema import FILE_FIELDS
from config.views import EvalOptions, PredictSettings
from data.h5format import KeypointH5
from data.make_hdf5 import ConvertSettings, convert
from data.skeleton import METRIC_KEYS, parse_scoring
from inference.coco_eval import format_recall
from inference.command_line import CONFIG_CARRIED, command_main, weights_options


def build_parser() -> ArgumentParser:
    p = weights_options(__doc__, "checkpoint (best.pth, last.pth), bare state dict, or ONNX file "
                        "written by export.py", required=False,
                        preset_help=f" or --oracle (default: imhn512); {CONFIG_CARRIED}")
    p.add_argument("--oracle", action="store_true",
                   help="decode the ground-truth maps at each image's own size instead of a network's")
    src = p.add_argument_group("data (one of)")
    src.add_argument("--h5", help="HDF5 split made by data.make_hdf5")
    src.add_argument("--ann", help="COCO person-keypoints JSON (with --images; converted to a temp HDF5)")
    src.add_argument("--images", help="image folder of --ann")
    p.add_argument("--results", help="score this COCO keypoint results JSON (or --out's .jsonl) instead")
    p.add_argument("--max-images", type=int, default=0, help="only the first N images (0: all)")
    p.add_argument("--out", help="results JSON (default: WEIGHTS_DATA_keypoints.json next to the weights, or "
                   "./oracle_DATA_keypoints.json); a name ending .jsonl: one JSON line per picture")
    p.add_argument("--metric", nargs="+", choices=list(METRIC_KEYS), help="default: the file's skeleton's")
    p.add_argument("--pck-threshold", type=float, help="PCK's threshold, a share of --pck-normalize "
                   "(default: the skeleton's, else 0.2)")
    p.add_argument("--pck-normalize", help="bbox (the person box's longer side) or KEYPOINT,KEYPOINT "
                   "(their distance) (default: the skeleton's, else bbox)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _check_args(args) -> None:
    if bool(args.h5) == bool(args.ann):
        raise ConfigError("give the data as --h5 FILE, or as --ann JSON with --images DIR")
    if args.ann and not args.images:
        raise ConfigError("option --ann needs --images, the folder of the annotated images")
    given = [name for name, value in (("--oracle", args.oracle), ("--weights", args.weights),
                                      ("--results", args.results)) if value]
    if not given:
        raise ConfigError("option --weights is required (or --oracle to score the ground-truth maps, "
                          "or --results FILE to score predictions made elsewhere)")
    if len(given) > 1:
        raise ConfigError(f"options {' and '.join(given)}: give one (the oracle scores the ground-truth "
                          "maps, --results a results file; no network runs)")
    if args.results:
        refuse_inapplicable({"--out": args.out, "--scales": args.scales, "--flip": args.flip}, "to --results",
                            "the file's results are scored as they are and nothing is written")
    if args.oracle:
        refuse_inapplicable({"--scales": args.scales, "--flip": args.flip}, "to --oracle", "it decodes the "
                            "ground-truth maps drawn once at each image's own size (stride 1)")
    if args.max_images < 0:
        raise ConfigError(f"option --max-images: {args.max_images} must be >= 0")
    problem = args.pck_threshold is not None and out_of_bounds(args.pck_threshold,
                                                               FILE_FIELDS["skeleton.pck_threshold"])
    if problem:
        raise ConfigError(f"option --pck-threshold: {args.pck_threshold} {problem}")


def _check_writable(path: Path, overwrite: bool) -> None:
    """Fail before the evaluation when the results JSON cannot be written there."""
    if path.is_dir():
        raise DataError(f"--out {path}: a folder; give the path of the results JSON to write")
    refuse_existing("--out", path, overwrite)
    existed = path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        open(path, "a").close()
    except OSError as exc:
        raise DataError(f"--out {path}: cannot write the results there ({os_reason(exc)})") from None
    if not existed:
        os.unlink(path)


def _converted_h5(args, rank: int, skeleton) -> tuple[str, str | None]:
    """(h5 path, temp dir to remove): rank 0 converts --ann/--images once, the others wait."""
    from runtime.distributed import barrier, decided_on_main
    if args.h5:
        return args.h5, None

    def convert_to_temp() -> str:
        tmp = tempfile.mkdtemp(prefix="evaluate_")
        try:
            origin = convert(args.ann, args.images, Path(tmp) / "val.h5", ConvertSettings(
                split="val", progress=not args.no_progress, max_images=args.max_images,
                skeleton=skeleton))["skeleton_origin"]
            for line in origin.splitlines() if skeleton is None else []:   # how the JSON's links count
                if "(categories[].skeleton) counted from" in line:
                    print(f"--ann {args.ann}: " + line.replace("; --links-from", "; python -m data.make_hdf5 "
                                                               "--links-from"), file=sys.stderr)
        except BaseException:            # a signal's KeyboardInterrupt too: no conversion left behind
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return tmp

    tmp = decided_on_main(convert_to_temp)
    barrier()
    return str(Path(tmp) / "val.h5"), (tmp if rank == 0 else None)


RECALL_LINES = 24     # keypoints listed on stderr (the lowest recall); the JSON line has them all


def _print_stats(stats: dict, scoring, skeleton) -> dict:
    """The metrics' table (and recall) on stderr; the stats for the JSON line."""
    if "oks" in scoring.metrics and skeleton.stand_in_sigmas:
        print(f"  OKS uses the stand-in sigma {skeleton.sigmas[0]:g} for every keypoint of skeleton "
              f"{skeleton.name}: nobody published its sigmas, so its AP compares with no paper's",
              file=sys.stderr)
    print(f"  {scoring.describe()}", file=sys.stderr)
    for name, value in stats.items():
        if name not in ("num_images", "keypoint_recall"):
            print(f"  {name:<9} " + ("n/a" if value is None else f"{value:.4f}" if isinstance(value, float)
                                     else f"{value}"), file=sys.stderr)
    recall = stats.get("keypoint_recall")
    if recall is None:
        return stats
    print("  recall per keypoint (labelled points in a found person at the right place), lowest first:",
          file=sys.stderr)
    lines = format_recall(list(recall), list(recall.values()))
    for line in lines[:RECALL_LINES]:
        print(line, file=sys.stderr)
    if len(lines) > RECALL_LINES:
        print(f"  ... and {len(lines) - RECALL_LINES} more keypoints, recalled at least as well "
              "(all of them in the JSON line below)", file=sys.stderr)
    return dict(stats, keypoint_recall={name: round(r / n, 4) if n else None
                                        for name, (n, r) in recall.items()})


def _scoring(args, h5_path: str):
    """(the file's skeleton, its scoring with the options' changes), each option checked by its name."""
    with contextlib.closing(KeypointH5(h5_path)) as h5:
        file_skeleton = h5.skeleton
    given = {"metric": args.metric, "pck_threshold": args.pck_threshold,
             "pck_normalize": (args.pck_normalize if args.pck_normalize in (None, "bbox")
                               else args.pck_normalize.split(","))}
    scoring = file_skeleton.scoring
    for key, value in given.items():
        if value is not None:
            scoring = parse_scoring({key: value}, file_skeleton.dataset_keypoints,
                                    f"option --{key.replace('_', '-')}", base=scoring)
    if "pck" not in scoring.metrics:
        refuse_inapplicable({"--pck-threshold": args.pck_threshold, "--pck-normalize": args.pck_normalize},
                            "here", f"no PCK is scored (metrics: {', '.join(scoring.metrics)}); add "
                            "--metric pck, or leave them out")
    return file_skeleton, scoring


def run(args) -> dict:
    _check_args(args)
    from inference import PoseEstimator, evaluation, loading    # torch: once the command line is read
    from runtime.distributed import barrier, cleanup, decided_on_main, init_distributed
    ctx = init_distributed(build_config(None).dist, args.device)
    temp_dir, out, model = None, None, None
    try:
        stem, weights = Path(args.ann or args.h5).stem, Path(args.weights or "")
        if not args.results:
            out = Path(args.out or (f"oracle_{stem}_keypoints.json" if args.oracle
                                    else weights.with_name(f"{weights.stem}_{stem}_keypoints.json")))
            refuse_clashes({"--weights": args.weights, "--h5": args.h5, "--ann": args.ann,
                            "--images": args.images, "--preset": args.preset}, {"--out": out})
            decided_on_main(lambda: _check_writable(out, args.overwrite))
        if args.weights:
            estimator = PoseEstimator.from_file(args.weights, ctx.device, preset=args.preset, sets=args.set,
                                                scales=args.scales, flip=args.flip)
            network, settings = estimator.network, estimator.settings
            model = getattr(network, "model", network)     # evaluate_h5 sets a model's eval mode
        elif args.oracle:
            settings = PredictSettings.of(loading.inference_config(None, args.preset or "", args.set,
                                                                   args.scales, args.flip))
        skeleton = model.skeleton if model is not None else None
        h5_path, temp_dir = _converted_h5(args, ctx.rank, skeleton)
        file_skeleton, scoring = _scoring(args, h5_path)
        start = time.perf_counter()
        if args.results:
            stats = decided_on_main(lambda: evaluation.score_results(args.results, h5_path, args.max_images,
                                                                     scoring))
        else:
            options = EvalOptions(max_images=args.max_images, progress=not args.no_progress,
                                  oracle=args.oracle, results_path=out, overwrite=args.overwrite,
                                  skeleton=skeleton, scoring=scoring, recall=args.oracle)
            stats = evaluation.evaluate_h5(model, h5_path, settings, ctx.device, options)
        seconds = time.perf_counter() - start
        if ctx.is_main:
            how = ("the results as given" if args.results else
                   "ground-truth maps at each image's size (oracle)" if args.oracle else
                   f"scales {settings.inference.scales}, flip {settings.inference.flip}")
            print(f"{args.results or ('oracle' if args.oracle else args.weights)} on {args.ann or h5_path}: "
                  f"{stats['num_images']} images, {how}, {seconds:.1f} s", file=sys.stderr)
            shown = _print_stats(stats, scoring, file_skeleton)
            if out is not None:
                print(f"results written to {out}", file=sys.stderr)
            print(json.dumps(dict(shown, seconds=round(seconds, 2), results=str(out or args.results))),
                  flush=True)
        barrier()
        return stats
    finally:
        if temp_dir:
            shutil.rmtree(temp_dir, ignore_errors=True)
        cleanup()


main = command_main(build_parser, run, "no results were written (an existing --out is as it was)")


if __name__ == "__main__":
    sys.exit(main())
