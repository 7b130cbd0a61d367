"""Pictures of the decoded people: skeletons in one colour per person, a panel of the maps, and
writing a picture to a file (demo.py, data.preview, the validation pictures)."""
from __future__ import annotations

import colorsys
import contextlib
import os
from pathlib import Path

import cv2
import numpy as np

from config.errors import DataError
from config.skeleton import Skeleton


def person_colours(count: int) -> list[tuple[int, int, int]]:
    """`count` well separated BGR colours (hues spread evenly, full saturation)."""
    colours = []
    for k in range(count):
        r, g, b = colorsys.hsv_to_rgb((k * 0.618034) % 1.0, 0.9, 1.0)
        colours.append((int(b * 255), int(g * 255), int(r * 255)))
    return colours


def draw_people(image_bgr: np.ndarray, keypoints: np.ndarray, skeleton: Skeleton) -> np.ndarray:
    """A copy of the image with each person's main limbs (the redundant ones are not drawn) and
    keypoints ([P, K, 3] of `skeleton`, score 0 = missing)."""
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
    """The summed keypoint and limb maps, keypoints in full, limbs at half strength, clipped to
    [0, 1], in colour over the greyed image."""
    total = np.clip(maps[skeleton.keypoint_channels].sum(0) + 0.5 * maps[skeleton.limb_channels].sum(0),
                    0.0, 1.0)
    heat = cv2.applyColorMap((total * 255).astype(np.uint8), cv2.COLORMAP_JET)
    grey = cv2.cvtColor(cv2.cvtColor(image_bgr, cv2.COLOR_BGR2GRAY), cv2.COLOR_GRAY2BGR)
    return cv2.addWeighted(grey, 0.4, heat, 0.6, 0.0)


def check_picture_path(path, option: str = "--out") -> Path:
    """`path`, or `DataError` naming `option` when its extension is not a format OpenCV writes."""
    path = Path(path)
    if not cv2.haveImageWriter(str(path)):
        raise DataError(f"{option} {path}: {path.suffix or 'no extension'} is not a picture format "
                        "OpenCV writes; end the name with .png or .jpg")
    return path


def write_image(path, picture: np.ndarray, option: str = "--out") -> Path:
    """Write a BGR picture to `path` (its folder made if needed) atomically: a temporary file of the
    same format, renamed, so a reader never sees half a picture. `DataError` naming `option` and the
    path when the extension is not a picture format or the place is not writable."""
    path = check_picture_path(path, option)
    temp = path.with_name(f".{path.stem}.tmp{path.suffix}")    # the extension tells OpenCV the format
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        written = cv2.imwrite(str(temp), picture)
        if written:
            os.replace(temp, path)
    except (cv2.error, OSError) as exc:
        written, reason = False, getattr(exc, "strerror", None) or "OpenCV failed"
    else:
        reason = "the folder is not writable?"
    if not written:
        with contextlib.suppress(OSError):
            temp.unlink()
        raise DataError(f"{option} {path}: cannot write the picture there ({reason})")
    return path
