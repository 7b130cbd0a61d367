"""A keypoint dataset the project draws itself, for users with nothing downloaded (and for tests).
DIR/{train,val}.json and DIR/{train,val}/*.jpg: stick figures (or animals seen from above) with occluded
and unlabelled keypoints, cut by the border, small and in crowds, so every mask path is exercised."""
from __future__ import annotations

import fcntl
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path

import cv2
import numpy as np

from common.errors import ArgumentParser, ConfigError, DataError, run_cli
from common.paths import refuse_existing, written_whole
from data.skeleton import builtin

NOSE, L_EYE, R_EYE, L_EAR, R_EAR, L_SHO, R_SHO, L_ELB, R_ELB, L_WRI, R_WRI, L_HIP, R_HIP, \
    L_KNE, R_KNE, L_ANK, R_ANK = range(17)
COCO_SKELETON = [[16, 14], [14, 12], [17, 15], [15, 13], [12, 13], [6, 12], [7, 13], [6, 7],
                 [6, 8], [7, 9], [8, 10], [9, 11], [2, 3], [1, 2], [1, 3], [2, 4], [3, 5],
                 [4, 6], [5, 7]]
# Limbs drawn and joints, a BGR colour per kind; both sides alike (COCO numbers a right joint left + 1)
DRAWN_LIMBS = (((L_SHO, R_SHO), (60, 200, 230)), ((L_HIP, R_HIP), (60, 200, 230))) + tuple(
    ((a + side, b + side), colour) for (a, b), colour in (
        ((L_SHO, L_HIP), (200, 170, 60)), ((L_SHO, L_ELB), (40, 140, 250)), ((L_ELB, L_WRI), (60, 230, 90)),
        ((L_HIP, L_KNE), (230, 80, 200)), ((L_KNE, L_ANK), (250, 230, 70))) for side in (0, 1))
JOINT_COLOUR = {joint + side: colour for joint, colour in (
    (L_SHO, (20, 20, 200)), (L_ELB, (200, 40, 40)), (L_WRI, (30, 120, 30)), (L_HIP, (120, 30, 120)),
    (L_KNE, (20, 90, 160)), (L_ANK, (90, 60, 20))) for side in (0, 1)}
SYNTHETIC_VERSION = 1     # bump when the drawing changes, so caches are redrawn
SKIN, EYE, NOSE_COLOUR, EAR_COLOUR = (150, 185, 235), (40, 30, 30), (40, 40, 220), (60, 120, 200)
ANIMAL = "quadruped"
BODY, HEAD = (70, 90, 140), (60, 110, 170)
ANIMAL_LIMB_COLOURS = {"ear": (40, 200, 230), "tail": (200, 60, 200), "front": (60, 200, 60),
                       "back": (230, 150, 40)}
ANIMAL_JOINT_COLOURS = {"nose": (20, 20, 220), "neck": (240, 240, 240), "tail_base": (20, 20, 20),
                        "tail_tip": (120, 0, 120), "knee": (220, 40, 40), "paw": (30, 120, 30)}


def _pose(rng: np.random.Generator) -> np.ndarray:
    """17 x 2 keypoints of a figure 1 unit tall, mid-hip at the origin, y down, facing us."""
    kp = np.zeros((17, 2))
    neck = np.array([0.0, -0.30])
    for side, sho, elb, wri, hip, kne, ank in ((-1, R_SHO, R_ELB, R_WRI, R_HIP, R_KNE, R_ANK),
                                               (1, L_SHO, L_ELB, L_WRI, L_HIP, L_KNE, L_ANK)):
        kp[sho] = neck + (side * 0.11, 0.01)
        up = math.radians(rng.uniform(-10, 150))                 # 0: hanging, 90: sideways
        fore = up + math.radians(rng.uniform(-20, 110))
        kp[elb] = kp[sho] + 0.16 * np.array([side * math.sin(up), math.cos(up)])
        kp[wri] = kp[elb] + 0.14 * np.array([side * math.sin(fore), math.cos(fore)])
        kp[hip] = (side * 0.07, 0.0)
        thigh = math.radians(rng.uniform(-8, 35))
        shin = thigh + math.radians(rng.uniform(-25, 15))
        kp[kne] = kp[hip] + 0.23 * np.array([side * math.sin(thigh), math.cos(thigh)])
        kp[ank] = kp[kne] + 0.22 * np.array([side * math.sin(shin), math.cos(shin)])
    turn = rng.uniform(-0.02, 0.02)                             # small head turn
    kp[NOSE] = neck + (turn, -0.11)
    kp[R_EYE], kp[L_EYE] = kp[NOSE] + (-0.03 + turn, -0.03), kp[NOSE] + (0.03 + turn, -0.03)
    kp[R_EAR], kp[L_EAR] = kp[NOSE] + (-0.065, -0.015), kp[NOSE] + (0.065, -0.015)
    return kp


def _place(kp: np.ndarray, height: float, angle_deg: float, origin) -> np.ndarray:
    rad = math.radians(angle_deg)
    rot = np.array([[math.cos(rad), -math.sin(rad)], [math.sin(rad), math.cos(rad)]])
    return kp @ rot.T * height + origin


def _draw_figure(canvas: np.ndarray, mask: np.ndarray, kp: np.ndarray, height: float,
                 draw_ears: bool) -> None:
    """Draw a figure into `canvas` (BGR) and its silhouette into `mask` (uint8 0/1)."""
    def pt(i):
        return tuple(int(round(v * 16)) for v in kp[i])       # 4 bits of sub-pixel precision

    def paint(shape, at, size, colour, thickness=-1):       # the picture smooth, the silhouette 1s
        shape(canvas, at, size, colour, thickness, cv2.LINE_AA, shift=4)
        shape(mask, at, size, 1, thickness, cv2.LINE_8, shift=4)
    thick = max(2, int(round(0.06 * height)))
    joint = max(2, int(round(0.035 * height)) * 16)
    for (a, b), colour in DRAWN_LIMBS:
        paint(cv2.line, pt(a), pt(b), colour, thick)
    for k, colour in JOINT_COLOUR.items():
        paint(cv2.circle, pt(k), joint, colour)
    paint(cv2.circle, tuple(int(round(v * 16)) for v in (kp[NOSE] + (0, -0.02 * height))),
          int(round(0.075 * height * 16)), SKIN)
    dot = max(1, int(round(0.018 * height)) * 16)
    for k, colour in ((R_EYE, EYE), (L_EYE, EYE), (NOSE, NOSE_COLOUR)):
        cv2.circle(canvas, pt(k), dot, colour, -1, cv2.LINE_AA, shift=4)
    for k in (R_EAR, L_EAR) if draw_ears else ():
        paint(cv2.circle, pt(k), int(dot * 1.6), EAR_COLOUR)


def _background(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    base = rng.uniform(90, 200, 3)
    tilt = rng.uniform(-30, 30, 3)
    ramp = np.linspace(-0.5, 0.5, height)[:, None, None] * tilt
    image = np.broadcast_to(base + ramp, (height, width, 3)).copy()
    image += rng.normal(0, 3, (height, width, 1))
    return np.clip(image, 0, 255).astype(np.uint8)


def _polygons(mask: np.ndarray) -> list:
    contours, _ = cv2.findContours(mask, cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_SIMPLE)
    return [c.reshape(-1).astype(float).tolist() for c in contours if len(c) >= 3]


def _box(mask: np.ndarray) -> list:
    return [float(v) for v in cv2.boundingRect(mask)]


def draw_image(rng: np.random.Generator, size: int) -> tuple[np.ndarray, list]:
    """One image and its annotations (without ids): people, small unlabelled people, crowds."""
    height = width = size
    image = _background(rng, height, width)
    anns = [_small_person(rng, image, size, crowd=False)                       # no keypoints
            for _ in range(int(rng.integers(0, 3)) if rng.random() < 0.3 else 0)]
    if rng.random() < 0.15:
        anns.append(_small_person(rng, image, size, crowd=True))
    people = []
    for _ in range(int(rng.choice([1, 2, 3], p=[0.4, 0.35, 0.25]))):
        h = rng.uniform(0.42, 0.8) * height
        if rng.random() < 0.15:                                     # cut by the border
            x, y = rng.uniform(-0.1 * h, width + 0.1 * h), rng.uniform(0.2 * h, height - 0.1 * h)
        else:
            x = rng.uniform(0.2 * h, width - 0.2 * h)
            y = rng.uniform(0.5 * h, max(height - 0.45 * h, 0.5 * h))
        kp = _place(_pose(rng), h, rng.uniform(-12, 12), (x, y))
        mask = np.zeros((height, width), np.uint8)
        ears = rng.random() > 0.2
        _draw_figure(image, mask, kp, h, ears)
        vis = np.full(17, 2.0)
        if not ears:
            vis[[L_EAR, R_EAR]] = 0
        people.append((kp, vis, mask))
    for kp, vis, _ in people:                                       # occluding boxes: v = 1
        if rng.random() < 0.3:
            k = int(rng.choice([L_ELB, R_ELB, L_WRI, R_WRI, L_KNE, R_KNE, L_ANK, R_ANK]))
            half = rng.uniform(0.05, 0.1) * size
            x0, y0 = kp[k] - half + rng.uniform(-0.3, 0.3, 2) * half
            x1, y1 = x0 + 2 * half, y0 + 2 * half
            cv2.rectangle(image, (int(x0), int(y0)), (int(x1), int(y1)),
                          tuple(int(c) for c in rng.uniform(40, 110, 3)), -1)
            for other_kp, other_vis, other_mask in people:
                inside = ((other_kp >= (int(x0), int(y0))) & (other_kp <= (int(x1), int(y1)))).all(1)
                other_vis[inside & (other_vis > 0)] = 1
                other_mask[int(max(y0, 0)):int(y1) + 1, int(max(x0, 0)):int(x1) + 1] = 0
    for kp, vis, mask in people:
        _annotate(anns, kp, vis, mask)
    return image, anns


def _annotate(anns: list, kp: np.ndarray, vis: np.ndarray, mask: np.ndarray) -> None:
    """Append a drawn figure's annotation (keypoints outside the image: v = 0) unless none of it is seen."""
    vis[((kp < 0) | (kp > np.array(mask.shape[::-1]) - 1)).any(1)] = 0
    if not mask.any() or not (vis > 0).any():
        return
    keypoints = np.concatenate([np.where(vis[:, None] > 0, kp, 0), vis[:, None]], 1)
    anns.append({"iscrowd": 0, "keypoints": np.round(keypoints, 2).reshape(-1).tolist(),
                 "num_keypoints": int((vis > 0).sum()), "area": float(mask.sum()),
                 "bbox": _box(mask), "segmentation": _polygons(mask)})


def _small_person(rng, image: np.ndarray, size: int, crowd: bool) -> dict:
    """Tiny figures annotated without keypoints: one person, or a crowd region of several."""
    height, width = image.shape[:2]
    mask = np.zeros((height, width), np.uint8)
    count = int(rng.integers(4, 8)) if crowd else 1
    x0, y0 = rng.uniform(0.05, 0.6) * width, rng.uniform(0.05, 0.6) * height
    for _ in range(count):
        h = rng.uniform(0.1, 0.16) * size
        origin = (x0 + rng.uniform(0, 0.3 * width), y0 + 0.35 * h + rng.uniform(0, 0.25 * height))
        kp = _place(_pose(rng), h, rng.uniform(-10, 10), origin)
        _draw_figure(image, mask, kp, h, True)
    if crowd:
        x, y, w, h = cv2.boundingRect(mask)
        mask = np.zeros_like(mask)
        mask[y:y + h, x:x + w] = 1
        flat = mask.T.reshape(-1)        # COCO's uncompressed RLE: column-major runs, zeros first
        counts = np.diff(np.concatenate([[0], np.flatnonzero(flat[1:] != flat[:-1]) + 1, [flat.size]]))
        segmentation = {"size": [height, width], "counts": [0] * int(flat[0]) + counts.tolist()}
    else:
        segmentation = _polygons(mask)
    return {"iscrowd": int(crowd), "keypoints": [0] * 51, "num_keypoints": 0,
            "area": float(mask.sum()), "bbox": _box(mask), "segmentation": segmentation}


def _kind(name: str, table: dict):
    return next(colour for key, colour in table.items() if key in name)


def _animal_pose(rng: np.random.Generator) -> dict:
    """{keypoint name: (x, y)} of an animal 1 unit long, neck above the origin, facing up."""
    pose = {"neck": np.array([0.0, -0.22]), "tail_base": np.array([rng.uniform(-0.03, 0.03), 0.24])}
    pose["nose"] = pose["neck"] + (rng.uniform(-0.05, 0.05), -0.2)
    bend = math.radians(rng.uniform(-50, 50))
    pose["tail_tip"] = pose["tail_base"] + 0.25 * np.array([math.sin(bend), math.cos(bend)])
    for side, sign in (("left", -1), ("right", 1)):
        pose[f"{side}_ear"] = pose["nose"] + (sign * 0.07, 0.07)
        for end, base, forward in (("front", "neck", -1), ("back", "tail_base", 1)):
            out, paw = math.radians(rng.uniform(50, 90)), math.radians(rng.uniform(10, 60))
            knee = pose[base] + 0.15 * np.array([sign * math.sin(out), forward * math.cos(out)])
            pose[f"{side}_{end}_knee"] = knee
            pose[f"{side}_{end}_paw"] = knee + 0.12 * np.array([sign * math.sin(paw),
                                                                 forward * math.cos(paw)])
    return pose


def draw_animals(rng: np.random.Generator, size: int) -> tuple[np.ndarray, list]:
    """One image of 1-3 animals seen from above and their annotations (without ids)."""
    skeleton = builtin(ANIMAL)
    image = _background(rng, size, size)
    height = width = size
    anns = []
    for _ in range(int(rng.choice([1, 2, 3], p=[0.4, 0.35, 0.25]))):
        size = rng.uniform(0.4, 0.75) * height
        angle = rng.uniform(-15, 15)
        centre = rng.uniform(0.25 * size, (width - 0.25 * size, height - 0.25 * size))
        pose = {k: _place(v, size, angle, centre) for k, v in _animal_pose(rng).items()}
        mask = np.zeros((height, width), np.uint8)

        def pt(name):
            return tuple(int(round(v * 16)) for v in pose[name])
        thick = max(2, int(round(0.05 * size)))
        for target, colour in ((image, None), (mask, 1)):
            cv2.line(target, pt("neck"), pt("tail_base"), colour or BODY, 3 * thick, cv2.LINE_AA, 4)
            cv2.circle(target, pt("nose"), int(0.06 * size * 16), colour or HEAD, -1, cv2.LINE_AA, 4)
            for a, b in skeleton.limbs[:skeleton.main_limbs]:
                names = skeleton.keypoints[a], skeleton.keypoints[b]
                limb_colour = _kind(names[1], ANIMAL_LIMB_COLOURS) if names[1] != "nose" else HEAD
                cv2.line(target, pt(names[0]), pt(names[1]), colour or limb_colour, thick, cv2.LINE_AA, 4)
        for name in skeleton.keypoints:
            if "ear" not in name:
                cv2.circle(image, pt(name), max(2, int(0.025 * size)) * 16,
                           _kind(name, ANIMAL_JOINT_COLOURS), -1, cv2.LINE_AA, 4)
        xy = np.array([pose[n] for n in skeleton.dataset_keypoints])
        _annotate(anns, xy, np.full(len(xy), 2.0), mask)
    return image, anns


def _category(skeleton_name: str) -> dict:
    """The COCO category of the drawn figures (1-based skeleton links, as COCO writes them)."""
    if skeleton_name == "coco":
        return {"supercategory": "person", "id": 1, "name": "person",
                "keypoints": list(builtin("coco").dataset_keypoints), "skeleton": COCO_SKELETON}
    skeleton = builtin(ANIMAL)
    order = {name: i + 1 for i, name in enumerate(skeleton.dataset_keypoints)}
    return {"supercategory": "animal", "id": 1, "name": ANIMAL,
            "keypoints": list(skeleton.dataset_keypoints),
            "skeleton": [[order[skeleton.keypoints[a]], order[skeleton.keypoints[b]]]
                         for a, b in skeleton.limbs]}


DRAWINGS = {"coco": draw_image, ANIMAL: draw_animals}      # --skeleton: what is drawn


def write_split(out_dir: Path, split: str, count: int, size: int, seed: int,
                skeleton: str = "coco", overwrite: bool = True) -> Path:
    """Draw `count` images into out_dir/split/ and write out_dir/split.json; returns its path."""
    split_index = {"train": 0, "val": 1}[split]
    rng = np.random.default_rng([seed, split_index])            # different streams per split
    folder = out_dir / split
    folder.mkdir(parents=True, exist_ok=True)
    images, annotations = [], []
    for n in range(count):
        image, anns = DRAWINGS[skeleton](rng, size)
        image_id = split_index * 1_000_000 + n + 1
        name = f"{image_id:012d}.jpg"
        cv2.imwrite(str(folder / name), image, [cv2.IMWRITE_JPEG_QUALITY, 92])
        images.append({"id": image_id, "file_name": name, "width": size, "height": size})
        for ann in anns:
            ann.update(id=split_index * 10_000_000 + len(annotations) + 1, image_id=image_id, category_id=1)
            annotations.append(ann)
    path = out_dir / f"{split}.json"
    with written_whole(path, overwrite) as temp:
        temp.write_text(json.dumps({"info": {"description": "synthetic stick figures (data.synthetic)"},
                                "images": images, "annotations": annotations,
                                    "categories": [_category(skeleton)]}))
    return path


def write_dataset(out_dir, train_images: int = 400, val_images: int = 50, size: int = 192,
                  seed: int = 0, skeleton: str = "coco", overwrite: bool = True) -> dict:
    out_dir = Path(out_dir)
    return {split: write_split(out_dir, split, count, size, seed, skeleton, overwrite)
            for split, count in (("train", train_images), ("val", val_images))}


def ensure_synthetic_h5(cache_dir, train_images: int = 400, val_images: int = 50,
                        size: int = 192, seed: int = 0, skeleton: str = "coco") -> tuple[Path, Path]:
    """(train.h5, val.h5) of the synthetic dataset in `cache_dir`, made once (under a lock)."""
    from data.h5format import KeypointH5
    from data.make_hdf5 import ConvertSettings, convert

    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    settings = {"train_images": train_images, "val_images": val_images, "size": size, "seed": seed,
                "version": SYNTHETIC_VERSION, **({} if skeleton == "coco" else {"skeleton": skeleton})}
    paths = (cache / "train.h5", cache / "val.h5")
    stamp = cache / "settings.json"

    def ready() -> bool:
        try:
            return json.loads(stamp.read_text()) == settings and all(
                KeypointH5(p).open().split == split for p, split in zip(paths, ("train", "val")))
        except (OSError, ValueError, DataError):
            return False

    if ready():
        return paths
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not ready():
            stamp.unlink(missing_ok=True)
            work = Path(tempfile.mkdtemp(prefix="draw-", dir=cache))
            try:
                jsons = write_dataset(work, train_images, val_images, size, seed, skeleton)
                for split, path in zip(("train", "val"), paths):
                    convert(jsons[split], work / split, path, ConvertSettings(split=split, progress=False))
                stamp.write_text(json.dumps(settings))
            finally:
                shutil.rmtree(work, ignore_errors=True)
    return paths


def _main(argv=None) -> int:
    parser = ArgumentParser(prog="python -m data.synthetic", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="folder to write")
    parser.add_argument("--train-images", type=int, default=400)
    parser.add_argument("--val-images", type=int, default=50)
    parser.add_argument("--size", type=int, default=192, help="image side in pixels")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skeleton", default="coco", choices=DRAWINGS,
                        help="what to draw: people (coco, default) or four-legged animals (quadruped)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a dataset already in --out (its JSONs and pictures)")
    args = parser.parse_args(argv)
    if args.size < 64 or args.train_images < 1 or args.val_images < 1:
        raise ConfigError("--size must be >= 64 and the image counts >= 1")
    out_dir = Path(args.out)
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"--out {out_dir}: a file, not a folder; choose a folder for the dataset")
    for split in ("train", "val"):           # nothing of an existing dataset is replaced unasked
        refuse_existing("--out", out_dir / f"{split}.json", args.overwrite)
        folder = out_dir / split
        if not args.overwrite and folder.is_dir() and any(folder.iterdir()):
            raise ConfigError(f"--out {out_dir}: its folder {split}/ already holds files; remove them, "
                              "choose another --out or pass --overwrite to replace the dataset "
                              "(nothing was written)")
    paths = write_dataset(args.out, args.train_images, args.val_images, args.size, args.seed,
                          args.skeleton, args.overwrite)
    print(f"wrote {paths['train']} ({args.train_images} images) and {paths['val']} "
          f"({args.val_images} images)")
    return 0


def main(argv=None) -> int:
    return run_cli(_main, argv, kept="the pictures and JSON files written so far are kept; the "
                   "dataset is incomplete: run the command again with --overwrite")


if __name__ == "__main__":
    sys.exit(main())
