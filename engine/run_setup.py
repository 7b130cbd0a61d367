"""Set-up shared by every launch mode: the run directory, the datasets and their loaders.

The run directory `checkpoints/RUN/` is never reused by accident: a directory that already holds a
run is refused unless the user resumes it (`--resume`) or replaces it (`--overwrite`, which removes
only the trainer's own files, once every other check has passed), and the main process claims it
(creates a fresh name exclusively, locks `RUN/.run.lock`) so that two runs never share one.
"""
from __future__ import annotations

import atexit
import fcntl
import os
import signal
import time
import weakref
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from common.errors import ConfigError, UserError, os_reason
from common.paths import refuse_clashes
from config.loader import to_yaml
from config.schema import Config, DataConfig, TrainConfig
from data.h5format import KeypointH5, check_split
from runtime import distributed as dist
from engine.sampler import GlobalBatchSampler, ShardSampler

RUN_FILES = ("last.pth", "best.pth", "metrics.jsonl", "config.yaml")
# what the trainer writes in a run directory: all --overwrite ever removes
WRITTEN = ("last.pth", "best.pth", "epoch_*.pth", "metrics.jsonl", "train_steps.jsonl", "config.yaml",
           "train.log", "environment.json", ".environment.*.tmp.json", "curves.png", "config.yaml.tmp", "curves.tmp.png", ".*.ckpt-tmp",
           "tensorboard/events.out.tfevents.*", "val_pictures/epoch_*.png", "val_pictures/.epoch_*.tmp.png")
LOCK_FILE = ".run.lock"                  # locked (POSIX lockf) by the process that runs there
_claimed: dict[str, int] = {}            # run directory -> descriptor holding its lock, per process


def holds_run(path: Path) -> bool:
    return path.is_dir() and any((path / name).exists() for name in RUN_FILES)


def newest_run_dir(out_dir: Path) -> Path | None:
    """The most recently written run directory under `out_dir` (for `--resume auto` without a name)."""
    runs = [p for p in out_dir.glob("*") if holds_run(p) and not p.name.startswith("_")]
    return max(runs, key=lambda p: p.stat().st_mtime) if runs else None


def _make_out_dir(out_dir: Path) -> None:
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ConfigError(f"--out-dir {out_dir}: a file, not a folder; choose a folder for the runs"
                          ) from None
    except OSError as exc:
        raise ConfigError(f"--out-dir {out_dir}: cannot create it ({exc.strerror})") from None


def _claim(run_dir: Path, exclusive: bool) -> bool:
    """Create `run_dir` (only if absent when `exclusive`) and lock it for this process; returns
    whether it was created. The lock (lockf of RUN/.run.lock) goes with the process, even a killed
    one, and is not inherited by the processes it forks (DataLoader workers outliving it)."""
    created = False
    try:
        run_dir.mkdir()
        created = True
    except FileExistsError:
        if exclusive or not run_dir.is_dir():
            if exclusive:
                raise
            raise ConfigError(f"{run_dir}: a file, not a run directory; choose another --run-name") from None
    except OSError as exc:
        raise ConfigError(f"--out-dir {run_dir.parent}: cannot create the run directory there "
                          f"({exc.strerror})") from None
    key = str(run_dir.resolve())
    if key not in _claimed:
        try:
            fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            release_run_dir(run_dir, remove_if_empty=created)
            raise ConfigError(f"{run_dir}: cannot write there ({exc.strerror})") from None
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise ConfigError(f"{run_dir} is in use by another run right now; wait for it to end, or "
                              "choose another --run-name") from None
        _claimed[key] = fd
    return created


def release_run_dir(run_dir: Path | None, remove_if_empty: bool = False) -> None:
    """Give up this process's lock on `run_dir` (and remove it when it is still empty)."""
    if run_dir is None:
        return
    fd = _claimed.pop(str(Path(run_dir).resolve()), None)
    if fd is not None:
        os.close(fd)
    if remove_if_empty and {p.name for p in Path(run_dir).iterdir()} <= {LOCK_FILE}:
        (Path(run_dir) / LOCK_FILE).unlink(missing_ok=True)
        Path(run_dir).rmdir()


def choose_run_dir(cfg: Config, ctx) -> tuple[Path, bool]:
    """Pick and claim the run directory on the main process; every rank gets the same path, or the
    same error. Returns (path, whether this call created it)."""
    path, created = dist.decided_on_main(lambda: pick_and_claim(cfg))
    return Path(path), created


def pick_and_claim(cfg: Config) -> tuple[Path, bool]:
    """The run directory, claimed (on the main process): a directory that holds a run is refused
    unless resumed or overwritten (`clear_run_dir`, once every other check has passed), and so is
    one whose files the run would write over a file it reads; two runs never share one."""
    train = cfg.train
    out_dir = Path(train.out_dir)
    run_dir, created = None, False
    named = out_dir / train.run_name if train.run_name else None
    if train.resume and train.resume != "auto":
        run_dir = Path(train.resume).resolve().parent     # writes next to the file resumed
        if named is not None and named.resolve() != run_dir:
            raise ConfigError(f"--resume {train.resume} continues the run in {run_dir}, not "
                              f"--run-name {train.run_name}: copy the checkpoint into {named} "
                              "and resume it there, or leave out --run-name")
    elif named is not None:
        run_dir = named
    elif train.resume == "auto":
        run_dir = newest_run_dir(out_dir)
    if train.resume == "auto" and not (cfg.data.train_h5 or train.weights or train.resume_reference) and not (
            run_dir and run_dir.is_dir() and (holds_run(run_dir) or any(run_dir.glob("*.pth")))):
        raise ConfigError(_nothing_to_resume(out_dir, run_dir))
    _make_out_dir(out_dir if run_dir is None else run_dir.parent)
    if run_dir is None:                 # a fresh name, created exclusively: never one in use
        stamp = time.strftime("run-%Y%m%d-%H%M%S")
        for attempt in range(1, 1000):
            run_dir = out_dir / (stamp if attempt == 1 else f"{stamp}-{attempt}")
            try:
                created = _claim(run_dir, exclusive=True)
                break
            except FileExistsError:
                continue
    else:
        created = _claim(run_dir, exclusive=False)
    if holds_run(run_dir) and not train.resume and not train.overwrite:
        release_run_dir(run_dir)
        raise ConfigError(
            f"{run_dir} already holds a run: pass --resume auto to continue it, "
            f"--overwrite to replace it, or choose another --run-name")
    try:      # the files it writes (or, with --overwrite, removes) there: none may be an input
        refuse_clashes({"--weights": train.weights, "--resume-reference": train.resume_reference,
                        "--train-h5": cfg.data.train_h5, "--val-h5": cfg.data.val_h5, "--config": cfg.preset},
                       {"--run-name/--out-dir": _overwritten(run_dir)})
    except ConfigError:
        release_run_dir(run_dir, remove_if_empty=created)
        raise
    return run_dir, created


def _nothing_to_resume(out_dir: Path, run_dir: Path | None) -> str:
    """Why `--resume auto` that finds no run is refused: the run directory looked in (a misspelt
    --run-name, or another --out-dir than the run's) would otherwise start a new run on the
    synthetic dataset. Naming the data or the weights (a requeued job) starts afresh instead."""
    where = (f"found no run in {run_dir} (no checkpoint, no config.yaml): check --run-name, and give "
             "the --out-dir the run was started with" if run_dir else
             f"found no run in {out_dir}: give the --out-dir the runs were written to")
    return (f"--resume auto: {where}; to start a new run instead, leave out --resume auto or name "
            "its data (--train-h5) or weights (--weights)")


def _overwritten(run_dir: Path) -> list[Path]:
    """The files an earlier run of this trainer wrote in `run_dir`: what --overwrite removes."""
    return [path for pattern in WRITTEN for path in run_dir.glob(pattern)
            if path.is_file() or path.is_symlink()]


def clear_run_dir(train: TrainConfig, run_dir: Path) -> None:
    """--overwrite: remove what an earlier run of this trainer wrote in `run_dir`, nothing else."""
    if not train.overwrite or train.resume:
        return
    for path in _overwritten(run_dir):
        path.unlink()
    for folder in ("tensorboard", "val_pictures"):
        try:
            (run_dir / folder).rmdir()
        except OSError:
            pass                            # absent, or holds files the trainer did not write


def save_resolved_config(cfg: Config, run_dir: Path) -> None:
    tmp = run_dir / "config.yaml.tmp"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        tmp.write_text(to_yaml(cfg))
        tmp.replace(run_dir / "config.yaml")
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise UserError(f"cannot write {run_dir / 'config.yaml'}: {os_reason(exc)}; "
                          "choose a writable --out-dir with free space") from None


def resolve_data(data: DataConfig, ctx) -> tuple[str, str]:
    """(train_h5, val_h5): the user's files, or the project's synthetic dataset made once; checked
    (or made) by rank 0, whose answer or error every rank gets."""
    paths = dist.decided_on_main(lambda: _resolve_data(data))
    if not data.train_h5 and not ctx.is_main:    # made, or found, on nodes without a shared cache
        paths = _resolve_data(data)
    return paths


def _resolve_data(data: DataConfig) -> tuple[str, str]:
    if data.train_h5:
        for option, path in (("--train-h5", data.train_h5), ("--val-h5", data.val_h5)):
            if path and not Path(path).is_file():
                raise ConfigError(f"{option} {path}: no such file")
        check_split(KeypointH5(data.train_h5), "train", "--train-h5")
        return data.train_h5, data.val_h5
    if data.val_h5:
        raise ConfigError(f"--val-h5 {data.val_h5} without --train-h5: the run would train and validate "
                          "on the project's synthetic dataset and ignore it; give --train-h5 too")
    paths = _synthetic(data.synthetic_dir)
    return str(paths[0]), str(paths[1])


def _synthetic(folder: str):
    from data.synthetic import ensure_synthetic_h5
    try:
        return ensure_synthetic_h5(folder)
    except OSError as exc:
        raise ConfigError(f"option data.synthetic_dir {folder}: cannot make the synthetic dataset there "
                          f"({os_reason(exc)}); choose a writable folder") from None


STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGUSR1") if hasattr(signal, name))


def ignore_stop_signals(worker_id: int) -> None:
    """DataLoader workers ignore SIGTERM / SIGUSR1: torchrun and SLURM signal the whole process
    group, and a worker that died of it would make the main process fail at whatever line it is on
    (even mid-save). The main process decides: it finishes the step, saves and stops; the workers
    end with it (they watch their parent)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    # forked with them blocked (`PersistentWorkersLoader`): one that came since is dropped now
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def _stop_workers(iterator, workers) -> None:
    """Shut down a loader iterator's worker processes (`iterator` None: it is gone) and kill any
    that outlive torch's own shut-down: they ignore SIGTERM, which is all that shut-down and
    Python's exit send a worker that did not leave when asked."""
    if iterator is not None:
        iterator._shutdown_workers()
    for worker in workers:
        if worker.is_alive():
            worker.kill()
            worker.join(timeout=5)


def _stop_workers_at_exit(iterator_ref, workers) -> None:
    """Shut down the workers of a loader iterator still alive when Python exits."""
    _stop_workers(iterator_ref(), workers)


class PersistentWorkersLoader(DataLoader):
    """A DataLoader whose worker processes start safe from stop signals (see `_get_iterator`),
    end with `close()`, and are shut down when Python exits, wherever its iterator is held; an
    error of the user's that a worker meets is the same one line as without workers.
    Python's exit would stop them with SIGTERM, which they ignore (`ignore_stop_signals`), then
    wait for them forever, and torch's own shut-down does nothing once the interpreter exits. The
    exit function is registered after torch's and multiprocessing's, so it runs before them.

    A run calls `close()` when it ends: left to the garbage collector, the iterator's queues can
    be finalised before the iterator itself (they are in the same garbage cycle), so its shut-down
    cannot send the workers their stop message, waits 10 s per worker in vain, and the workers
    live on until the exit function kills them."""

    def _get_iterator(self):
        if self.num_workers == 0:
            return super()._get_iterator()
        # A worker installs torch's SIGTERM handler (which kills it when anyone but its parent
        # signals) before it runs `worker_init_fn`. The workers are forked with the stop signals
        # blocked, so one sent to the process group in between waits, then is ignored; this
        # process takes its own copy when they are unblocked here.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            iterator = super()._get_iterator()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        atexit.register(_stop_workers_at_exit, weakref.ref(iterator), list(iterator._workers))
        return _AsRaisedInWorker(iterator)

    def close(self) -> None:
        """End the worker processes now; iterating again starts new ones."""
        iterator, self._iterator = getattr(self, "_iterator", None), None
        if iterator is not None and self.num_workers > 0:
            _stop_workers(iterator, iterator._workers)


class _AsRaisedInWorker:
    """A loader iterator whose `UserError` that a worker raised (a damaged picture) comes as the
    worker raised it, one line: torch hands it over as the same type made anew from the message
    "Caught DataError in DataLoader worker process N. Original Traceback ...", whose end is the
    original error's line. Everything else is the iterator's."""

    def __init__(self, iterator):
        self.iterator = iterator

    def __getattr__(self, name):
        return getattr(self.iterator, name)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.iterator)
        except UserError as exc:
            text, origin = str(exc), f"{type(exc).__module__}.{type(exc).__qualname__}: "
            if not text.startswith("Caught ") or origin not in text:
                raise
            raise type(exc)(text[text.rindex(origin) + len(origin):].strip()) from None


def close_loaders(*loaders) -> None:
    """End the worker processes of the run's loaders (those that have them), once it is over."""
    for loader in loaders:
        if isinstance(loader, PersistentWorkersLoader):
            loader.close()


def train_loader(dataset, data: DataConfig, train: TrainConfig, ctx
                 ) -> tuple[DataLoader, GlobalBatchSampler]:
    """The training loader of a `KeypointDataset` and its sampler: compact batches
    (`data.transfer`; `engine.device_feed` expands them on the device), `train.batch_size` in
    total over the processes, in `data.workers` worker processes."""
    from data.dataset import CompactSamples
    if train.batch_size % ctx.world_size:
        raise ConfigError(f"option train.batch_size: {train.batch_size} does not divide over "
                          f"{ctx.world_size} processes (it is the total batch)")
    sampler = GlobalBatchSampler(len(dataset), train.batch_size, ctx.rank, ctx.world_size,
                                 seed=train.seed)
    if sampler.batches_per_epoch == 0:
        raise ConfigError(f"option train.batch_size: {train.batch_size} is larger than the "
                          f"{len(dataset)} training samples")
    if sampler.batches_per_epoch < train.accumulate:
        raise ConfigError(f"option train.accumulate: {train.accumulate} batches per step, but an "
                          f"epoch has only {sampler.batches_per_epoch} batches of {train.batch_size}")
    # Workers persist across epochs (and keep their HDF5 handle): the epoch travels with the
    # sampler's (epoch, index) keys. They send compact samples, expanded on the device.
    loader = PersistentWorkersLoader(CompactSamples(dataset), batch_sampler=sampler,
                                     **_worker_options(data, ctx))
    return loader, sampler


def val_loader(dataset, data: DataConfig, batch_size: int, ctx) -> DataLoader:
    """This rank's shard of a validation `KeypointDataset`, in compact batches of its share of
    the total `batch_size`. Built once per run: its workers persist from one validation to the
    next (and keep their HDF5 handle), as the training loader's do."""
    from data.dataset import CompactSamples
    per_process = max(1, batch_size // ctx.world_size)
    return PersistentWorkersLoader(CompactSamples(dataset), batch_size=per_process,
                                   sampler=ShardSampler(len(dataset), ctx.rank, ctx.world_size),
                                   **_worker_options(data, ctx))


def _worker_options(data: DataConfig, ctx) -> dict:
    """The DataLoader options of both loaders: `data.workers` persistent worker processes that
    ignore stop signals, pinned batches for CUDA."""
    if data.workers > 0:
        # Workers are the parallelism. OpenCV threads in them would oversubscribe the cores, and
        # changing OpenCV's thread count inside a forked worker can deadlock on the pool the
        # parent used: so the parent sets it once, before any worker is forked.
        import cv2
        cv2.setNumThreads(1)
    return {"num_workers": data.workers, "persistent_workers": data.workers > 0,
            "worker_init_fn": ignore_stop_signals,
            "pin_memory": data.pin_memory and ctx.device.type == "cuda"}


def memory_gb(device: torch.device) -> float:
    """Peak memory of this process: CUDA allocations on GPU, resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 30
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
