"""Videos for demo.py: a file or a camera read frame by frame (`DataError`s name the option; FFmpeg's
own log lines silenced), an annotated video written beside its target, renamed onto it once whole."""
from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Iterator

import cv2
import numpy as np

from common.errors import DataError, raise_if_stopped
from common.paths import written_whole

FOURCC = {".mp4": "mp4v", ".avi": "MJPG"}     # containers and codecs every OpenCV build writes
DEFAULT_FPS = 25.0                              # when the file does not say
os.environ.setdefault("OPENCV_FFMPEG_LOGLEVEL", "-8")    # read when OpenCV first uses FFmpeg


def open_video(path) -> tuple[cv2.VideoCapture, np.ndarray]:
    """(capture, its first frame) of a video file OpenCV reads; DataError naming --video otherwise."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"--video {path}: no such file")
    return _first_frame(cv2.VideoCapture(str(path)),
                        f"--video {path}: not a video OpenCV can read (damaged or unknown format)")


def open_camera(index: int) -> tuple[cv2.VideoCapture, np.ndarray]:
    """(capture, first frame) of camera `index`, after checking that a live window can be shown."""
    display = os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")
    if sys.platform.startswith("linux") and not display:
        raise DataError(f"--camera {index}: no display here to show the live window on (DISPLAY is not "
                        "set); record a video and run --video FILE instead")
    return _first_frame(cv2.VideoCapture(index), f"--camera {index}: no camera there, or it cannot be opened")


def _first_frame(capture: cv2.VideoCapture, problem: str) -> tuple[cv2.VideoCapture, np.ndarray]:
    """(capture, its first frame); DataError `problem`, the capture released, when it gives none."""
    ok, first = capture.read() if capture.isOpened() else (False, None)
    if not ok:
        capture.release()
        raise DataError(problem)
    return capture, first


def frames(capture: cv2.VideoCapture, first: np.ndarray) -> Iterator[np.ndarray]:
    """Every frame of the capture, `first` (already read) included; the capture is released after."""
    try:
        ok, frame = True, first
        while ok:
            yield frame
            raise_if_stopped()              # a stop whose raise a library swallowed
            ok, frame = capture.read()
    finally:
        capture.release()


def frame_rate(capture: cv2.VideoCapture) -> float:
    fps = capture.get(cv2.CAP_PROP_FPS)
    return float(fps) if fps and np.isfinite(fps) and fps > 0 else DEFAULT_FPS


def check_video_out(path) -> Path:
    """`path` if it names a video format this demo writes; DataError naming --out otherwise."""
    path = Path(path)
    if path.suffix.lower() not in FOURCC:
        raise DataError(f"--out {path}: {path.suffix or 'no extension'} is not a video format this demo "
                        f"writes; end the name with {' or '.join(FOURCC)}")
    return path


@contextlib.contextmanager
def video_out(path, fps: float, size: tuple[int, int], overwrite: bool = False):
    """A function writing BGR frames to `path`, which takes its name once it is read back whole."""
    path = check_video_out(path)
    with written_whole(path, overwrite) as temp:
        writer = cv2.VideoWriter(str(temp), cv2.VideoWriter_fourcc(*FOURCC[path.suffix.lower()]), fps, size)
        if not writer.isOpened():
            raise DataError(f"--out {path}: OpenCV cannot write a video there (folder not writable?)")
        written = 0

        def write(frame: np.ndarray) -> None:
            nonlocal written
            writer.write(frame)
            written += 1
        try:
            yield write
        finally:
            writer.release()
        capture, found = cv2.VideoCapture(str(temp)), 0        # the frames OpenCV reads back
        while capture.isOpened() and capture.grab():
            found += 1
        capture.release()
        if found != written:
            raise DataError(f"--out {path}: the video written holds {found} of its {written} frames "
                            "when read back (full disk?); nothing was written")
