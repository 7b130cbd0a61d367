"""The scores of a model (or of the ground-truth maps) on an HDF5 split, for evaluate.py and training.
Under torch.distributed each rank decodes every world-th image; rank 0 scores them all."""
from __future__ import annotations

import contextlib
import itertools
import json
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch
from tqdm import tqdm

from common.errors import DataError, os_reason
from common.paths import written_whole
from config.schema import TargetConfig
from config.views import EvalOptions, PredictSettings
from data.h5format import KeypointH5
from data.skeleton import skeleton_words
from data.targets import render_targets
from models.imhn import eval_mode
from runtime.checkpoint import unwrap_model
from runtime.distributed import all_gather_object, any_rank, decided_on_main, get_rank, get_world_size
from inference.coco_eval import coco_keypoint_stats, distance_stats, keypoint_recall, read_results
from inference.estimator import WINDOW, PoseEstimator, grouped_in_pool
from inference.grouping import to_coco_results
from inference.picture_input import MAX_SIDE, shrunk
from inference.predict import as_network


def oracle_maps(h5, img: int, targets: TargetConfig) -> tuple[np.ndarray, float]:
    """(ground-truth maps [C, H, W] of image `img` at the network's size, picture px per map px)."""
    _, person_mask = h5.masks(img)                   # at the image's size (HxW)
    people = h5.people(img)
    person_mask, factor = shrunk(person_mask.astype(np.float32), MAX_SIDE)
    if factor != 1.0:
        people[..., :2] = (people[..., :2] + 0.5) / factor - 0.5
    maps = render_targets(people, *person_mask.shape, 1, targets, h5.skeleton, person_mask=person_mask)
    return maps, factor


def read_ahead(items: Iterable, count: int) -> Iterator:
    """`items` in order, made by a thread up to `count` ahead (its exception raised in its place)."""
    items, finished = iter(items), object()
    pool = ThreadPoolExecutor(1, thread_name_prefix="read_ahead")
    try:
        pending = deque(pool.submit(next, items, finished) for _ in range(max(1, count)))
        while (item := pending.popleft().result()) is not finished:
            pending.append(pool.submit(next, items, finished))
            yield item
    finally:
        pool.shutdown(cancel_futures=True)


def decode_images(model, h5, indices, settings: PredictSettings, device, oracle=False, progress=True,
                  stop=None) -> dict:
    """{image id: COCO results} of the image indices given; `stop()` True: the images so far."""
    until_stopped = itertools.takewhile(lambda _: stop is None or not stop(), indices)
    chosen = tqdm(until_stopped, total=len(indices), desc="evaluate", unit="img", disable=not progress,
                  dynamic_ncols=True)
    skeleton, category_id = h5.skeleton, h5.category_id       # the model's: `evaluate_h5` checks
    if oracle:
        factors: deque = deque()

        def drawn():
            for img in chosen:
                maps, factor = oracle_maps(h5, img, settings.targets)
                factors.append(factor)
                yield maps
        people = grouped_in_pool(drawn(), settings.inference, skeleton, factors)
    else:
        window = WINDOW * settings.inference.batch_size
        pictures = read_ahead((h5.decode_image(img) for img in chosen), window)
        people = PoseEstimator(as_network(model, device), settings).grouped(pictures)  # large: their pixels
    found = {}
    for img, (_, keypoints, scores) in zip(indices, people):     # in the order of `indices`
        image_id = h5.image_info(img)["id"]
        found[image_id] = to_coco_results(image_id, keypoints, scores, skeleton, category_id)
        for result, person in zip(found[image_id], skeleton.to_dataset_order(keypoints)):
            result["keypoint_scores"] = [round(float(v), 4) for v in person[:, 2]]
    return found


def evaluate_h5(model, h5_path, settings: PredictSettings, device, options: EvalOptions = EvalOptions(),
                stop=None) -> dict | None:
    """The stats of `model` (None with `options.oracle`) on `h5_path`, as `options` says. `stop()`
    True on any rank: every rank returns None."""
    oracle, skeleton = options.oracle, options.skeleton
    if model is None and not oracle:
        raise ValueError("evaluate_h5 needs a model unless oracle=True")
    if isinstance(model, torch.nn.Module):
        model = unwrap_model(model)    # DDP's forward would sync buffers: ranks decode unequal counts
    with contextlib.closing(KeypointH5(h5_path)) as h5:
        if skeleton is not None and skeleton != h5.skeleton:
            raise DataError(f"{h5.path}: its people have skeleton {skeleton_words(h5.skeleton, skeleton)} "
                            f"but the model was trained on {skeleton_words(skeleton, h5.skeleton)}")
        scoring = options.scoring or (skeleton or h5.skeleton).scoring
        total = h5.num_images if options.max_images <= 0 else min(options.max_images, h5.num_images)
        rank, world = get_rank(), get_world_size()
        with eval_mode(model):
            found = decode_images(model, h5, range(rank, total, world), settings, device, oracle,
                                  options.progress and rank == 0, stop)
        if stop is not None and any_rank(stop()):
            return None
        gathered = all_gather_object(found)
        return decided_on_main(lambda: _score(gathered, h5, options.results_path, options.overwrite, scoring,
                                              options.recall))


def score_results(results_path, h5_path, max_images: int = 0, scoring=None) -> dict:
    """The stats of a results file on the first `max_images` images of `h5_path` (0: all)."""
    with contextlib.closing(KeypointH5(h5_path)) as h5:
        images = h5.coco_ground_truth()["images"]
        found = read_results(results_path, {img["id"] for img in images}, h5.skeleton.dataset_keypoints)
        total = len(images) if max_images <= 0 else min(max_images, len(images))
        merged = {img["id"]: found.get(img["id"], []) for img in images[:total]}
        return _score([merged], h5, None, True, scoring or h5.skeleton.scoring, False)


def _score(gathered: list[dict], h5, results_path, overwrite: bool, scoring, recall: bool) -> dict:
    """Rank 0: merge the ranks' {image id: results}, write them, score them against the file."""
    merged = {}
    for part in gathered:
        if set(part) & set(merged):
            raise DataError(f"{h5.path}: an image id was decoded twice (duplicate ids in the file?)")
        merged.update(part)
    gt, skeleton = h5.coco_ground_truth(), h5.skeleton
    results = [{k: v for k, v in r.items() if k != "keypoint_scores"}
               for image_id in sorted(merged) for r in merged[image_id]]
    if results_path:
        _write_results(results_path, overwrite, results, merged, gt, skeleton)
    stats, distances = {}, None          # in the order of `scoring.metrics`: the first leads
    for metric in scoring.metrics:
        if metric == "oks":
            stats.update(coco_keypoint_stats(gt, results, list(merged), skeleton.sigmas, scoring))
        else:                            # PCK with PCK_unnormalised, EPE with EPE_found, AUC
            distances = distances or distance_stats(gt, results, skeleton, scoring, image_ids=list(merged))
            stats.update({k: v for k, v in distances.items() if k.split("_")[0].lower() == metric})
    stats["num_images"] = len(merged)
    if recall:
        counts = keypoint_recall(gt, results, skeleton.sigmas, list(merged))
        stats["keypoint_recall"] = {name: list(n) for name, n in zip(skeleton.dataset_keypoints, counts)}
    return stats


def _write_results(path, overwrite: bool, results: list, merged: dict, gt: dict, skeleton) -> None:
    """The COCO results JSON, or per picture JSON lines (a .jsonl `path`), written whole."""
    if Path(path).suffix == ".jsonl":
        files = {img["id"]: img["file_name"] for img in gt["images"]}
        names = skeleton.dataset_keypoints
        text = "".join(json.dumps({"image_id": image_id, "file_name": files.get(image_id), "people": [
            {"score": r["score"], "keypoints": {
                name: [r["keypoints"][3 * k], r["keypoints"][3 * k + 1], r["keypoint_scores"][k]]
                for k, name in enumerate(names) if r["keypoints"][3 * k + 2] > 0}}
            for r in merged[image_id]]}) + "\n" for image_id in sorted(merged))
    else:
        text = json.dumps(results)
    try:
        with written_whole(path, overwrite) as temp:
            temp.write_text(text)
    except OSError as exc:
        raise DataError(f"{path}: cannot write the results there ({os_reason(exc)})") from None


def training_evaluator():
    """The AP part of a training run: `evaluate_h5`, looked up when called (tests replace it)."""
    return lambda *args, **options: evaluate_h5(*args, **options)
