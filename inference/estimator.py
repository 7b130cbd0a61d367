"""PoseEstimator: people out of pictures, from a checkpoint of this trainer or an exported ONNX file.

    import cv2
    from inference import PoseEstimator
    estimator = PoseEstimator.from_checkpoint("best.pth", device="cpu")
    people = estimator(cv2.imread("photo.jpg"))          # BGR, as OpenCV reads it
    print([(round(person.score, 3), person.box) for person in people])

Its calls are in docs/evaluation.md; the network runs on windows of pictures batched by padded size,
in a thread, a window ahead of grouping's threads."""
from __future__ import annotations

import functools
import itertools
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np
import torch

from common.errors import CheckpointError, refuse_inapplicable
from config.schema import Config, InferenceConfig
from config.views import PredictSettings
from runtime.distributed import current_context
from inference.grouping import group_people
from inference.loading import load_model, pick_device
from inference.onnx_network import OnnxNetwork
from inference.picture_input import MAX_SIDE, checked_picture, shrunk
from inference.predict import as_network, network_maps, picture_maps

COCO_PICTURE_PIXELS = 640 * 480      # a window holds WINDOW x batch_size of these at most
WINDOW = 4          # batches of pictures a window holds, batched by their padded size


@dataclass(frozen=True)
class Person:
    """One person: `keypoints` float32 [K, 3] (x, y in picture pixels, peak score; 0s if not found),
    `score` (higher is better), `box` (x0, y0, x1, y1) around the found keypoints."""

    keypoints: np.ndarray
    score: float
    box: tuple[float, float, float, float]


@dataclass(frozen=True)
class Prediction:
    """The people of one picture and, with maps=True, its maps float32 [C, H, W] at picture size."""

    people: list[Person]
    maps: np.ndarray | None = None


def decode_threads(cfg: InferenceConfig) -> int:
    """Grouping threads: the config's number, or this process's share of the machine's cores."""
    if cfg.decode_threads > 0:
        return cfg.decode_threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    ctx = current_context()          # the launcher's processes on this machine (torchrun, SLURM, ...)
    return max(1, min(8, cores // (ctx.local_world_size if ctx else 1)))


def grouped_in_pool(maps_stream: Iterable, cfg: InferenceConfig, skeleton, factors: deque | None = None
                    ) -> Iterator[tuple]:
    """(maps, keypoints, scores) of each item (maps, or a call making them), in order, from a pool."""
    threads = decode_threads(cfg)
    pending: deque = deque()

    def group(item) -> tuple:
        maps = item() if callable(item) else item
        return maps, *group_people(maps, cfg, skeleton)

    def oldest() -> tuple:
        maps, keypoints, scores = pending.popleft().result()
        if factors is not None and (factor := factors.popleft()) != 1.0:   # back to the picture's pixels
            found = keypoints[..., 2:] > 0                                      # (missing ones stay 0)
            keypoints[..., :2] = np.where(found, (keypoints[..., :2] + 0.5) * factor - 0.5, 0)
        return maps, keypoints, scores

    with ThreadPoolExecutor(threads, thread_name_prefix="group_people") as pool:
        for item in maps_stream:
            pending.append(pool.submit(group, item))
            while len(pending) > 2 * threads:
                yield oldest()
        while pending:
            yield oldest()


class PoseEstimator:
    """A network (a model of this project, or an `OnnxNetwork`) with the settings it runs at."""

    def __init__(self, network, settings: PredictSettings):
        self.network = as_network(network)
        self.settings = settings
        self.skeleton = self.network.skeleton       # what its channels are (`data.skeleton`)
        self.config: Config | None = None           # the whole config of the file it came from, if any
        self.max_side = MAX_SIDE                    # larger pictures run shrunk to it
        self.window = WINDOW                        # batches of pictures the network takes at once

    @classmethod
    def _loaded(cls, network, config: Config) -> "PoseEstimator":
        estimator = cls(network, PredictSettings.of(config))
        estimator.config = config
        return estimator

    @classmethod
    def from_checkpoint(cls, path, device="auto", preset: str | None = None, sets=(), scales=None,
                        flip: bool | None = None) -> "PoseEstimator":
        """From a checkpoint of this trainer or a bare state dict (`preset` builds it)."""
        if str(path).endswith(".onnx"):
            raise CheckpointError(f"{path} is an ONNX file, not a checkpoint: load it with "
                                  "PoseEstimator.from_onnx (demo.py takes it as --weights too)")
        model, config = load_model(str(path), preset, list(sets), pick_device(device), scales, flip)
        return cls._loaded(model, config)

    @classmethod
    def from_onnx(cls, path, sets=(), scales=None, flip: bool | None = None) -> "PoseEstimator":
        """From a file written by export.py (its config rides in the file), run by onnxruntime."""
        network = OnnxNetwork(path)
        return cls._loaded(network, network.config(list(sets), scales, flip))

    @classmethod
    def from_file(cls, path, device="auto", **options) -> "PoseEstimator":
        """`from_onnx` for a .onnx file, else `from_checkpoint`."""
        if str(path).endswith(".onnx"):
            refuse_inapplicable({"--preset": options.pop("preset", None)}, "to an ONNX --weights",
                                "the file carries its own config (change a setting with --set KEY=VALUE)")
            return cls.from_onnx(path, **options)
        return cls.from_checkpoint(path, device, **options)

    @property
    def device(self) -> torch.device:
        return self.network.device

    def maps(self, pictures_bgr: list[np.ndarray]) -> list[np.ndarray]:
        """The maps [C, H, W] of each picture at the size it runs at (shrunk to `MAX_SIDE`)."""
        return [make() for make in self.network_window(list(self._prepared(pictures_bgr)))]

    def _prepared(self, pictures: Iterable, factors: deque | None = None) -> Iterator[np.ndarray]:
        """Each picture checked, converted and shrunk to `MAX_SIDE` (its factor appended to `factors`)."""
        for k, picture in enumerate(pictures):
            ready, factor = shrunk(checked_picture(picture, f"picture {k}"), self.max_side)
            if factors is not None:
                factors.append(factor)
            yield ready

    def windows(self, pictures: Iterable[np.ndarray], factors: deque | None = None) -> Iterator[list]:
        """The pictures `_prepared`, `window` x `inference.batch_size` at a time (fewer when large)."""
        size = self.window * self.settings.inference.batch_size
        chunk, pixels = [], 0
        for picture in self._prepared(pictures, factors):
            chunk.append(picture)
            pixels += picture.shape[0] * picture.shape[1]
            if len(chunk) == size or pixels >= size * COCO_PICTURE_PIXELS:
                yield chunk
                chunk, pixels = [], 0
        if chunk:
            yield chunk

    def network_window(self, chunk: list[np.ndarray]) -> list:
        """Per picture of a window, a call sampling its maps, of a network run now."""
        flip = self.settings.inference.flip
        return [functools.partial(picture_maps, parts, picture.shape[:2], flip)
                for parts, picture in zip(network_maps(self.network, chunk, self.settings), chunk)]

    def network_stream(self, pictures: Iterable[np.ndarray]) -> Iterator:
        """`network_window` of each window of `pictures`, one picture's call at a time."""
        for chunk in self.windows(pictures):
            yield from self.network_window(chunk)

    def maps_stream(self, pictures: Iterable[np.ndarray]) -> Iterator[np.ndarray]:
        """`maps` of an iterable of pictures, made one by one (`network_stream`)."""
        return (make() for make in self.network_stream(pictures))

    def grouped(self, pictures: Iterable[np.ndarray]) -> Iterator[tuple]:
        """(maps, keypoints [P, K, 3] in picture pixels, scores [P]) of each picture, in order; the
        network runs the next window in its own thread while this one is grouped (two held at most)."""
        factors: deque = deque()
        with ThreadPoolExecutor(1, thread_name_prefix="network") as network:
            futures = (network.submit(self.network_window, chunk)
                       for chunk in self.windows(pictures, factors))
            made = (make for done, _ in itertools.pairwise(itertools.chain(futures, [None]))
                    for make in done.result())
            yield from grouped_in_pool(made, self.settings.inference, self.skeleton, factors)

    def stream(self, pictures: Iterable[np.ndarray], maps: bool = False) -> Iterator:
        """The people of each picture (a `Prediction` with maps=True), in order, as they are found."""
        for its_maps, keypoints, scores in self.grouped(pictures):
            found = [person[person[:, 2] > 0, :2] for person in keypoints]
            people = [Person(person, float(score), tuple(float(v) for v in (*xy.min(0), *xy.max(0))))
                      for person, score, xy in zip(keypoints, scores, found)]
            yield Prediction(people, its_maps) if maps else people

    def __call__(self, pictures, maps: bool = False):
        """People of one BGR uint8 picture [H, W, 3], or per picture of a list."""
        if isinstance(pictures, np.ndarray):
            return next(self.stream([pictures], maps))
        if not hasattr(pictures, "__iter__") or isinstance(pictures, (str, bytes)):
            checked_picture(pictures, "the picture")          # says what it is (None, a path, an int)
        return list(self.stream(pictures, maps))
