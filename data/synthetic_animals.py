"""Synthetic four-legged animals seen from above (skeleton `quadruped`), for `data.synthetic`: head
up (turned at most 15 degrees, so the left legs are on the image's left), a body, four two-part
legs and a tail, coloured by kind; keypoints outside the image are v = 0, the others v = 2.
"""
from __future__ import annotations

import math

import cv2
import numpy as np

from data.skeleton import builtin

NAME = "quadruped"
BODY, HEAD = (70, 90, 140), (60, 110, 170)
LIMB_COLOURS = {"ear": (40, 200, 230), "tail": (200, 60, 200), "front": (60, 200, 60),
                "back": (230, 150, 40)}
JOINT_COLOURS = {"nose": (20, 20, 220), "neck": (240, 240, 240), "tail_base": (20, 20, 20),
                 "tail_tip": (120, 0, 120),
                 "knee": (220, 40, 40), "paw": (30, 120, 30)}


def _kind(name: str, table: dict):
    return next(colour for key, colour in table.items() if key in name)


def animal_pose(rng: np.random.Generator) -> dict:
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


def draw_animal_image(rng: np.random.Generator, image: np.ndarray) -> list:
    """Draw 1-3 animals into `image` (BGR, changed in place); their annotations (without ids)."""
    skeleton = builtin(NAME)
    height, width = image.shape[:2]
    anns = []
    for _ in range(int(rng.choice([1, 2, 3], p=[0.4, 0.35, 0.25]))):
        size = rng.uniform(0.4, 0.75) * height
        angle = math.radians(rng.uniform(-15, 15))
        rot = np.array([[math.cos(angle), -math.sin(angle)], [math.sin(angle), math.cos(angle)]])
        centre = rng.uniform(0.25 * size, (width - 0.25 * size, height - 0.25 * size))
        pose = {k: rot @ v * size + centre for k, v in animal_pose(rng).items()}
        mask = np.zeros((height, width), np.uint8)

        def pt(name):
            return tuple(int(round(v * 16)) for v in pose[name])
        thick = max(2, int(round(0.05 * size)))
        for target, colour in ((image, None), (mask, 1)):
            cv2.line(target, pt("neck"), pt("tail_base"), colour or BODY, 3 * thick, cv2.LINE_AA, 4)
            cv2.circle(target, pt("nose"), int(0.06 * size * 16), colour or HEAD, -1, cv2.LINE_AA, 4)
            for a, b in skeleton.limbs[:skeleton.main_limbs]:
                names = skeleton.keypoints[a], skeleton.keypoints[b]
                limb_colour = _kind(names[1], LIMB_COLOURS) if names[1] != "nose" else HEAD
                cv2.line(target, pt(names[0]), pt(names[1]), colour or limb_colour, thick,
                         cv2.LINE_AA, 4)
        for name in skeleton.keypoints:
            if "ear" not in name:
                cv2.circle(image, pt(name), max(2, int(0.025 * size)) * 16,
                           _kind(name, JOINT_COLOURS), -1, cv2.LINE_AA, 4)
        xy = np.array([pose[n] for n in skeleton.dataset_keypoints])
        inside = (xy[:, 0] >= 0) & (xy[:, 1] >= 0) & (xy[:, 0] <= width - 1) & (xy[:, 1] <= height - 1)
        ys, xs = np.nonzero(mask)
        if not inside.any() or xs.size == 0:
            continue
        keypoints = np.concatenate([np.where(inside[:, None], xy, 0), 2.0 * inside[:, None]], 1)
        box = [float(xs.min()), float(ys.min()), float(np.ptp(xs) + 1), float(np.ptp(ys) + 1)]
        anns.append({"iscrowd": 0, "keypoints": np.round(keypoints, 2).reshape(-1).tolist(),
                     "num_keypoints": int(inside.sum()), "area": float(mask.sum()), "bbox": box,
                     "segmentation": [c.reshape(-1).astype(float).tolist() for c in cv2.findContours(
                         mask, cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_SIMPLE)[0] if len(c) >= 3]})
    return anns


def category() -> dict:
    """The COCO category of the drawn animals (1-based skeleton links, as COCO writes them)."""
    skeleton = builtin(NAME)
    order = {name: i + 1 for i, name in enumerate(skeleton.dataset_keypoints)}
    return {"supercategory": "animal", "id": 1, "name": NAME,
            "keypoints": list(skeleton.dataset_keypoints),
            "skeleton": [[order[skeleton.keypoints[a]], order[skeleton.keypoints[b]]]
                         for a, b in skeleton.limbs]}
