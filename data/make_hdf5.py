"""Convert a COCO keypoint split (JSON + image folder) into the project's HDF5 file (docs/data.md)."""
from __future__ import annotations

import contextlib
import io
import json
import re
import sys
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import cv2
import h5py
import numpy as np
import yaml
from PIL import Image
from pycocotools import mask as mask_utils
from tqdm import tqdm

from common.errors import (ArgumentParser, ConfigError, DataError, os_reason, raise_if_stopped,
                           refuse_inapplicable, run_cli)
from common.paths import refuse_clashes, refuse_existing, write_text, written_whole
from data.skeleton import Skeleton, builtin, builtin_names, load_skeleton
from data.coco_checks import read_segment
from data.coco_intake import load_coco
from data.h5format import CROWD_INDEX, FORMAT_MARKER, FORMAT_VERSION, PER_IMAGE, SPLITS, encode_masks

MAIN_MIN_KEYPOINTS = 5
MAIN_MIN_AREA = 32 * 32
MAIN_MIN_DISTANCE = 0.3   # x the person's largest box side
TRAIN_RULES = {   # --keep-all: (why a training picture is left out, which are kept)
    False: ("no main person", f"those with a main person (SPEC's rule: {MAIN_MIN_KEYPOINTS}+ labelled "
            "keypoints, an area of 32x32 px or more, its centre not within 0.3 box sides of an earlier "
            "one's); --keep-all keeps every picture with a labelled person"),
    True: ("no labelled person", "every picture with a labelled person (--keep-all: any person with "
           "a labelled keypoint may be a main person)")}
EVAL_FIELDS = ("id", "image_id", "category_id", "iscrowd", "area", "bbox", "keypoints",
               "num_keypoints", "source_category_id")


# -- images ----------------------------------------------------------------------------------------
def read_image(images_dir: Path, info: dict, ann_path: Path) -> bytes:
    """The bytes of a picture that decodes to the JSON's size; a missing one's error says where from."""
    path = images_dir / info["file_name"]
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"{path}: image {info['id']} listed in {ann_path} is missing"
                        + _where_from(info, images_dir)) from None
    except OSError as exc:
        raise DataError(f"{path}: image {info['id']} cannot be read ({os_reason(exc)})") from None
    if not data:
        raise DataError(f"{path}: image {info['id']} is an empty file (0 bytes)")
    size = probe = None            # the stored pixels' size: EXIF orientation is ignored everywhere
    with contextlib.suppress(OSError, ValueError, Image.DecompressionBombError), warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)   # a large picture is no bomb here
        with Image.open(io.BytesIO(data)) as header:       # reads no pixels
            size = header.height, header.width
    with contextlib.suppress(cv2.error):
        probe = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_IGNORE_ORIENTATION
                             | (cv2.IMREAD_REDUCED_GRAYSCALE_8 if size else cv2.IMREAD_COLOR))
    if probe is None or probe.size == 0:
        raise DataError(f"{path}: image {info['id']} is not a readable image")
    size = size or probe.shape[:2]          # a format Pillow does not read: the decoded picture's
    if size != (info["height"], info["width"]):
        raise DataError(f"{path}: image {info['id']} is {size[1]}x{size[0]} pixels but {ann_path} "
                        f"says {info['width']}x{info['height']}")
    return data


def _where_from(info: dict, images_dir: Path) -> str:
    """Where the JSON says a missing picture comes from, and which --images to try."""
    hints, parts = [], PurePosixPath(info["file_name"].replace("\\", "/")).parts
    if len(parts) > 1 and not (images_dir / parts[0]).exists():
        hints.append(f"its file_name starts with '{parts[0]}/', which --images {images_dir} lacks: "
                     f"give the folder that holds {parts[0]}/")
    if isinstance(url := info.get("coco_url"), str) and url.count("/") > 3:
        hints.append(f"the JSON's coco_url is {url}: --images the folder of COCO's "
                     f"{url.rstrip('/').split('/')[-2]} pictures")
    elif isinstance(info.get("flickr_url"), str):
        hints.append(f"the JSON's flickr_url is {info['flickr_url']}")
    return "".join(f"; {h}" for h in hints)


# -- annotations -> people, masks, samples ---------------------------------------------------------
def main_people(anns: list[dict], keep_all: bool = False) -> list[int]:
    """Indices (into `anns`, all with keypoints) of the main people, by SPEC's rule; `keep_all`:
    without its keypoint count and area, so that every picture with a labelled person has one."""
    centres, out = [], []
    for i, ann in enumerate(anns):
        x, y, w, h = ann["bbox"]
        if not keep_all and (ann["num_keypoints"] < MAIN_MIN_KEYPOINTS or ann["area"] < MAIN_MIN_AREA):
            continue
        centre = np.array([x + w / 2, y + h / 2])
        if any(np.linalg.norm(centre - c) < MAIN_MIN_DISTANCE * max(w, h) for c in centres):
            continue
        centres.append(centre)
        out.append(i)
    return out


def image_record(anns: list[dict], height: int, width: int, skeleton: Skeleton,
                 keep_all: bool = False) -> dict:
    """People with keypoints, boxes, masks and main people (`main_people`) of one image."""
    keyed, ignore, person = [], np.zeros((height, width), np.uint8), np.zeros((height, width), np.uint8)
    crowds = no_keypoints = 0
    for ann in anns:
        crowd = bool(ann.get("iscrowd", 0))
        labelled = 0 if crowd else int((np.asarray(ann["keypoints"][2::3]) > 0).sum())
        region = read_segment(mask_utils.decode, ann.get("segmentation"), height, width)
        if region is None:               # no segmentation: the box
            region = np.zeros((height, width), np.uint8)
            x, y, w, h = ann.get("bbox", (0, 0, 0, 0))
            region[max(int(y), 0):int(np.ceil(y + h)), max(int(x), 0):int(np.ceil(x + w))] = 1
        person |= region
        if labelled:
            keyed.append(dict(ann, num_keypoints=labelled))
            continue
        ignore |= region
        crowds += crowd
        no_keypoints += not crowd
    return {
        "keypoints": np.array([skeleton.from_annotation(a["keypoints"]) for a in keyed],
                              np.float32).reshape(-1, skeleton.num_keypoints, 3),
        "boxes": np.array([a["bbox"] for a in keyed], np.float32).reshape(-1, 4),
        "main": main_people(keyed, keep_all), "ignore": ignore, "person": person,
        "crowds": crowds, "no_keypoints": no_keypoints,
    }


# -- writing ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ConvertSettings:
    """`python -m data.make_hdf5`'s options beside --ann/--images/--out; `side_outputs`: {option: path}."""
    split: str = "train"
    skip_bad: bool = False
    progress: bool = True
    max_images: int = 0                  # the first N images; 0: all
    skeleton: Skeleton | None = None     # None: from the JSON or the built-in of its keypoint count
    overwrite: bool = True
    categories: list | None = None
    links_from: int | None = None
    keep_all: bool = False
    side_outputs: dict | None = None


def convert(ann_path, images_dir, out_path, settings: ConvertSettings = ConvertSettings()) -> dict:
    """Convert one COCO split to HDF5 at `out_path`; returns the summary (counts, what was skipped
    and why, the skeleton). A `DataError` carries the summary so far (`.summary`)."""
    ann_path, images_dir, out_path, split = Path(ann_path), Path(images_dir), Path(out_path), settings.split
    if split not in SPLITS:
        raise DataError(f"--split {split!r}: choose train or val")
    if not images_dir.is_dir():
        raise DataError(f"{images_dir}: " + ("not a folder; --images takes the folder of the images"
                                             if images_dir.exists() else "no such image directory"))
    if out_path.is_dir():
        raise DataError(f"--out {out_path}: a folder; give the path of the HDF5 file to write")
    category, selection, skeleton, origin = load_coco(
        ann_path, images_dir, settings.skip_bad, settings.skeleton, settings.categories, settings.links_from)
    outputs = {"--out": out_path, **(settings.side_outputs or {})}
    refuse_clashes({"--ann": ann_path, "--images": pictures(selection, images_dir)}, outputs)
    images = selection.images[:settings.max_images] if settings.max_images > 0 else selection.images
    for option, path in outputs.items():
        if path:
            refuse_existing(option, path, settings.overwrite)
    summary = {"out": str(out_path), "split": split,        # the counts: once written (`_write`)
               "bad": list(selection.rejected), "skeleton": skeleton, "skeleton_origin": origin,
               "keep_all": settings.keep_all}
    try:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        with written_whole(out_path, settings.overwrite) as tmp_path, h5py.File(tmp_path, "w") as f:
            _write(f, category, images, selection.by_image, ann_path, images_dir, settings, summary)
    except OSError as exc:           # the output side: folder not writable, disk full, ...
        detail = re.search(r"error message = '([^']+)'", str(exc))   # h5py wraps the OS error
        reason = detail.group(1) if detail else os_reason(exc)
        raise DataError(f"--out {out_path}: cannot write the file there ({reason})") from None
    except DataError as exc:
        exc.summary = summary
        raise
    summary["bytes"] = out_path.stat().st_size
    return summary


def _write(f, category, images, by_image, ann_path, images_dir, settings: ConvertSettings, summary):
    split, skeleton = summary["split"], summary["skeleton"]
    f.attrs.update({"format": FORMAT_MARKER, "version": FORMAT_VERSION, "split": split,
                    "categories": json.dumps([category]), "source": str(ann_path),
                    "skeleton": json.dumps(skeleton.to_spec())})
    vbytes, vstr = h5py.vlen_dtype(np.uint8), h5py.string_dtype()
    per_image = [f.create_dataset(name, (len(images),), dtype, maxshape=(None,))
                 for name, dtype in zip(PER_IMAGE, (vbytes, vstr, vstr, vbytes))]
    infos, records = [], []           # of the kept images
    for info in tqdm(images, desc=f"converting {ann_path.name}", unit="img", disable=not settings.progress):
        raise_if_stopped()
        try:
            data = read_image(images_dir, info, ann_path)
        except DataError as exc:
            if not settings.skip_bad:
                raise
            summary["bad"].append({"kind": "bad image", "image_id": info["id"], "reason": str(exc)})
            continue
        anns = by_image[info["id"]]
        record = image_record(anns, info["height"], info["width"], skeleton, summary["keep_all"])
        if split == "train" and not record["main"]:
            kind = TRAIN_RULES[summary["keep_all"]][0]
            summary["bad"].append({"kind": kind, "image_id": info["id"], "reason":
                                   f"image {info['id']} ({info['file_name']}): {kind} (train split)"})
            continue
        values = (np.frombuffer(data, np.uint8), info["file_name"],      # in PER_IMAGE's order
                  json.dumps([{k: a[k] for k in EVAL_FIELDS if k in a} for a in anns]),
                  encode_masks(record.pop("ignore"), record.pop("person")))
        for dataset, value in zip(per_image, values):
            dataset[len(infos)] = value
        infos.append(info)
        records.append(record)
    summary["skipped"] = dict(Counter(item["kind"] for item in summary["bad"]))
    if not infos:
        reasons = ", ".join(f"{count} {reason}" for reason, count in sorted(summary["skipped"].items()))
        raise DataError(f"{ann_path}: no image was kept ({reasons or 'the JSON lists none'}); "
                        "nothing written")
    for dataset in per_image:
        dataset.resize((len(infos),))
    counts = [len(record["keypoints"]) for record in records]
    samples = [(row, p) for row, record in enumerate(records) for p in record["main"]]
    f["images/id"] = np.array([info["id"] for info in infos], np.int64)
    f["images/size"] = np.array([(info["height"], info["width"]) for info in infos], np.int32)
    f["images/people"] = np.stack([np.cumsum([0] + counts[:-1]), counts], 1).astype(np.int64)
    f["samples"] = np.array(samples, np.int64).reshape(-1, 2)
    f["people/keypoints"] = np.concatenate([record["keypoints"] for record in records])
    f["people/box"] = np.concatenate([record["boxes"] for record in records])
    crowd_index = [info.get("crowdIndex", np.nan) for info in infos]
    if not np.isnan(crowd_index).all():      # CrowdPose's per picture, for its easy / medium / hard AP
        f[CROWD_INDEX] = np.array(crowd_index, np.float64)
    summary.update(images=len(infos), samples=len(samples), people=sum(counts),
                   crowd_regions=sum(record["crowds"] for record in records),
                   people_without_keypoints=sum(record["no_keypoints"] for record in records))


def format_summary(summary: dict) -> str:
    """What was converted (stdout): where the skeleton came from, what was completed, the counts."""
    lines = [summary["skeleton_origin"],
             f"wrote {summary['out']} ({summary['split']} split, {summary['bytes'] / 1e6:.1f} MB): "
             f"{summary['images']} images, {summary['samples']} samples, {summary['people']} people "
             f"with keypoints, {summary['crowd_regions']} crowd regions"]
    if summary["people_without_keypoints"]:
        lines.append(f"{summary['people_without_keypoints']} people without a labelled keypoint: "
                     "masked out of the loss like crowds")
    kind, rule = TRAIN_RULES[summary.get("keep_all", False)]
    if summary["split"] == "train":
        lines.append(f"train split: {summary['images']} of "
                     f"{summary['images'] + summary['skipped'].get(kind, 0)} pictures kept, {rule}")
    lines += [f"skipped {count} images: {reason}" if reason != "bad annotation" else
              f"skipped {count} annotations of unknown images"
              for reason, count in sorted(summary["skipped"].items()) if reason != kind]
    return "\n".join(lines)


def pictures(selection, images_dir: Path) -> list[Path]:
    """The pictures a conversion reads: what its outputs must never replace."""
    return [images_dir / info["file_name"] for info in selection.images]


def dump_skeleton(skeleton: Skeleton, path: str, overwrite: bool, said: str) -> None:
    """The skeleton as a YAML file to edit and give back with --skeleton; `said` ends the line saying so."""
    write_text("--dump-skeleton", Path(path), "# The skeleton make_hdf5 used; edit it (limbs, flip pairs, "
               "sigmas) and convert again\n# with --skeleton THIS_FILE. Fields: data/skeleton.py.\n"
               + yaml.safe_dump(skeleton.to_spec(), sort_keys=False, default_flow_style=None, width=100),
               overwrite)
    print(f"wrote {path}{said}")


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="python -m data.make_hdf5", description=__doc__.split("\n")[0])
    parser.add_argument("--ann", help="COCO keypoints JSON")
    parser.add_argument("--images", help="folder of the JSON's images")
    parser.add_argument("--out", help="HDF5 file to write (may be left out with --dump-skeleton)")
    parser.add_argument("--split", choices=SPLITS, help="train (default) keeps images with a main person "
                        "(SPEC's rule); val keeps every image")
    parser.add_argument("--keep-all", action="store_true", help="train split: keep every image with a "
                        "labelled person (any such person may be a main person)")
    parser.add_argument("--skip-bad", action="store_true", help="skip bad images and the images of bad "
                        "annotations, listing each with its reason on stderr")
    parser.add_argument("--skipped", metavar="FILE.json",
                        help="with --skip-bad: also write what was skipped, and why, to this file")
    parser.add_argument("--max-images", type=int, metavar="N",
                        help="only the JSON's first N images (0: all), e.g. for a quick trial")
    parser.add_argument("--skeleton", metavar="NAME|FILE.yaml",
                        help="the keypoints and limbs to learn: a built-in (--list-skeletons) or "
                        "a YAML file (docs/data.md: 'Your own keypoints'); default: from the JSON")
    parser.add_argument("--categories", metavar="NAME_OR_ID,...",
                        help="the categories to convert, as one (they must list the same keypoints); "
                        "default: 'person', else every category that lists keypoints")
    parser.add_argument("--links-from", type=int, choices=(0, 1),
                        help="the category's skeleton links count keypoints from 0 or from 1 "
                        "(default: decided from the links and the data, and said)")
    parser.add_argument("--dump-skeleton", metavar="FILE.yaml", help="write the skeleton used (built-in, "
                        "given or inferred) to edit and pass back with --skeleton")
    parser.add_argument("--list-skeletons", action="store_true", help="print the built-in skeletons")
    parser.add_argument("--overwrite", action="store_true", help="replace existing output files")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def _main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list_skeletons:
        refuse_inapplicable({a.option_strings[0]: getattr(args, a.dest) or None for a in parser._actions
                             if a.dest not in ("help", "list_skeletons")}, "with --list-skeletons",
                            "it lists the built-in skeletons and does nothing else")
        print("\n".join(f"{name:<12} {builtin(name).describe()}" for name in builtin_names()))
        return 0
    given = {"--ann": args.ann, "--images": args.images, "--out": args.out or args.dump_skeleton}
    if missing := [option for option, value in given.items() if not value]:
        raise ConfigError(f"the following arguments are required: {', '.join(missing)} "
                          "(see python -m data.make_hdf5 --help)")
    if (args.max_images or 0) < 0:
        raise DataError(f"option --max-images: {args.max_images} must be >= 0")
    if not args.out:
        refuse_inapplicable({"--split": args.split, "--keep-all": args.keep_all or None, "--max-images":
                             args.max_images, "--skipped": args.skipped, "--quiet": args.quiet or None},
                            "without --out", "nothing is converted; only --dump-skeleton is written")
    if args.split == "val":
        refuse_inapplicable({"--keep-all": args.keep_all or None}, "to --split val", "it keeps every image")
    if args.skipped and not args.skip_bad:
        raise ConfigError("option --skipped lists what --skip-bad skips: give --skip-bad too")
    side_outputs = {"--skipped": args.skipped, "--dump-skeleton": args.dump_skeleton}
    refuse_clashes({"--ann": args.ann, "--skeleton": args.skeleton}, {"--out": args.out, **side_outputs})
    skeleton = load_skeleton(args.skeleton) if args.skeleton else None
    categories = [c.strip() for c in args.categories.split(",") if c.strip()] if args.categories else None
    if not args.out:
        _, selection, skeleton, origin = load_coco(Path(args.ann), Path(args.images), args.skip_bad, skeleton,
                                                   categories, args.links_from)
        refuse_clashes({"--images": pictures(selection, Path(args.images))}, side_outputs)
        refuse_existing("--dump-skeleton", args.dump_skeleton, args.overwrite)
        print(origin)
        dump_skeleton(skeleton, args.dump_skeleton, args.overwrite, " (nothing converted: no --out)")
        return 0
    try:
        summary = convert(args.ann, args.images, args.out, ConvertSettings(
            split=args.split or "train", skip_bad=args.skip_bad, progress=not args.quiet, skeleton=skeleton,
            max_images=args.max_images or 0, overwrite=args.overwrite, categories=categories,
            links_from=args.links_from, keep_all=args.keep_all, side_outputs=side_outputs))
    except DataError as exc:         # what was skipped before the error is still listed
        _report_skipped(getattr(exc, "summary", None), args)
        raise
    _report_skipped(summary, args)
    print(format_summary(summary))
    if args.dump_skeleton:
        dump_skeleton(summary["skeleton"], args.dump_skeleton, args.overwrite,
                      ": the skeleton, to edit and pass back with --skeleton")
    return 0


def _report_skipped(summary: dict | None, args) -> None:
    """Each skipped image or annotation with its reason on stderr; all of them in --skipped (JSON)."""
    if not summary:
        return
    for item in summary.get("bad", []):
        if item["kind"] not in {kind for kind, _ in TRAIN_RULES.values()}:
            print(f"skipped: {item['reason']}", file=sys.stderr)
    if args.skipped:
        write_text("--skipped", args.skipped, json.dumps(summary.get("bad", []), indent=1) + "\n",
                   args.overwrite)


def main(argv=None) -> int:
    return run_cli(_main, argv, kept="the HDF5 file was not written (its partial copy is removed); "
                   "an existing --out is as it was")


if __name__ == "__main__":
    sys.exit(main())
