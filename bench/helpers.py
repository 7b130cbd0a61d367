"""What the benchmarks share, and the tests use: their training file, the host-sync counter, synthetic
batches, markdown tables, a quiet trainer, and an entry script's `main` run or only parsed (`run_entry`)."""
from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import torch

from config import build_config
from data.make_hdf5 import ConvertSettings, convert
from data.skeleton import builtin
from engine.cli import single_process_context
from engine.run_trainer import Launch, build_loop

COCO4 = Path(__file__).resolve().parents[1] / "tests" / "data" / "coco4"


def make_bench_h5(work: Path, repeat: int = 1, coco_dir: str | None = None) -> tuple[Path, str]:
    """(HDF5 path, what it holds): coco4 with each image listed `repeat` times, else synthetic."""
    out = work / "bench.h5"
    coco4 = next((Path(found) for found in (coco_dir, os.environ.get("SIMPLEPOSE_COCO4"), COCO4)
                  if found and (Path(found) / "test_coco.json").is_file()), None)
    if coco4 is not None:     # each image listed `repeat` times, each copy a linked picture file
        coco, images_dir = json.loads((coco4 / "test_coco.json").read_text()), work / "bench_images"
        images_dir.mkdir(parents=True, exist_ok=True)
        images, annotations = [], []
        for copy in range(repeat):
            offset = copy * 10 ** 9
            for image in coco["images"]:
                name = f"copy{copy}_{image['file_name']}"
                (images_dir / name).symlink_to((coco4 / image["file_name"]).resolve())
                images.append({**image, "id": image["id"] + offset, "file_name": name})
            annotations += [{**ann, "id": ann["id"] + offset, "image_id": ann["image_id"] + offset}
                            for ann in coco["annotations"]]
        ann = work / "bench.json"
        ann.write_text(json.dumps({**coco, "images": images, "annotations": annotations}))
        convert(ann, images_dir, out, ConvertSettings(split="train", progress=False))
        return out, f"coco4 x{repeat}"
    from data.synthetic import write_split
    ann = write_split(work, "train", 8 * repeat, 640, seed=0)
    convert(ann, work / "train", out, ConvertSettings(split="train", progress=False))
    return out, f"synthetic 640 px x{8 * repeat}"


def markdown_table(head: list, rows) -> str:
    """A markdown table: the column names `head`, then each of `rows` (lists of cells)."""
    lines = [head, ["---"] * len(head), *rows]
    return "\n".join("| " + " | ".join(map(str, cells)) + " |" for cells in lines)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    """Unreferenced tensors collected, and on CUDA the allocator's cached blocks given back."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


READS = ("item", "tolist", "__bool__", "__float__", "__int__", "numpy")
SYNC_WARNING = "called a synchronizing CUDA operation"     # torch's text in sync debug mode "warn"


@dataclass
class HostSyncs:
    """Host reads of tensor values by kind (`item`, `tolist`, ...; on CUDA torch's own: `cuda_sync`)."""
    by_kind: Counter = field(default_factory=Counter)

    @property
    def count(self) -> int:
        return sum(self.by_kind.values())


def optimizer_step_counters(optimizer) -> list:
    """The optimiser's per-parameter step counters that live on the CPU (host tensors in a GPU run)."""
    states = getattr(optimizer, "state", {}).values()
    return [s["step"] for s in states if torch.is_tensor(s.get("step")) and s["step"].device.type == "cpu"]


@contextlib.contextmanager
def count_host_syncs(host_tensors=(), device=None):
    """HostSyncs of the block: the host's waits for the device, reads of `host_tensors` aside."""
    syncs = HostSyncs()
    ignored = {id(t) for t in host_tensors}
    on_gpu = device is not None and torch.device(device).type != "cpu"
    inside = [0]     # a read made by another read (float() through item()) is not counted again

    def counting(name, read):
        def wrapper(self, *args, **kwargs):
            if not inside[0] and id(self) not in ignored and not (on_gpu and self.device.type == "cpu"):
                syncs.by_kind[name] += 1
            inside[0] += 1
            try:
                return read(self, *args, **kwargs)
            finally:
                inside[0] -= 1
        return wrapper

    with contextlib.ExitStack() as patches:
        for name in READS:
            counted = counting(name, getattr(torch.Tensor, name))
            patches.enter_context(mock.patch.object(torch.Tensor, name, counted))
        if on_gpu and torch.device(device).type == "cuda" and torch.cuda.is_available():
            patches.enter_context(_cuda_syncs(syncs, inside))
        yield syncs


@contextlib.contextmanager
def _cuda_syncs(syncs: HostSyncs, inside: list):
    """Each warning of torch's sync debug mode outside a read, counted as `cuda_sync` (not shown)."""
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.filterwarnings("always", message=SYNC_WARNING)
        show = warnings.showwarning

        def counted(message, *args, **kwargs):
            if SYNC_WARNING not in str(message):
                return show(message, *args, **kwargs)
            if not inside[0]:
                syncs.by_kind["cuda_sync"] += 1

        warnings.showwarning = counted
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)


def synthetic_batches(batch: int, cfg, device):
    """An endless repeat of one batch on the device; sparse targets like real heatmaps."""
    s, o = cfg.data.input_size, cfg.data.input_size // cfg.data.stride
    images = torch.rand(batch, 3, s, s, device=device)
    target = torch.rand(batch, builtin("coco").num_channels, o, o, device=device)
    target = target * (target > 0.97)
    mask = torch.ones(batch, 1, o, o, device=device)
    while True:
        yield images, target, mask


def bench_config(preset: str, size: int, batch: int, device: str, h5: str, *sets: str):
    """The config of a benchmark's trainer: no TensorBoard, no DataLoader workers unless `sets` say."""
    return build_config(preset, sets=[f"data.input_size={size}", f"data.train_h5={h5}", "data.workers=0",
                                      f"train.batch_size={batch}", f"train.device={device}",
                                      "train.tensorboard=false", *sets])


def build_quietly(cfg, launch=None):
    """(trainer, parts, device): `build_loop` of `cfg` (default: in one process), start-up unprinted."""
    with contextlib.redirect_stdout(io.StringIO()):
        launch = launch or Launch(single_process_context(cfg.train.device))
        return (*build_loop(cfg, launch), launch.ctx.device)


class _Parsed(BaseException):
    """Raised once an entry script's parser has taken its arguments (past any `except Exception`)."""


def run_entry(main, argv: list[str], check: bool):
    """`main(argv)` of an entry script; under --cpu-check its parser only (nothing runs)."""
    if not check:
        return main(argv)
    parse = argparse.ArgumentParser.parse_args

    def parse_only(self, args=None, namespace=None):
        parse(self, args, namespace)
        raise _Parsed
    try:
        with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_only):
            main(argv)
    except _Parsed:
        return {"parsed": True}
    raise RuntimeError("the entry script ended without parsing its arguments")
