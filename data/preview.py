"""Draw augmented training samples with their targets, so a user can see what the network learns."""
from __future__ import annotations

import sys

import cv2
import numpy as np

from common.errors import ArgumentParser, ConfigError, DataError, run_cli
from config.loader import build_config
from common.paths import refuse_clashes, refuse_existing
from config.views import SampleSettings
from data.picture_files import write_image

PER_ROW = 4                 # samples side by side in the grid


def _heat(image: np.ndarray, heat: np.ndarray, weight: float = 0.6) -> np.ndarray:
    size = image.shape[0]
    heat = cv2.resize(heat, (size, size), interpolation=cv2.INTER_LINEAR)
    coloured = cv2.applyColorMap((np.clip(heat, 0, 1) * 255).astype(np.uint8), cv2.COLORMAP_JET)
    alpha = (np.clip(heat, 0, 1) * weight)[..., None]
    return (image * (1 - alpha) + coloured * alpha).astype(np.uint8)


def sample_panels(sample: dict, skeleton) -> np.ndarray:
    """Two panels side by side (uint8 BGR, 2S x S) for one `sample_arrays` dict of `skeleton`: the input
    with the keypoint maps' max and the main limbs; with the limb maps' max, the ignored (red), the people."""
    image, target, people = sample["image"], sample["target"], sample["people"]
    size = image.shape[0]
    left = _heat(image, target[skeleton.keypoint_max_channel])
    for person in people:
        for a, b in skeleton.limbs[:skeleton.main_limbs]:
            if person[a, 2] > 0 and person[b, 2] > 0:
                cv2.line(left, tuple(int(v) for v in person[a, :2]),
                         tuple(int(v) for v in person[b, :2]), (255, 255, 255), 1, cv2.LINE_AA)
        for x, y, v in person:
            if v > 0:
                cv2.circle(left, (int(x), int(y)), 2, (0, 255, 255) if v > 1 else (255, 0, 255), -1)
    right = _heat(image, target[skeleton.limb_channels].max(axis=0))
    ignore = cv2.resize(1 - sample["mask"], (size, size), interpolation=cv2.INTER_NEAREST) > 0.5
    right[ignore] = (0.5 * right[ignore] + (0, 0, 127)).astype(np.uint8)
    person = cv2.resize(target[skeleton.person_mask_channel], (size, size)) > 0.5
    contours, _ = cv2.findContours(person.astype(np.uint8), cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_SIMPLE)
    cv2.drawContours(right, contours, -1, (0, 255, 0), 1)
    return np.hstack([left, right])


def _main(argv=None) -> int:
    parser = ArgumentParser(prog="python -m data.preview", description=__doc__.split("\n")[0])
    parser.add_argument("--h5", required=True, help="keypoint HDF5 file (data.make_hdf5)")
    parser.add_argument("--out", required=True, help="picture to write (.png or .jpg)")
    parser.add_argument("--n", type=int, default=8, help="number of samples (default 8)")
    parser.add_argument("--config", default="", help="preset name or YAML path, for the input size, "
                        "augmentation and targets (default: the schema's defaults, 512 px as imhn512)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    parser.add_argument("--val", action="store_true", help="no augmentation (validation mode)")
    parser.add_argument("--seed", type=int, default=0, help="picks the samples (default 0)")
    args = parser.parse_args(argv)
    if args.n < 1:
        raise ConfigError(f"option --n: {args.n} must be at least 1")
    refuse_clashes({"--h5": args.h5, "--config": args.config}, {"--out": args.out})
    refuse_existing("--out", args.out, args.overwrite)
    cfg = build_config(args.config or None)
    from data.dataset import KeypointDataset     # torch: once the command line is read
    dataset = KeypointDataset(args.h5, SampleSettings.of(cfg), train=not args.val)
    if len(dataset) == 0:
        raise DataError(f"{args.h5}: holds no samples")
    chosen = np.random.default_rng(args.seed).choice(len(dataset), min(args.n, len(dataset)), replace=False)
    panels = [cv2.putText(sample_panels(dataset.sample_arrays(int(index)), dataset.skeleton), f"#{index}",
                          (4, 14), cv2.FONT_HERSHEY_SIMPLEX, 0.45, (255, 255, 255), 1) for index in chosen]
    while len(panels) % PER_ROW and len(panels) > PER_ROW:      # the last row padded with blanks
        panels.append(np.zeros_like(panels[0]))
    grid = np.vstack([np.hstack(panels[i:i + PER_ROW]) for i in range(0, len(panels), PER_ROW)])
    write_image(args.out, grid, overwrite=args.overwrite)
    print(f"wrote {args.out} ({min(args.n, len(dataset))} samples, {grid.shape[1]}x{grid.shape[0]} px)")
    return 0


def main(argv=None) -> int:
    return run_cli(_main, argv, kept="the preview picture was not written; an existing --out is as it was")


if __name__ == "__main__":
    sys.exit(main())
