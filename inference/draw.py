"""Pictures of the decoded people: skeletons in one colour per person, and a panel of the maps
(demo.py, the validation pictures; `data.picture_files` writes them)."""
from __future__ import annotations

import colorsys

import cv2
import numpy as np

from data.skeleton import Skeleton


def person_colours(count: int) -> list[tuple[int, int, int]]:
    """`count` well separated BGR colours (hues spread evenly, full saturation)."""
    rgb = (colorsys.hsv_to_rgb((k * 0.618034) % 1.0, 0.9, 1.0) for k in range(count))
    return [tuple(int(value * 255) for value in reversed(colour)) for colour in rgb]


def draw_people(image_bgr: np.ndarray, keypoints: np.ndarray, skeleton: Skeleton) -> np.ndarray:
    """A copy of the image with each person's main limbs and keypoints ([P, K, 3], 0 = missing)."""
    out = image_bgr.copy()
    size = min(out.shape[:2])
    thickness = max(2, int(round(size / 200)))
    for person, colour in zip(keypoints, person_colours(len(keypoints))):
        points = [tuple(int(round(v)) for v in kp[:2]) for kp in person]
        for a, b in skeleton.limbs[:skeleton.main_limbs]:
            if person[a, 2] > 0 and person[b, 2] > 0:
                cv2.line(out, points[a], points[b], colour, thickness, cv2.LINE_AA)
        for k, kp in enumerate(person):
            if kp[2] > 0:
                cv2.circle(out, points[k], thickness + 2, colour, -1, cv2.LINE_AA)
                cv2.circle(out, points[k], thickness + 2, (0, 0, 0), 1, cv2.LINE_AA)
    return out


def maps_panel(image_bgr: np.ndarray, maps: np.ndarray, skeleton: Skeleton) -> np.ndarray:
    """The summed keypoint and (half-strength) limb maps in colour over the greyed image."""
    total = np.clip(maps[skeleton.keypoint_channels].sum(0) + 0.5 * maps[skeleton.limb_channels].sum(0),
                    0.0, 1.0)
    heat = cv2.applyColorMap((total * 255).astype(np.uint8), cv2.COLORMAP_JET)
    grey = cv2.cvtColor(cv2.cvtColor(image_bgr, cv2.COLOR_BGR2GRAY), cv2.COLOR_GRAY2BGR)
    return cv2.addWeighted(grey, 0.4, heat, 0.6, 0.0)
