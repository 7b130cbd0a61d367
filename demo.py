"""Find the people in a picture, or in every picture of a folder, and draw them.

    python demo.py --weights best.pth --image photo.jpg --out photo_pose.png [--heatmaps]
        [--scales 0.5 1 1.5 2 3] [--flip]
    python demo.py --weights best.pth --image photos/ [--out photos_pose/]

Each person's limbs and keypoints are drawn in its own colour; `--heatmaps` adds a side panel of
the summed keypoint and limb maps. Prints one line per person (score, keypoints found) and one per
picture. A folder is read without its subfolders; each picture NAME.EXT is written as
OUT/NAME_pose.png.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import cv2
import numpy as np

from config.errors import DataError, run_cli
from inference.draw import check_picture_path

PICTURE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", required=True, help="checkpoint or bare state dict")
    p.add_argument("--image", required=True,
                   help="picture to read (any format OpenCV reads), or a folder of pictures")
    p.add_argument("--out", help="picture to write (default: IMAGE_pose.png next to the image); for a "
                   "folder, the folder to write into (default: FOLDER_pose next to it)")
    p.add_argument("--heatmaps", action="store_true", help="add a panel of the summed maps")
    p.add_argument("--scales", type=float, nargs="+", help="image heights to run, in units of "
                   "input_size (1: input_size px; default: the config's)")
    p.add_argument("--flip", action=argparse.BooleanOptionalAction, default=None,
                   help="also run the mirror image (default: config)")
    p.add_argument("--preset", help="config preset for a bare state dict (default: imhn512); a "
                   "checkpoint of this trainer carries its own config")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config field, e.g. inference.peak_threshold=0.05")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    return p


def pictures_to_draw(image: str, out: str | None) -> list[tuple[Path, Path]]:
    """(picture to read, picture to write) pairs for `--image` (a file or a folder) and `--out`."""
    source = Path(image)
    if source.is_dir():
        pictures = sorted(p for p in source.iterdir()
                          if p.is_file() and p.suffix.lower() in PICTURE_SUFFIXES)
        if not pictures:
            raise DataError(f"--image {source}: a folder with no pictures "
                            f"({', '.join(PICTURE_SUFFIXES)})")
        folder = Path(out) if out else source.resolve().with_name(source.resolve().name + "_pose")
        if folder.is_file():
            raise DataError(f"--out {folder}: a file; with a folder as --image, --out is a folder")
        return [(p, folder / f"{p.stem}_pose.png") for p in pictures]
    if not source.exists():
        raise DataError(f"--image {source}: no such file or folder")
    target = Path(out) if out else source.with_name(source.stem + "_pose.png")
    if target.is_dir():
        target = target / f"{source.stem}_pose.png"
    return [(source, check_picture_path(target))]     # refused before the model is loaded


def run(args) -> list[Path]:
    from config.schema import DistConfig
    from engine.distributed import init_distributed
    from inference.draw import draw_people, maps_panel, write_image
    from inference.grouping import group_people
    from inference.loading import load_model
    from inference.predict import predict_maps

    pairs = pictures_to_draw(args.image, args.out)
    device = init_distributed(DistConfig(), args.device).device
    model, cfg = load_model(args.weights, args.preset, args.set, device, args.scales, args.flip)
    written = []
    for source, target in pairs:
        image = cv2.imread(str(source), cv2.IMREAD_COLOR)
        if image is None:
            raise DataError(f"{source}: not a picture OpenCV can read (damaged or unknown format)")
        maps = predict_maps(model, image, cfg, device)
        keypoints, scores = group_people(maps, cfg.inference)
        picture = draw_people(image, keypoints)
        if args.heatmaps:
            picture = np.hstack([picture, maps_panel(image, maps)])
        written.append(write_image(target, picture))
        for k, (person, score) in enumerate(zip(keypoints, scores)):
            print(f"person {k}: score {score:.3f}, {int((person[:, 2] > 0).sum())} keypoints")
        print(f"{len(keypoints)} people found in {source}; written to {target}", flush=True)
    return written


def main(argv=None) -> int:
    """The command line: a user error prints one line and returns its exit code."""
    return run_cli(lambda args: run(build_parser().parse_args(args)), argv)


if __name__ == "__main__":
    sys.exit(main())
