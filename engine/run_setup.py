"""Set-up shared by every launch mode: the run directory, the datasets and their loaders.

The run directory `checkpoints/RUN/` is never reused by accident: a directory that already holds a
run is refused unless the user resumes it (`--resume`) or replaces it (`--overwrite`).
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from config.errors import ConfigError
from config.loader import to_yaml
from config.schema import Config
from engine import distributed as dist
from engine.sampler import GlobalBatchSampler, ShardSampler

RUN_FILES = ("last.pth", "best.pth", "metrics.jsonl", "config.yaml")


def _holds_run(path: Path) -> bool:
    return path.is_dir() and any((path / name).exists() for name in RUN_FILES)


def newest_run_dir(out_dir: Path) -> Path | None:
    """The most recently written run directory under `out_dir` (for `--resume auto` without a name)."""
    runs = [p for p in out_dir.glob("*") if _holds_run(p) and not p.name.startswith("_")]
    return max(runs, key=lambda p: p.stat().st_mtime) if runs else None


def choose_run_dir(cfg: Config, ctx) -> Path:
    """Pick the run directory (created once the run has started); every rank gets the same path."""
    out_dir = Path(cfg.train.out_dir)
    run_dir = None
    if ctx.is_main:
        if cfg.train.run_name:
            run_dir = out_dir / cfg.train.run_name
        elif cfg.train.resume == "auto":
            run_dir = newest_run_dir(out_dir)
        elif cfg.train.resume:
            run_dir = Path(cfg.train.resume).resolve().parent
        if run_dir is None:
            run_dir = out_dir / time.strftime("run-%Y%m%d-%H%M%S")
        if _holds_run(run_dir) and not cfg.train.resume:
            if not cfg.train.overwrite:
                raise ConfigError(
                    f"{run_dir} already holds a run: pass --resume auto to continue it, "
                    f"--overwrite to replace it, or choose another --run-name")
            shutil.rmtree(run_dir)
    return Path(dist.broadcast_object(str(run_dir) if run_dir else None))


def save_resolved_config(cfg: Config, run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / "config.yaml.tmp"
    tmp.write_text(to_yaml(cfg))
    tmp.replace(run_dir / "config.yaml")


def resolve_data(cfg: Config, ctx) -> tuple[str, str]:
    """(train_h5, val_h5): the user's files, or the project's synthetic dataset made once."""
    if cfg.data.train_h5:
        for option, path in (("--train-h5", cfg.data.train_h5), ("--val-h5", cfg.data.val_h5)):
            if path and not Path(path).is_file():
                raise ConfigError(f"{option} {path}: no such file")
        check_split(cfg.data.train_h5, "train")
        return cfg.data.train_h5, cfg.data.val_h5
    from data.synthetic import ensure_synthetic_h5
    if ctx.is_main:
        paths = ensure_synthetic_h5(cfg.data.synthetic_dir)
    dist.barrier()
    if not ctx.is_main:
        paths = ensure_synthetic_h5(cfg.data.synthetic_dir)
    return str(paths[0]), str(paths[1])


def check_split(path: str, expected: str) -> None:
    """A validation file must never feed training."""
    from data.h5format import KeypointH5
    split = KeypointH5(path).split
    if expected == "train" and split == "val":
        raise ConfigError(f"--train-h5 {path}: this file was converted as a validation split "
                          f"(--split val); convert the training split for training")


def train_loader(dataset, cfg: Config, ctx) -> tuple[DataLoader, GlobalBatchSampler]:
    if cfg.train.batch_size % ctx.world_size:
        raise ConfigError(f"option train.batch_size: {cfg.train.batch_size} does not divide over "
                          f"{ctx.world_size} processes (it is the total batch)")
    sampler = GlobalBatchSampler(len(dataset), cfg.train.batch_size, ctx.rank, ctx.world_size,
                                 seed=cfg.train.seed)
    if sampler.batches_per_epoch == 0:
        raise ConfigError(f"option train.batch_size: {cfg.train.batch_size} is larger than the "
                          f"{len(dataset)} training samples")
    if sampler.batches_per_epoch < cfg.train.accumulate:
        raise ConfigError(f"option train.accumulate: {cfg.train.accumulate} batches per step, but an "
                          f"epoch has only {sampler.batches_per_epoch} batches of {cfg.train.batch_size}")
    if cfg.data.workers > 0:
        # Workers are the parallelism. OpenCV threads in them would oversubscribe the cores, and
        # changing OpenCV's thread count inside a forked worker can deadlock on the pool the
        # parent used: so the parent sets it once, before any worker is forked.
        import cv2
        cv2.setNumThreads(1)
    loader = DataLoader(dataset, batch_sampler=sampler, num_workers=cfg.data.workers,
                        pin_memory=cfg.data.pin_memory and ctx.device.type == "cuda",
                        persistent_workers=False)
    return loader, sampler


def val_loader(dataset, cfg: Config, ctx) -> DataLoader:
    per_process = max(1, cfg.train.batch_size // ctx.world_size)
    return DataLoader(dataset, batch_size=per_process,
                      sampler=ShardSampler(len(dataset), ctx.rank, ctx.world_size),
                      num_workers=cfg.data.workers,
                      pin_memory=cfg.data.pin_memory and ctx.device.type == "cuda")


def memory_gb(device: torch.device) -> float:
    """Peak memory of this process: CUDA allocations on GPU, resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 30
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
