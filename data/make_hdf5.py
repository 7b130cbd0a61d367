"""Convert a COCO person-keypoint split (JSON + image folder) into the project's HDF5 file.

    python -m data.make_hdf5 --ann person_keypoints_train2017.json --images train2017 \
        --out coco_train.h5 [--split train|val] [--skip-bad] [--skeleton NAME|FILE.yaml]

The skeleton (`config.skeleton`) is `--skeleton`'s, else the built-in whose keypoints the JSON's
category lists, else one inferred from the category's `keypoints` and `skeleton` links (what was
inferred is printed); it is stored in the file, and everything downstream reads it from there.

Images are stored once as their original encoded bytes; masks as run-length codes; samples follow the
"main person" rule of SPEC. The file is written under a temporary name and renamed at the end.
Layout and reader: `data.h5format`. Bad input raises `DataError` naming the file and the item;
`skip_bad` skips bad images and lists them in the summary instead.
"""
from __future__ import annotations

import json
import re
import struct
import sys
import warnings
from collections import Counter
from pathlib import Path

import cv2
import h5py
import numpy as np
from pycocotools import mask as mask_utils
from tqdm import tqdm

from config.errors import ArgumentParser, DataError, run_cli
from config.paths import refuse_existing, refuse_output_as_input, written_whole
from config.skeleton import Skeleton, infer_from_category, load_skeleton
from data.coco_checks import Selection, select_valid
from data.h5format import FORMAT_MARKER, FORMAT_VERSION, SPLITS, encode_masks

MAIN_MIN_KEYPOINTS = 5
MAIN_MIN_AREA = 32 * 32
MAIN_MIN_DISTANCE = 0.3   # x the person's largest box side
EVAL_FIELDS = ("id", "image_id", "category_id", "iscrowd", "area", "bbox", "keypoints",
               "num_keypoints")


# -- reading the COCO JSON -------------------------------------------------------------------------
def _keypoint_category(data: dict, ann_path: Path) -> dict:
    """The category annotated with keypoints: `person`, else the only one listing keypoints."""
    categories = [c for c in data["categories"] if isinstance(c, dict)]
    persons = [c for c in categories if c.get("name") == "person"]
    if not persons:
        persons = [c for c in categories if c.get("keypoints")]
        if len(persons) != 1:
            raise DataError(f"{ann_path}: no 'person' category among the categories, and "
                            f"{len(persons)} categories list keypoints (one is needed)")
    return persons[0]


def choose_skeleton(category: dict, ann_path: Path, skeleton: Skeleton | None) -> tuple[Skeleton, str]:
    """(the skeleton of the file, a line saying where it came from) or `DataError`."""
    names = category.get("keypoints") or []
    if skeleton is None:
        return infer_from_category(category, str(ann_path))
    if names and tuple(names) != skeleton.dataset_keypoints:
        raise DataError(f"{ann_path}: the {category.get('name')!r} category's keypoints "
                        f"({', '.join(names[:4])}, ...: {len(names)}) are not those of skeleton "
                        f"{skeleton.name} ({', '.join(skeleton.dataset_keypoints[:4])}, ...: "
                        f"{len(skeleton.dataset_keypoints)}), in the same order")
    return skeleton, f"{skeleton.describe()} (given by --skeleton)"


def load_coco(ann_path: Path, images_dir: Path, skip_bad: bool = False,
              skeleton: Skeleton | None = None) -> tuple[dict, Selection, Skeleton, str]:
    """(keypoint category, the images and annotations that pass every check of `data.coco_checks`,
    skeleton, where the skeleton came from) or `DataError`; with `skip_bad` the selection lists
    what was left out; `skeleton` None: the built-in the category names, or one inferred from it."""
    try:
        data = json.loads(Path(ann_path).read_text())
    except FileNotFoundError:
        raise DataError(f"{ann_path}: no such annotation file") from None
    except IsADirectoryError:
        raise DataError(f"{ann_path}: a folder; --ann takes the COCO JSON file") from None
    except OSError as exc:
        raise DataError(f"{ann_path}: cannot be read ({exc.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"{ann_path}: malformed JSON ({exc})") from None
    if not isinstance(data, dict) or not all(k in data for k in ("images", "annotations", "categories")):
        raise DataError(f"{ann_path}: not a COCO annotation file (needs images, annotations, categories)")
    if not isinstance(data["categories"], list):
        raise DataError(f"{ann_path}: 'categories' is a {type(data['categories']).__name__}, not a list")
    category = _keypoint_category(data, ann_path)
    skeleton, origin = choose_skeleton(category, ann_path, skeleton)
    annotations = data["annotations"] if isinstance(data["annotations"], list) else []
    if annotations and not any(isinstance(a, dict) and "area" in a for a in annotations):
        for ann in annotations:          # a layout without areas (CrowdPose's): COCOeval needs them
            _add_box_area(ann)
    selection = select_valid(data, category.get("id"), images_dir, skip_bad, ann_path, DataError,
                             len(skeleton.dataset_keypoints))
    return category, selection, skeleton, origin


def _add_box_area(ann) -> None:
    """`area` = the box's area, for files that give none at all (one missing among others is an
    error of `data.coco_checks`, as is a bad box)."""
    box = ann.get("bbox") if isinstance(ann, dict) else None
    if isinstance(box, list) and len(box) == 4 and all(isinstance(v, (int, float)) for v in box):
        ann["area"] = float(box[2] * box[3])


# -- images ----------------------------------------------------------------------------------------
def header_size(data: bytes) -> tuple[int, int] | None:
    """(height, width) read from a JPEG or PNG header, or None for other formats."""
    if data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) >= 24:
        width, height = struct.unpack(">II", data[16:24])
        return height, width
    if data[:2] != b"\xff\xd8":
        return None
    pos = 2
    while pos + 9 < len(data):
        if data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        if marker == 0xFF:
            pos += 1
            continue
        length = struct.unpack(">H", data[pos + 2:pos + 4])[0]
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            height, width = struct.unpack(">HH", data[pos + 5:pos + 9])
            return height, width
        pos += 2 + length
    return None


def read_image(path: Path, info: dict, ann_path: Path) -> bytes:
    """The encoded bytes of an image after checking it decodes and matches the JSON's size."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"{path}: image {info['id']} listed in {ann_path} is missing") from None
    except OSError as exc:
        raise DataError(f"{path}: image {info['id']} cannot be read ({exc.strerror})") from None
    if not data:
        raise DataError(f"{path}: image {info['id']} is an empty file (0 bytes)")
    buf = np.frombuffer(data, np.uint8)
    size = header_size(data)       # the stored pixels' size: EXIF orientation is ignored everywhere
    try:
        probe = cv2.imdecode(buf, (cv2.IMREAD_REDUCED_GRAYSCALE_8 if size else cv2.IMREAD_COLOR)
                             | cv2.IMREAD_IGNORE_ORIENTATION)
    except cv2.error:
        probe = None
    if probe is None or probe.size == 0:
        raise DataError(f"{path}: image {info['id']} is not a readable image")
    if size is None:
        size = probe.shape[:2]
    if size != (info["height"], info["width"]):
        raise DataError(f"{path}: image {info['id']} is {size[1]}x{size[0]} pixels but {ann_path} "
                        f"says {info['width']}x{info['height']}")
    return data


# -- annotations -> people, masks, samples ---------------------------------------------------------
def region_mask(ann: dict, height: int, width: int) -> np.ndarray:
    """uint8 0/1 mask of an annotation's segmentation (its box when it has none)."""
    with warnings.catch_warnings():      # pycocotools' numpy-2 copy= deprecation, harmless
        warnings.simplefilter("ignore", DeprecationWarning)
        return _region_mask(ann, height, width)


def _region_mask(ann: dict, height: int, width: int) -> np.ndarray:
    seg = ann.get("segmentation")
    if isinstance(seg, list) and seg:
        polys = [p for p in seg if len(p) >= 6]
        if polys:
            rle = mask_utils.merge(mask_utils.frPyObjects(polys, height, width))
            return mask_utils.decode(rle)
    elif isinstance(seg, dict) and "counts" in seg:
        rle = mask_utils.frPyObjects(seg, height, width) if isinstance(seg["counts"], list) else seg
        return mask_utils.decode(rle)
    out = np.zeros((height, width), np.uint8)
    x, y, w, h = ann.get("bbox", (0, 0, 0, 0))
    out[max(int(y), 0):int(np.ceil(y + h)), max(int(x), 0):int(np.ceil(x + w))] = 1
    return out


def main_people(anns: list[dict]) -> list[int]:
    """Indices (into `anns`, all with keypoints) of the main people, by SPEC's rule."""
    centres: list[np.ndarray] = []
    out = []
    for i, ann in enumerate(anns):
        x, y, w, h = ann["bbox"]
        if ann["num_keypoints"] < MAIN_MIN_KEYPOINTS or ann["area"] < MAIN_MIN_AREA:
            continue
        centre = np.array([x + w / 2, y + h / 2])
        if any(np.linalg.norm(centre - c) < MAIN_MIN_DISTANCE * max(w, h) for c in centres):
            continue
        centres.append(centre)
        out.append(i)
    return out


def image_record(anns: list[dict], height: int, width: int, skeleton: Skeleton) -> dict:
    """People with keypoints, boxes, masks and main people of one image."""
    keyed, ignore, person = [], np.zeros((height, width), np.uint8), np.zeros((height, width), np.uint8)
    crowds = no_keypoints = 0
    for ann in anns:
        crowd = bool(ann.get("iscrowd", 0))
        labelled = 0 if crowd else int((np.asarray(ann["keypoints"][2::3]) > 0).sum())
        if labelled:
            keyed.append(dict(ann, num_keypoints=labelled))
            person |= region_mask(ann, height, width)
            continue
        region = region_mask(ann, height, width)
        ignore |= region
        person |= region
        crowds += crowd
        no_keypoints += not crowd
    return {
        "keypoints": np.stack([skeleton.from_annotation(a["keypoints"]) for a in keyed]) if keyed
        else np.zeros((0, skeleton.num_keypoints, 3), np.float32),
        "boxes": np.array([a["bbox"] for a in keyed], np.float32).reshape(-1, 4),
        "main": main_people(keyed), "ignore": ignore, "person": person,
        "crowds": crowds, "no_keypoints": no_keypoints,
    }


# -- writing ---------------------------------------------------------------------------------------
def convert(ann_path, images_dir, out_path, split: str = "train", skip_bad: bool = False,
            progress: bool = True, max_images: int = 0, skeleton: Skeleton | None = None,
            overwrite: bool = True) -> dict:
    """Convert one COCO split (its first `max_images` images; 0: all) to HDF5 at `out_path`;
    returns the summary (counts, skipped images, the skeleton and where it came from).
    `skeleton` None: the built-in the JSON's keypoints name, or one inferred from the JSON.
    `overwrite` False: an existing `out_path` is refused (the command line's default)."""
    ann_path, images_dir, out_path = Path(ann_path), Path(images_dir), Path(out_path)
    if split not in SPLITS:
        raise DataError(f"--split {split!r}: choose train or val")
    if not images_dir.is_dir():
        raise DataError(f"{images_dir}: " + ("not a folder; --images takes the folder of the images"
                                             if images_dir.exists() else "no such image directory"))
    if out_path.is_dir():
        raise DataError(f"--out {out_path}: a folder; give the path of the HDF5 file to write")
    refuse_output_as_input("--out", out_path, {"--ann": ann_path})
    category, selection, skeleton, origin = load_coco(ann_path, images_dir, skip_bad, skeleton)
    images, by_image = selection.images, selection.by_image
    if max_images > 0:
        images = images[:max_images]
    for info in images if out_path.resolve().is_relative_to(images_dir.resolve()) else []:
        refuse_output_as_input("--out", out_path, {"an image of --images": images_dir / info["file_name"]})
    refuse_existing("--out", out_path, overwrite)
    summary = {"out": str(out_path), "split": split, "images": 0, "samples": 0, "people": 0,
               "crowd_regions": 0, "people_without_keypoints": 0, "skipped": Counter(), "bad": [],
               "skeleton": skeleton, "skeleton_origin": origin}
    for kind, message in selection.rejected:
        summary["skipped"][kind] += 1
        summary["bad"].append(message)
    try:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        with written_whole(out_path, overwrite) as tmp_path, h5py.File(tmp_path, "w") as f:
            _write(f, category, images, by_image, skeleton, ann_path, images_dir, split,
                   skip_bad, progress, summary)
    except OSError as exc:           # the output side: folder not writable, disk full, ...
        detail = re.search(r"error message = '([^']+)'", str(exc))   # h5py wraps the OS error
        reason = detail.group(1) if detail else exc.strerror or str(exc)
        raise DataError(f"--out {out_path}: cannot write the file there ({reason})") from None
    summary["skipped"] = dict(summary["skipped"])
    summary["bytes"] = out_path.stat().st_size
    return summary


def _write(f, category, images, by_image, skeleton, ann_path, images_dir, split, skip_bad, progress,
           summary):
    n = len(images)
    f.attrs.update({"format": FORMAT_MARKER, "version": FORMAT_VERSION, "split": split,
                    "categories": json.dumps([category]), "source": str(ann_path),
                    "skeleton": json.dumps(skeleton.to_spec())})
    vbytes, vstr = h5py.vlen_dtype(np.uint8), h5py.string_dtype()
    encoded = f.create_dataset("images/encoded", (n,), vbytes, maxshape=(None,))
    names = f.create_dataset("images/file_name", (n,), vstr, maxshape=(None,))
    texts = f.create_dataset("images/annotations", (n,), vstr, maxshape=(None,))
    masks = f.create_dataset("images/masks", (n,), vbytes, maxshape=(None,))
    ids, sizes, people_index, samples, keypoints, boxes = [], [], [], [], [], []
    people_total = 0
    for info in tqdm(images, desc=f"converting {ann_path.name}", unit="img", disable=not progress):
        path = images_dir / info["file_name"]
        try:
            data = read_image(path, info, ann_path)
        except DataError as exc:
            if not skip_bad:
                raise
            summary["bad"].append(str(exc))
            summary["skipped"]["bad image"] += 1
            continue
        anns = by_image[info["id"]]
        record = image_record(anns, info["height"], info["width"], skeleton)
        if split == "train" and not record["main"]:
            summary["skipped"]["no main person"] += 1
            continue
        row = len(ids)
        encoded[row] = np.frombuffer(data, np.uint8)
        names[row] = info["file_name"]
        texts[row] = json.dumps([{k: a[k] for k in EVAL_FIELDS if k in a} for a in anns])
        masks[row] = encode_masks(record["ignore"], record["person"])
        ids.append(info["id"])
        sizes.append((info["height"], info["width"]))
        count = len(record["keypoints"])
        people_index.append((people_total, count))
        samples.extend((row, p) for p in record["main"])
        keypoints.append(record["keypoints"])
        boxes.append(record["boxes"])
        people_total += count
        summary["crowd_regions"] += record["crowds"]
        summary["people_without_keypoints"] += record["no_keypoints"]
    kept = len(ids)
    if kept == 0:
        reasons = ", ".join(f"{count} {reason}" for reason, count in sorted(summary["skipped"].items()))
        raise DataError(f"{ann_path}: no image was kept ({reasons or 'the JSON lists none'}); "
                        "nothing written")
    for ds in (encoded, names, texts, masks):
        ds.resize((kept,))
    f["images/id"] = np.array(ids, np.int64)
    f["images/size"] = np.array(sizes, np.int32).reshape(-1, 2)
    f["images/people"] = np.array(people_index, np.int64).reshape(-1, 2)
    f["samples"] = np.array(samples, np.int64).reshape(-1, 2)
    f["people/keypoints"] = (np.concatenate(keypoints) if keypoints
                             else np.zeros((0, skeleton.num_keypoints, 3), np.float32))
    f["people/box"] = np.concatenate(boxes) if boxes else np.zeros((0, 4), np.float32)
    summary.update(images=kept, samples=len(samples), people=people_total)


def format_summary(summary: dict) -> str:
    lines = [summary["skeleton_origin"],
             f"wrote {summary['out']} ({summary['split']} split, {summary['bytes'] / 1e6:.1f} MB): "
             f"{summary['images']} images, {summary['samples']} samples, {summary['people']} people "
             f"with keypoints, {summary['people_without_keypoints']} without, "
             f"{summary['crowd_regions']} crowd regions"]
    for reason, count in sorted(summary["skipped"].items()):
        lines.append(f"skipped {count} images: {reason}")
    lines.extend(f"  bad: {message}" for message in summary["bad"])
    return "\n".join(lines)


def _main(argv=None) -> int:
    parser = ArgumentParser(prog="python -m data.make_hdf5", description=__doc__.split("\n")[0])
    parser.add_argument("--ann", required=True, help="COCO person-keypoints JSON")
    parser.add_argument("--images", required=True, help="folder of the JSON's images")
    parser.add_argument("--out", required=True, help="HDF5 file to write")
    parser.add_argument("--split", default="train", choices=SPLITS,
                        help="train keeps images with a main person; val keeps every image")
    parser.add_argument("--skip-bad", action="store_true",
                        help="skip missing, unreadable or mis-sized images and list them")
    parser.add_argument("--max-images", type=int, default=0, metavar="N",
                        help="only the JSON's first N images (0: all), e.g. for a quick trial")
    parser.add_argument("--skeleton", metavar="NAME|FILE.yaml",
                        help="the keypoints and limbs to learn: a built-in (coco, crowdpose, ...) or "
                        "a YAML file (docs/data.md: 'Your own keypoints'); default: from the JSON")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.max_images < 0:
        raise DataError(f"option --max-images: {args.max_images} must be >= 0")
    skeleton = load_skeleton(args.skeleton) if args.skeleton else None
    summary = convert(args.ann, args.images, args.out, args.split, args.skip_bad,
                      progress=not args.quiet, max_images=args.max_images, skeleton=skeleton,
                      overwrite=args.overwrite)
    print(format_summary(summary))
    return 0


def main(argv=None) -> int:
    """The command line: a user error prints one line and returns its exit code."""
    return run_cli(_main, argv, kept="the HDF5 file was not written (its partial copy is removed); "
                   "an existing --out is as it was")


if __name__ == "__main__":
    sys.exit(main())
