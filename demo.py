"""Find the people in one picture and draw them.

    python demo.py --weights best.pth --image photo.jpg --out photo_pose.png [--heatmaps]
        [--scales 0.5 1 1.5 2 3] [--flip]

Each person's limbs and keypoints are drawn in its own colour; `--heatmaps` adds a side panel of
the summed keypoint and limb maps. Prints one line per person (score, keypoints found).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import cv2
import numpy as np

from config.errors import DataError, run_cli


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", required=True, help="checkpoint or bare state dict")
    p.add_argument("--image", required=True, help="picture to read (any format OpenCV reads)")
    p.add_argument("--out", help="picture to write (default: IMAGE_pose.png next to the image)")
    p.add_argument("--heatmaps", action="store_true", help="add a panel of the summed maps")
    p.add_argument("--scales", type=float, nargs="+", help="x input_size / image height (default: config)")
    p.add_argument("--flip", action=argparse.BooleanOptionalAction, default=None,
                   help="also run the mirror image (default: config)")
    p.add_argument("--preset", help="config preset for a bare state dict (default: the checkpoint's)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config field, e.g. inference.peak_threshold=0.05")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    return p


def run(args) -> Path:
    from config.schema import DistConfig
    from engine.distributed import init_distributed
    from inference.draw import draw_people, maps_panel
    from inference.grouping import group_people
    from inference.loading import load_model
    from inference.predict import predict_maps

    image = cv2.imread(args.image, cv2.IMREAD_COLOR)
    if image is None:
        raise DataError(f"{args.image}: cannot read this image (missing file or unknown format)")
    out = Path(args.out) if args.out else Path(args.image).with_name(Path(args.image).stem + "_pose.png")
    device = init_distributed(DistConfig(), args.device).device
    model, cfg = load_model(args.weights, args.preset, args.set, device, args.scales, args.flip)
    maps = predict_maps(model, image, cfg, device)
    keypoints, scores = group_people(maps, cfg.inference)
    picture = draw_people(image, keypoints)
    if args.heatmaps:
        picture = np.hstack([picture, maps_panel(image, maps)])
    try:
        written = cv2.imwrite(str(out), picture)
    except cv2.error:
        written = False
    if not written:
        raise DataError(f"{out}: cannot write the picture here (folder or extension?)")
    for k, (person, score) in enumerate(zip(keypoints, scores)):
        print(f"person {k}: score {score:.3f}, {int((person[:, 2] > 0).sum())} keypoints")
    print(f"{len(keypoints)} people found in {args.image}; written to {out}")
    return out


def main(argv=None) -> int:
    """The command line: a user error prints one line and returns its exit code."""
    return run_cli(lambda args: run(build_parser().parse_args(args)), argv)


if __name__ == "__main__":
    sys.exit(main())
