"""The keypoint HDF5 file, one split of a COCO-format keypoint set written by `data.make_hdf5`, and
`KeypointH5`, its lazy reader (the h5py handle opens on first use in each process, never pickled):
    attrs: format, version, split, categories (JSON), source, skeleton (JSON; absent: COCO)
    images/encoded      vlen uint8   the original encoded file bytes (JPEG/PNG)
    images/id, file_name, size       int64; vlen str; int32 [N,2] (height, width)
    images/people       int64 [N,2]  (first row in people/*, count): people with keypoints
    images/annotations  vlen str     JSON list of the image's COCO annotations (no segmentation)
    images/masks        vlen uint8   run-length codes of the ignore and person masks (`encode_masks`)
    people/keypoints    float32 [P,K,3]   x, y, v in image pixels, the skeleton's keypoint order
    people/box          float32 [P,4]     COCO bbox x, y, w, h
    samples             int64 [S,2]  (image index, person index within the image)"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import cv2
import h5py
import numpy as np

from common.errors import ConfigError, DataError
from data.skeleton import Skeleton, builtin

FORMAT_MARKER = "simplepose-keypoints"
FORMAT_VERSION = 1
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
SPLITS = ("train", "val")


def encode_masks(ignore: np.ndarray, person: np.ndarray) -> np.ndarray:
    """Stored form of an image's two 0/1 masks: row-major runs of (ignore + 2 x person) as n
    little-endian uint16 lengths (<= 65535) then n uint8 values; empty when both masks are."""
    codes = (ignore > 0).astype(np.uint8) | ((person > 0).astype(np.uint8) << 1)
    flat = codes.reshape(-1)
    if not flat.any():
        return np.zeros(0, np.uint8)
    starts = np.concatenate([[0], np.flatnonzero(flat[1:] != flat[:-1]) + 1])
    lengths = np.diff(np.append(starts, flat.size))
    pieces = -(-lengths // 65535)                       # runs split into <= 65535 pixels
    values = np.repeat(flat[starts], pieces)
    split = np.full(pieces.sum(), 65535, np.int64)
    split[np.cumsum(pieces) - 1] = lengths - (pieces - 1) * 65535      # each run's last piece
    return np.concatenate([split.astype("<u2").view(np.uint8), values])


# code (ignore + 2 x person) -> 4 bytes: 255 where ignore, 255 where person, 0, 0
_CODE_PLANES = np.array([0, 0xFF, 0xFF00, 0xFFFF], "<u4")


def decode_mask_planes(runs: np.ndarray, height: int, width: int) -> np.ndarray | None:
    """The masks of `encode_masks` bytes as one uint8 HxWx4 image (255: ignored, person, then 0s)
    for `data.augment.warp_masks`; None when both are empty."""
    if runs.size == 0:
        return None
    n = runs.size // 3
    if runs.size % 3 or (n and runs[2 * n:].max() > 3):
        raise DataError(f"{runs.size} bytes of mask runs do not form (length, value) pairs")
    values = np.repeat(_CODE_PLANES[runs[2 * n:]], runs[:2 * n].view("<u2"))
    if values.size != height * width:
        raise DataError(f"mask runs cover {values.size} pixels, expected {height}x{width}")
    return values.view(np.uint8).reshape(height, width, 4)


def open_checked(path: Path) -> h5py.File:
    """Open a keypoint HDF5 file read-only, or raise `DataError` saying what is wrong with it."""
    if not path.is_file():
        raise DataError(f"{path}: no such dataset file (make one with python -m data.make_hdf5)")
    with open(path, "rb") as fh:
        if fh.read(8) != HDF5_SIGNATURE:
            raise DataError(f"{path}: not an HDF5 file (make one with python -m data.make_hdf5)")
    try:
        handle = h5py.File(path, "r")
    except OSError as exc:
        raise DataError(f"{path}: truncated or damaged HDF5 file ({str(exc).splitlines()[0]}); "
                        "convert it again with python -m data.make_hdf5") from None
    version = handle.attrs.get("version", 0)
    problem = None
    if _text(handle.attrs.get("format")) != FORMAT_MARKER:
        problem = DataError(f"{path}: an HDF5 file but not a keypoint dataset of this project "
                            "(convert COCO files with python -m data.make_hdf5)")
    elif not isinstance(version, (int, np.integer)) or isinstance(version, bool):
        problem = _damaged_file(path, f"keypoint dataset (format version {version!r} is not a number)")
    elif version != FORMAT_VERSION:
        age = "an older" if version < FORMAT_VERSION else "a newer"
        problem = DataError(f"{path}: written in {age} format version ({version}; this code reads "
                            f"version {FORMAT_VERSION}): convert it again with python -m data.make_hdf5")
    if problem:
        handle.close()
        raise problem
    return handle


def _damaged_file(path, what: str) -> DataError:
    return DataError(f"{path}: damaged {what}; convert it again with python -m data.make_hdf5")


class KeypointH5:
    """Read access to one keypoint HDF5 file; cheap to pickle, opens itself in each process."""

    def __init__(self, path):
        self.path = Path(path)
        self._handle: h5py.File | None = None
        self._pid: int | None = None
        self._meta: dict | None = None
        self._datasets: dict = {}

    # -- opening --------------------------------------------------------------------------------
    def __getstate__(self) -> dict:
        # the metadata is re-read in the new process (small, and fast to read)
        return {**self.__dict__, "_handle": None, "_pid": None, "_datasets": {}, "_meta": None}

    def _file(self) -> h5py.File:
        if self._handle is None or self._pid != os.getpid():
            # A handle inherited through fork is dropped, not closed: it belongs to the parent.
            self._handle = open_checked(self.path)
            self._pid = os.getpid()
            self._datasets = {}
        return self._handle

    def _dataset(self, name: str) -> h5py.Dataset:
        """A dataset of the file, looked up once per handle (h5py lookups cost ~0.1 ms)."""
        handle = self._file()
        found = self._datasets.get(name)
        if found is None:
            try:
                found = self._datasets[name] = handle[name]
            except KeyError:
                raise _damaged_file(self.path, f"keypoint dataset (no {name!r})") from None
        return found

    def _load_meta(self) -> dict:
        if self._meta is None:
            f = self._file()
            try:
                self._meta = {"split": _text(f.attrs["split"]),
                              "categories": json.loads(_text(f.attrs["categories"])),
                              **{name: f[name][:] for name in TABLES}, "skeleton": self._read_skeleton(f),
                              CROWD_INDEX: f[CROWD_INDEX][:] if CROWD_INDEX in f else None}
            except (KeyError, OSError, ValueError, TypeError, UnicodeDecodeError) as exc:
                raise _damaged_file(self.path, f"keypoint dataset ({exc})") from None
            if problem := _meta_problem(self._meta, {name: len(f[name]) for name in PER_IMAGE}):
                self._meta = None
                raise _damaged_file(self.path, f"keypoint dataset ({problem})")
        return self._meta

    def _read_skeleton(self, f: h5py.File) -> Skeleton:
        text = f.attrs.get("skeleton")
        if text is None:
            return builtin("coco")        # written before skeletons were stored: COCO persons
        try:
            return Skeleton.from_spec(json.loads(_text(text)), f"{self.path} (its stored skeleton)")
        except (ValueError, ConfigError) as exc:
            raise _damaged_file(self.path, f"stored skeleton ({exc})") from None

    def open(self) -> "KeypointH5":
        """Open and check the file now (raises `DataError`); returns self."""
        self._load_meta()
        return self

    def close(self) -> None:
        if self._handle is not None and self._pid == os.getpid():
            self._handle.close()
        self._handle = None
        self._datasets = {}

    # -- summary --------------------------------------------------------------------------------
    @property
    def split(self) -> str:
        return self._load_meta()["split"]

    @property
    def skeleton(self) -> Skeleton:
        """The skeleton of the file's people (COCO for files written before it was stored)."""
        return self._load_meta()["skeleton"]

    @property
    def category_id(self) -> int:
        """The id of the annotated category (its results must carry it)."""
        return int(self._load_meta()["categories"][0].get("id", 1))

    @property
    def num_images(self) -> int:
        return len(self._load_meta()["images/id"])

    @property
    def num_samples(self) -> int:
        return len(self._load_meta()["samples"])

    @property
    def max_people(self) -> int:
        """The most people with keypoints in one image of the file (it holds one image or more)."""
        return int(self._load_meta()["images/people"][:, 1].max())

    def sample_ref(self, i: int) -> tuple[int, int]:
        """(image index, person index within `people(image)`) of sample `i`."""
        return tuple(int(v) for v in self._load_meta()["samples"][i])

    # -- per image ------------------------------------------------------------------------------
    def image_info(self, img: int, file_name=None) -> dict:
        """Image `img`'s COCO record (`file_name`: its stored name, when already read)."""
        height, width = self.image_size(img)
        name = self._dataset("images/file_name")[img] if file_name is None else file_name
        crowd = self._load_meta()[CROWD_INDEX]
        return {"id": int(self._load_meta()["images/id"][img]), "file_name": _text(name),
                "width": width, "height": height,
                **({} if crowd is None or np.isnan(crowd[img]) else {"crowdIndex": float(crowd[img])})}

    def image_size(self, img: int) -> tuple[int, int]:
        """(height, width) of image `img`."""
        return tuple(int(v) for v in self._load_meta()["images/size"][img])

    def encoded_image(self, img: int) -> np.ndarray:
        return self._dataset("images/encoded")[img]

    def decode_image(self, img: int, reduce: int = 1) -> np.ndarray:
        """uint8 HxWx3 BGR pixels; `reduce` in (1, 2, 4, 8) decodes at 1/reduce size (faster)."""
        flags = {1: cv2.IMREAD_COLOR, 2: cv2.IMREAD_REDUCED_COLOR_2,
                 4: cv2.IMREAD_REDUCED_COLOR_4, 8: cv2.IMREAD_REDUCED_COLOR_8}[reduce]
        image = None       # the stored pixels as they are: EXIF orientation is ignored, as in make_hdf5
        with contextlib.suppress(cv2.error):
            image = cv2.imdecode(self.encoded_image(img), flags | cv2.IMREAD_IGNORE_ORIENTATION)
        if image is None:
            raise DataError(f"{self.path}: image {img} ({self.image_info(img)['file_name']}) "
                            "cannot be decoded")
        if reduce == 1 and image.shape[:2] != self.image_size(img):
            raise DataError(f"{self.path}: image {img} ({self.image_info(img)['file_name']}) decodes to "
                            f"{image.shape[1]}x{image.shape[0]} pixels but the file says "
                            f"{self.image_size(img)[1]}x{self.image_size(img)[0]}; convert it again")
        return image

    @contextlib.contextmanager
    def _damaged(self, img: int, what: str):
        """Any problem reading `what` of image `img` becomes one DataError naming the file."""
        try:
            yield
        except (DataError, ValueError, UnicodeDecodeError) as exc:
            raise _damaged_file(f"{self.path}: image {img}", f"{what} ({exc})") from None

    def masks(self, img: int) -> tuple[np.ndarray, np.ndarray]:
        """(ignore, person) uint8 HxW masks: ignore 1 = do not supervise; person 1 = any person."""
        planes = self.mask_planes(img)
        if planes is None:
            return tuple(np.zeros(self.image_size(img), np.uint8) for _ in range(2))
        return planes[:, :, 0] & 1, planes[:, :, 1] & 1

    def mask_planes(self, img: int) -> np.ndarray | None:
        """`decode_mask_planes` of image `img`: HxWx4 uint8 (ignore, person as 0/255), or None."""
        height, width = self.image_size(img)
        with self._damaged(img, "masks"):
            return decode_mask_planes(self._dataset("images/masks")[img], height, width)

    def people(self, img: int) -> np.ndarray:
        """float32 [P,K,3]: (x, y, v) per skeleton keypoint of the image's people with keypoints."""
        return self._people_rows(img, "people/keypoints")

    def person_boxes(self, img: int) -> np.ndarray:
        """float32 [P,4] COCO boxes (x, y, w, h) of the people of `people(img)`."""
        return self._people_rows(img, "people/box")

    def _people_rows(self, img: int, table: str) -> np.ndarray:
        start, count = self._load_meta()["images/people"][img]
        return self._load_meta()[table][start:start + count].copy()

    def annotations(self, img: int, text=None) -> list[dict]:
        """The image's COCO annotations (crowds too), no segmentation; `text`: their JSON if already read."""
        with self._damaged(img, "annotations"):
            return json.loads(_text(self._dataset("images/annotations")[img] if text is None else text))

    def coco_ground_truth(self) -> dict:
        """A COCO-format dataset dict of this file, for pycocotools' `COCO` / `COCOeval`."""
        names = self._dataset("images/file_name")[:]       # each column read once, not per image
        texts = self._dataset("images/annotations")[:]
        images = range(self.num_images)
        return {"images": [self.image_info(img, names[img]) for img in images],
                "annotations": [ann for img in images for ann in self.annotations(img, texts[img])],
                "categories": self._load_meta()["categories"]}


PER_IMAGE = ("images/encoded", "images/file_name", "images/annotations", "images/masks")
TABLES = ("images/id", "images/size", "images/people", "samples", "people/keypoints", "people/box")
MAX_SIDE = 65535              # the largest JPEG side
CROWD_INDEX = "images/crowd_index"      # optional: CrowdPose's crowdIndex per picture (NaN: none)


def _meta_problem(meta: dict, per_image: dict) -> str | None:
    """What makes the stored tables inconsistent (shapes, sizes, indices), or None."""
    ids, sizes, people, samples, keypoints, boxes = (meta[name] for name in TABLES)
    n, p = len(ids), len(keypoints)
    if n == 0:
        return "it holds no images (an empty conversion scores AP 0)"
    if meta["split"] not in SPLITS:
        return f"split {meta['split']!r} is not train or val"
    if not isinstance(meta["categories"], list):
        return "categories is not a JSON list"
    shapes = (n,), (n, 2), (n, 2), (len(samples), 2), (p, meta["skeleton"].num_keypoints, 3), (p, 4)
    for name, expected in zip(TABLES, shapes):
        if meta[name].shape != expected:
            return f"{name} has shape {meta[name].shape}, expected {expected}"
    for name, length in dict(per_image, **{CROWD_INDEX: len(meta[CROWD_INDEX])}
                             if meta[CROWD_INDEX] is not None else {}).items():
        if length != n:
            return f"{name} has {length} entries for {n} images"
    for name in TABLES[:4]:
        if not np.issubdtype(meta[name].dtype, np.integer):
            return f"{name} holds {meta[name].dtype}, not integers"
    if sizes.min() < 1 or sizes.max() > MAX_SIDE:
        return f"an image size is outside 1..{MAX_SIDE} pixels"
    if people.min() < 0 or (people[:, 0] + people[:, 1]).max() > p:
        return f"images/people points outside the {p} stored people"
    if len(samples) and (samples.min() < 0 or samples[:, 0].max() >= n
                         or (samples[:, 1] >= people[samples[:, 0], 1]).any()):
        return "samples refer to images or people that are not stored"
    if not (np.isfinite(keypoints).all() and np.isfinite(boxes).all()):
        return "people/keypoints or people/box hold non-finite values"
    return None


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def check_split(h5: KeypointH5, expected: str, option: str = "") -> None:
    """Raise `DataError` (naming `option`) unless the file holds split `expected`."""
    if h5.split != expected:
        raise DataError(f"{option + ' ' if option else ''}{h5.path}: holds the {h5.split!r} split, but "
                        f"{expected!r} is needed here (a {h5.split} file never feeds "
                        f"{'training' if expected == 'train' else expected}); convert the {expected} "
                        f"split with --split {expected}")
