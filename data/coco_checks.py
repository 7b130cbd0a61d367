"""Checks of a COCO keypoint JSON, field by field, before anything is converted: a NaN keypoint, a box of
no size or a file outside `--images` would be trained on silently. Each names the image or annotation;
what published datasets leave out harmlessly is completed as COCO means it, counted (`Selection.repairs`)."""
from __future__ import annotations

import contextlib
import math
import os
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath

import numpy as np
from pycocotools import mask as mask_utils

from common.errors import DataError
from data.h5format import MAX_SIDE

MAX_ID = 2 ** 63 - 1          # ids are stored as int64
KEYPOINT_MARGIN = 0.5         # labelled keypoints may lie this fraction of the image size outside it


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    try:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    except OverflowError:                # an int beyond float's range
        return False


def _id_problem(value, what: str) -> str | None:
    valid = is_int(value) and 0 <= value <= MAX_ID
    return None if valid else f"{what} {value!r} is not an integer from 0 to 2^63-1"


def image_problem(info, images_dir: Path) -> str | None:
    """What is wrong with one entry of `images` (None: nothing)."""
    if not isinstance(info, dict):
        return f"an entry of images is a {type(info).__name__}, not an object"
    if problem := _id_problem(info.get("id"), "image id"):
        return problem
    name = info.get("file_name")
    where = f"image {info['id']}"
    if not isinstance(name, str) or not name:
        return f"{where}: file_name {name!r} is not a file name"
    if (PurePosixPath(name).is_absolute() or PureWindowsPath(name).is_absolute()
            or ".." in PurePosixPath(name.replace("\\", "/")).parts):
        return f"{where}: file_name {name!r} must be a path inside --images (not absolute, no '..')"
    for side in ("width", "height"):
        if not is_int(value := info.get(side)) or not 0 < value <= MAX_SIDE:
            return f"{where}: {side} {value!r} is not a whole number of pixels from 1 to {MAX_SIDE}"
    if not is_number(crowd := info.get("crowdIndex", 0.0)):
        return f"{where}: crowdIndex {crowd!r} is not a number"
    try:                                 # links the user made inside --images are followed
        (images_dir / name).resolve()
    except (RuntimeError, OSError):      # a loop of links: pathlib raises RuntimeError on 3.11
        return f"{where}: file_name {name!r} is a loop of symbolic links under --images {images_dir}"
    return None


def _numbers(value, count: int | None, what: str) -> str | None:
    if not isinstance(value, list) or (count is not None and len(value) != count):
        size = f"{count} " if count is not None else ""
        return f"{what} {_short(value)} is not a list of {size}numbers"
    if all(type(v) in (int, float) for v in value):      # the common case, checked at once
        with np.errstate(over="ignore"), contextlib.suppress(OverflowError):
            if np.isfinite(np.asarray(value, np.float64)).all():
                return None
    bad = next((v for v in value if not is_number(v)), None)
    return f"{what} holds {bad!r}, not a finite number"


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _segmentation_problem(seg, info: dict) -> str | None:
    if seg is None or seg == []:
        return None
    if isinstance(seg, list):
        for poly in seg:
            if problem := _numbers(poly, None, "a segmentation polygon"):
                return problem
            if len(poly) < 6 or len(poly) % 2:
                return f"a segmentation polygon has {len(poly)} values (an even number, at least 6)"
        return None
    if isinstance(seg, dict):
        size, counts = seg.get("size"), seg.get("counts")
        if size != [info["height"], info["width"]]:
            return f"segmentation size {_short(size)} is not the image's [height, width] " \
                   f"[{info['height']}, {info['width']}]"
        if isinstance(counts, list):
            if not all(is_int(c) and c >= 0 for c in counts):
                return "segmentation counts hold a value that is not a non-negative integer"
            if sum(counts) != info["height"] * info["width"]:
                return f"segmentation counts cover {sum(counts)} pixels, not the image's " \
                       f"{info['height'] * info['width']}"
            return None
        if isinstance(counts, str) and counts:
            try:                             # compressed RLE: pycocotools checks it decodes to the size
                mask_utils.decode({"size": size, "counts": counts.encode()})
            except ValueError:
                return "segmentation counts are not a valid compressed RLE of the image's size"
            return None
        return f"segmentation counts {_short(counts)} are neither a list nor an RLE string"
    return f"segmentation {_short(seg)} is neither polygons nor RLE"


def annotation_problem(ann, info: dict, keypoints: int = 17) -> str | None:
    """What is wrong with one person annotation of image `info` (None: nothing)."""
    if not isinstance(ann, dict):
        return f"an entry of annotations is a {type(ann).__name__}, not an object"
    where = f"annotation {ann.get('id')!r} (image {info['id']})"
    problem = _id_problem(ann.get("id"), "id")
    crowd = ann.get("iscrowd", 0)
    if problem is None and crowd not in (0, 1):
        problem = f"iscrowd {crowd!r} is not 0 or 1"
    problem = problem or _numbers(ann.get("bbox"), 4, "bbox")
    if problem is None and not (ann["bbox"][2] > 0 and ann["bbox"][3] > 0):
        problem = f"bbox {ann['bbox']} has no positive width and height"
    if problem is None and _outside(np.cumsum(np.reshape(ann["bbox"], (2, 2)), 0), info).any():
        problem = (f"bbox {ann['bbox']} cannot be [x, y, width, height] of the {info['width']}x"
                   f"{info['height']} image: it lies far outside it ([x1, y1, x2, y2] given?)")
    if problem is None and "area" in ann and not (is_number(ann["area"]) and ann["area"] >= 0):
        problem = f"area {_short(ann.get('area'))} is not a finite number >= 0"
    if problem is None and (not crowd or "keypoints" in ann):
        problem = _keypoints_problem(ann, info, keypoints)
    problem = problem or _segmentation_problem(ann.get("segmentation"), info)
    return f"{where}: {problem}" if problem else None


def _outside(xy: np.ndarray, info: dict) -> np.ndarray:
    """Per point of `xy` [N, 2]: whether it leaves image `info` by more than KEYPOINT_MARGIN of its size
    (a box's corners (x, y), (x + w, y + h): cumsum of [[x, y], [w, h]])."""
    width, height = info["width"], info["height"]
    margin = KEYPOINT_MARGIN * np.array([width, height])
    return ((xy < -margin) | (xy > [width, height] + margin)).any(1)


def _keypoints_problem(ann: dict, info: dict, keypoints: int) -> str | None:
    values = 3 * keypoints
    given = ann.get("keypoints")
    if isinstance(given, list) and len(given) != values:
        triples = f"{len(given) // 3} keypoints" if len(given) % 3 == 0 else "not a multiple of 3"
        return ann.get("field_problem") or (f"keypoints has {len(given)} values ({triples}) but the "
                                            f"category lists {keypoints} keypoints ({values} values)")
    if problem := _numbers(given, values, "keypoints"):
        return problem.replace(f"list of {values} numbers", f"list of {values} numbers ({keypoints} x, y, v)")
    points = np.asarray(ann["keypoints"], np.float64).reshape(keypoints, 3)
    width, height = info["width"], info["height"]
    xy, v = points[:, :2], points[:, 2]
    bad_v = ~np.isin(v, (0, 1, 2))
    outside = (v > 0) & _outside(xy, info)
    if bad_v.any():
        k = int(np.argmax(bad_v))
        return f"keypoint {k} has visibility {ann['keypoints'][3 * k + 2]!r}, not 0, 1 or 2"
    if outside.any():
        k = int(np.argmax(outside))
        return f"keypoint {k} at ({xy[k, 0]:g}, {xy[k, 1]:g}) lies far outside the {width}x{height} image"
    return None


def complete_fields(ann: dict, info: dict, keypoints: int, repairs: Counter) -> None:
    """Fill a checked annotation's missing COCO fields and a wrong `num_keypoints`, counted in `repairs`."""
    if "iscrowd" not in ann:
        ann["iscrowd"] = 0
        repairs["no iscrowd: 0 (not a crowd)"] += 1
    if "area" not in ann:
        area = None
        with contextlib.suppress(ValueError, TypeError, IndexError):
            area = read_segment(mask_utils.area, ann.get("segmentation"), info["height"], info["width"])
        ann["area"] = float(ann["bbox"][2] * ann["bbox"][3] if area is None else area)
        repairs["no area: the segment's area (else the box's)"] += 1
    if not ann.get("segmentation"):
        repairs["no segmentation: the box is the person's region"] += 1
    if ann["id"] == 0:
        repairs["annotation id 0, which pycocotools reads as 'no match': kept; this project's "
                "evaluation numbers the annotations itself"] += 1
    if "keypoints" not in ann:            # a crowd region without: COCOeval reads them
        ann["keypoints"] = [0] * 3 * keypoints
    labelled = sum(1 for v in ann["keypoints"][2::3] if v > 0)
    if "num_keypoints" not in ann:
        repairs["no num_keypoints: counted from the keypoints"] += 1
    elif ann["num_keypoints"] != labelled:
        repairs["num_keypoints disagreed with the labelled keypoints: recounted"] += 1
    ann["num_keypoints"] = labelled


def read_segment(read, seg, height: int, width: int):
    """`read` (pycocotools' `decode` or `area`) of a checked segmentation's RLE; None without one."""
    polys = [p for p in seg if len(p) >= 6] if isinstance(seg, list) else []
    with warnings.catch_warnings():      # pycocotools' numpy-2 copy= deprecation, harmless
        warnings.simplefilter("ignore", DeprecationWarning)
        if polys:
            return read(mask_utils.merge(mask_utils.frPyObjects(polys, height, width)))
        if isinstance(seg, dict) and "counts" in seg:
            return read(mask_utils.frPyObjects(seg, height, width) if isinstance(seg["counts"], list)
                        else dict(seg, counts=seg["counts"].encode()))
    return None


@dataclass
class Selection:
    """The images and person annotations of a COCO JSON that pass every check, and what did not."""
    images: list = field(default_factory=list)
    by_image: dict = field(default_factory=dict)          # image id -> its annotations
    rejected: list = field(default_factory=list)          # {"kind": "bad image"|..., "image_id", "reason"}
    repairs: Counter = field(default_factory=Counter)     # what `complete_fields` did, and how often


def select_valid(data: dict, category_ids: list, images_dir: Path, skip_bad: bool, ann_path: Path,
                 keypoints: int) -> Selection:
    """Each image and annotation of `data` in `category_ids` checked: a problem raises `DataError`, or with
    `skip_bad` drops its image (`rejected`); kept ones get the first category's id, `complete_fields`."""
    out = Selection()
    wanted = set(category_ids)

    def reject(kind: str, message: str, image_id=None) -> None:
        if not skip_bad:
            raise DataError(f"{ann_path}: {message}")
        out.rejected.append({"kind": kind, "image_id": image_id, "reason": message})

    good, by_file = {}, {}
    known = {info["id"] for info in data["images"] if isinstance(info, dict) and is_int(info.get("id"))}
    for info in data["images"]:
        problem = image_problem(info, images_dir)
        if problem is None and info["id"] in good:
            problem = (f"image id {info['id']} appears twice in images ({good[info['id']]['file_name']!r} "
                       f"and {info['file_name']!r}; it would be trained twice)")
        if problem is None:
            spelled = os.path.normpath(info["file_name"].replace("\\", "/"))    # a/./b.jpg is a/b.jpg
            if (first := by_file.setdefault(spelled, info["id"])) != info["id"]:
                problem = (f"image {info['id']}: file_name {info['file_name']!r} is also image {first} "
                           "(one picture listed twice: its people would be split between them)")
                good.pop(first, None)
        if problem is not None:
            reject("bad image", problem, info.get("id") if isinstance(info, dict) and is_int(info.get("id"))
                   else None)
            continue
        good[info["id"]] = info
    by_image: dict = {i: [] for i in good}
    ann_ids, persons = set(), 0
    for ann in data["annotations"]:
        if isinstance(ann, dict) and ann.get("category_id") not in wanted:
            continue
        persons += 1
        raw_id = ann.get("image_id") if isinstance(ann, dict) else None
        image_id = raw_id if is_int(raw_id) else None
        if isinstance(ann, dict) and image_id not in good:
            if image_id not in known:         # an image left out: its annotations with it
                reject("bad annotation", f"annotation {ann.get('id')!r} refers to unknown image {raw_id!r}",
                       image_id)
            continue
        problem = annotation_problem(ann, good.get(image_id), keypoints)
        if problem is None and ann["id"] in ann_ids:
            problem = f"annotation id {ann['id']} appears twice in annotations"
        if problem is not None:
            if good.pop(image_id, None) is not None:
                problem += "; its image is skipped" if skip_bad else ""
            reject("image with a bad annotation", problem, image_id)
            continue
        ann_ids.add(ann["id"])
        if ann["category_id"] != category_ids[0]:     # scored as one, or per category (AP-10K)
            ann["source_category_id"] = ann["category_id"]
        ann["category_id"] = category_ids[0]
        complete_fields(ann, good[image_id], keypoints, out.repairs)
        by_image[image_id].append(ann)
    if data["annotations"] and not persons:
        found = sorted({str(a.get("category_id")) for a in data["annotations"] if isinstance(a, dict)})
        named = ", ".join(str(i) for i in category_ids)
        raise DataError(f"{ann_path}: no annotation has the person category's id {named} "
                    f"(annotations have category ids {', '.join(found[:10])})")
    out.images = list(good.values())      # the JSON's order: each was added as the loop met it
    out.by_image = {i: by_image[i] for i in good}
    return out
