"""Picture files a command reads (demo.py, export.py) or writes (demo.py, data.preview, the validation
pictures): a written name must be a format OpenCV writes, and the file appears whole or not at all."""
from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np

from common.errors import DataError, os_reason
from common.paths import written_whole


def read_picture(path) -> np.ndarray:
    """The BGR picture at `path` as stored (EXIF orientation ignored); `DataError` when unreadable."""
    picture = cv2.imread(str(path), cv2.IMREAD_COLOR | cv2.IMREAD_IGNORE_ORIENTATION)
    if picture is None:
        raise DataError(f"{path}: not a picture OpenCV can read (damaged or unknown format)")
    return picture


def check_picture_path(path, option: str = "--out") -> Path:
    """`path`, or `DataError` naming `option` when its extension is not a format OpenCV writes."""
    path = Path(path)
    if not cv2.haveImageWriter(str(path)):
        raise DataError(f"{option} {path}: {path.suffix or 'no extension'} is not a picture format "
                        "OpenCV writes; end the name with .png or .jpg")
    return path


def write_image(path, picture: np.ndarray, option: str = "--out", overwrite: bool = True) -> Path:
    """Write a BGR picture to `path` atomically; `DataError` naming `option` when it cannot."""
    path = check_picture_path(path, option)
    try:
        with written_whole(path, overwrite, option) as temp:
            written = cv2.imwrite(str(temp), picture)
    except (cv2.error, OSError) as exc:
        written, reason = False, os_reason(exc) if isinstance(exc, OSError) else "OpenCV failed"
    else:
        reason = "the folder is not writable?"
    if not written:
        raise DataError(f"{option} {path}: cannot write the picture there ({reason})")
    return path
