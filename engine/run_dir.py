"""The run directory and what a run resumes there, decided once on rank 0 (`plan_run`); the main
process claims it (created exclusively, `RUN/.run.lock` held), so two runs never share one."""
from __future__ import annotations

import contextlib
import fcntl
import os
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path

from common.errors import CheckpointError, ConfigError, UserError, os_reason
from common.paths import refuse_clashes, written_whole
from config.loader import to_yaml
from config.schema import Config, TrainConfig
from runtime import distributed as dist
from models.checkpoint_weights import EMA_KEY
from engine.checkpoints import CheckpointReader

RUN_FILES = ("last.pth", "best.pth", "metrics.jsonl", "config.yaml")
# what the trainer writes in a run directory: all --overwrite ever removes
WRITTEN = ("last.pth", "best.pth", "epoch_*.pth", "metrics.jsonl", "train_steps.jsonl", "config.yaml",
           "train.log", "environment.json", "curves.png", ".*.ckpt-tmp",
           ".environment.*.tmp.json", ".config.*.tmp.yaml", ".curves.*.tmp.png",    # written_whole's twins
           "config.yaml.tmp", "curves.tmp.png",                                     # earlier versions' twins
           "tensorboard/events.out.tfevents.*", "val_pictures/epoch_*.png", "val_pictures/.epoch_*.tmp.png")
LOCK_FILE = ".run.lock"                  # locked (POSIX lockf) by the process that runs there
_claimed: dict[str, int] = {}            # run directory -> descriptor holding its lock, per process


# what `--resume auto` does with a run folder in each state it can be left in (`folder_state`)
RESTARTS = {"new": "starting afresh",
            "config only": "restarting the run from step 0 with its own config.yaml (data, preset, "
                           "options; it was stopped before its first checkpoint)",
            "checkpoints": "continuing from its newest checkpoint",
            "finished": "it has already finished its epochs: nothing to train (raise --epochs to go on)"}


def folder_state(run_dir: Path, resume_path: Path | None, epochs: int, reader) -> str:
    """The state of `run_dir` a resume finds: a key of RESTARTS."""
    if resume_path is None:
        return "config only" if (run_dir / "config.yaml").is_file() else "new"
    epoch = reader.state(resume_path).get("epoch")
    return "finished" if isinstance(epoch, int) and epoch >= epochs else "checkpoints"


def run_config(run_dir: Path | None) -> Path | None:
    """The config.yaml of a run folder killed before its first checkpoint: what its restart runs."""
    path = run_dir / "config.yaml" if run_dir else None
    return path if path and path.is_file() and not any(run_dir.glob("*.pth")) else None


def holds_run(path: Path) -> bool:
    return path.is_dir() and any((path / name).exists() for name in RUN_FILES)


def newest_run_dir(out_dir: Path) -> Path | None:
    """The most recently written run directory under `out_dir` (for `--resume auto` without a name)."""
    runs = [p for p in out_dir.glob("*") if holds_run(p) and not p.name.startswith("_")]
    return max(runs, key=lambda p: p.stat().st_mtime) if runs else None


def _claim(run_dir: Path, exclusive: bool) -> bool:
    """Create `run_dir` (only if absent when `exclusive`) and lock it for this process (lockf of
    RUN/.run.lock, not inherited by forks); returns whether it was created."""
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
                          f"({os_reason(exc)})") from None
    key = str(run_dir.resolve())
    if key not in _claimed:
        try:
            fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            release_run_dir(run_dir, remove_if_empty=created)
            what = (f"{run_dir / LOCK_FILE}: the run's lock file is a folder; remove it" if
                    (run_dir / LOCK_FILE).is_dir() else f"{run_dir}: cannot write there ({os_reason(exc)})")
            raise ConfigError(what) from None
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise ConfigError(f"{run_dir} is in use by another run right now; wait for it to end, or "
                              "choose another --run-name") from None
        _claimed[key] = fd
    return created


def release_run_dir(run_dir: Path, remove_if_empty: bool = False) -> None:
    """Give up this process's lock on `run_dir` (and remove it when it is still empty)."""
    if (fd := _claimed.pop(str(Path(run_dir).resolve()), None)) is not None:
        os.close(fd)
    if remove_if_empty and {p.name for p in Path(run_dir).iterdir()} <= {LOCK_FILE}:
        (Path(run_dir) / LOCK_FILE).unlink(missing_ok=True)
        Path(run_dir).rmdir()


def pick_and_claim(cfg: Config) -> tuple[Path, bool]:
    """The run directory, claimed on the main process (`plan_run` refuses it when taken)."""
    train, out_dir = cfg.train, Path(cfg.train.out_dir)
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
        where = (f"found no run in {run_dir} (no checkpoint, no config.yaml): check --run-name, and give "
                 "the --out-dir the run was started with" if run_dir else
                 f"found no run in {out_dir}: give the --out-dir the runs were written to")
        raise ConfigError(f"--resume auto: {where}; to start a new run instead, leave out --resume auto or "
                          "name its data (--train-h5) or weights (--weights)")
    parent = out_dir if run_dir is None else run_dir.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ConfigError(f"--out-dir {parent}: a file, not a folder; choose a folder for the runs") from None
    except OSError as exc:
        raise ConfigError(f"--out-dir {parent}: cannot create it ({os_reason(exc)})") from None
    if run_dir is None:                 # a fresh name, created exclusively: never one in use
        stamp = time.strftime("run-%Y%m%d-%H%M%S")
        for attempt in range(1, 1000):
            run_dir = out_dir / (stamp if attempt == 1 else f"{stamp}-{attempt}")
            with contextlib.suppress(FileExistsError):     # taken: try the next name
                created = _claim(run_dir, exclusive=True)
                break
    else:
        created = _claim(run_dir, exclusive=False)
    return run_dir, created


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
        with contextlib.suppress(OSError):  # absent, or holds files the trainer did not write
            (run_dir / folder).rmdir()


def save_resolved_config(cfg: Config, run_dir: Path) -> None:
    try:
        with written_whole(run_dir / "config.yaml", option="--out-dir") as tmp:
            tmp.write_text(to_yaml(cfg))
    except OSError as exc:
        raise UserError(f"cannot write {run_dir / 'config.yaml'}: {os_reason(exc)}; "
                          "choose a writable --out-dir with free space") from None


@dataclass
class RunPlan:
    run_dir: Path
    created: bool                     # this run created run_dir (removed again if it fails to start)
    resume_path: Path | None          # the checkpoint this run continues, if any
    config: Config                    # the main process's: the one every rank trains with
    reader: CheckpointReader          # reads resume_path (the command line may have read it)
    state: str = "new"                # the folder's state (a key of RESTARTS)
    notes: tuple = ()                 # what the resume says before it starts

    @property
    def restart(self) -> str:
        return RESTARTS[self.state]


def plan_run(cfg: Config, reader: CheckpointReader | None = None) -> RunPlan:
    """Decided on the main process, the same on every rank; a run directory that holds a run is refused
    unless resumed or overwritten, as is one where the run would write over (or remove) a file it reads."""
    reader, train = reader or CheckpointReader(), cfg.train

    def decide():
        run_dir, created = pick_and_claim(cfg)
        try:
            if holds_run(run_dir) and not train.resume and not train.overwrite:
                raise ConfigError(f"{run_dir} already holds a run: pass --resume auto to continue it, "
                                  "--overwrite to replace it, or choose another --run-name")
            refuse_clashes({"--weights": train.weights, "--resume-reference": train.resume_reference,
                            "--train-h5": cfg.data.train_h5, "--val-h5": cfg.data.val_h5,
                            "--config": cfg.preset}, {"--run-name/--out-dir": _overwritten(run_dir)})
            path = _resume_path(cfg.train, run_dir, reader)
            state = folder_state(run_dir, path and Path(path), train.epochs, reader) if train.resume \
                else "new"
            notes = [f"--resume {train.resume}: {path}: {RESTARTS[state]}"] if state == "finished" else []
            if path and not train.ema and EMA_KEY in reader.state(path):     # an average it drops
                notes.append(f"--ema 0: the average of the weights in {path} is dropped; this run validates "
                             "and keeps its own weights (resume with --ema DECAY to continue the average)")
            return RunPlan(run_dir, created, path and Path(path), cfg, None, state, notes)
        except BaseException:      # a run that did not start leaves no directory behind
            release_run_dir(run_dir, remove_if_empty=created)
            raise
    return replace(dist.decided_on_main(decide), reader=reader)      # the reader stays on each rank


def _resume_path(train: TrainConfig, run_dir: Path, reader: CheckpointReader) -> str | None:
    if not train.resume:
        return None
    if train.resume == "auto":
        return str(path) if (path := reader.latest(run_dir)) else None
    path = Path(train.resume)
    if not path.is_file():
        raise CheckpointError(f"--resume {train.resume}: no such file")
    # a file of another name: resuming it would write over another run's checkpoints in `run_dir`
    theirs = [name for name in RUN_FILES
              if (run_dir / name).exists() and not os.path.samefile(run_dir / name, path)]
    if theirs and not (path.name in ("last.pth", "best.pth") or re.fullmatch(r"epoch_\d+\.pth", path.name)):
        raise ConfigError(f"--resume {path}: {run_dir} holds another run ({', '.join(theirs)}), which "
                          "resuming there would write over; nothing was touched: copy the checkpoint "
                          f"into a folder of its own (e.g. NEW/last.pth) and resume it there")
    return train.resume
