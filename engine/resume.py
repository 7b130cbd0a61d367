"""Where a run starts from, decided once: `plan_run` picks (on rank 0, for every rank) the run
directory and the checkpoint a resume continues; a `CheckpointReader`, made by the entry script
and handed to the command line (`engine.cli.config_from_args`) and to `build_trainer`, scans a run
directory for `--resume auto` and reads a checkpoint once for both (the command line's look at the
saved config, the trainer's plan and load); `load_start` puts the weights a run starts from
(resume, the authors' run, --weights) into the model; engine/train_state.py restores the rest
once the optimiser exists.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from common.errors import CheckpointError, ConfigError
from common.paths import same_file
from config.schema import Config, TrainConfig
from data.skeleton import Skeleton, from_checkpoint
from data.skeleton_words import skeleton_words
from engine.run_setup import RUN_FILES, pick_and_claim, release_run_dir
from runtime import checkpoint as ckpt
from runtime import distributed as dist


class CheckpointReader:
    """Reads a checkpoint, and scans a run directory for its latest checkpoint, once while the files
    stay the same (names, sizes, times): one reader shared by the command line and `build_trainer`
    reads the run directory's checkpoints once. It holds the last file read until `forget()`."""

    def __init__(self):
        self._state: tuple[tuple, dict] | None = None        # (the file's identity, its state)
        self._latest: tuple[tuple, str | None] | None = None  # (the checkpoints' identities, latest's name)

    def latest(self, run_dir) -> Path | None:
        """`runtime.checkpoint.find_latest_checkpoint(run_dir)`, which reads every checkpoint there."""
        run_dir = Path(run_dir)
        try:
            files = tuple(sorted((p.name, st.st_ino, st.st_size, st.st_mtime_ns)
                                 for p in run_dir.glob("*.pth") for st in [p.stat()]))
        except OSError:
            return ckpt.find_latest_checkpoint(run_dir)       # says what is wrong
        key = (str(run_dir.resolve()), files)
        if self._latest is None or self._latest[0] != key:
            found = ckpt.find_latest_checkpoint(run_dir)
            self._latest = (key, found.name if found else None)
        return run_dir / self._latest[1] if self._latest[1] else None

    def state(self, path) -> dict:
        """The checkpoint at `path`, memory-mapped."""
        path = Path(path)
        try:
            stat = path.stat()
            key = (str(path.resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns)
        except OSError:
            return ckpt.load_checkpoint(path, mmap=True)      # says what is wrong with it
        if self._state is None or self._state[0] != key:
            self._state = (key, ckpt.load_checkpoint(path, mmap=True))
        return self._state[1]

    def forget(self) -> None:
        """Give back what was read (the next look reads the files again)."""
        self._state = self._latest = None


@dataclass
class RunPlan:
    run_dir: Path
    created: bool                     # this run created run_dir (removed again if it fails to start)
    resume_path: Path | None          # the checkpoint this run continues, if any
    config: Config                    # the main process's: the one every rank trains with
    reader: CheckpointReader          # reads resume_path (the command line may have read it)


def plan_run(cfg: Config, reader: CheckpointReader | None = None) -> RunPlan:
    """Decided on the main process, the same on every rank: one rank's view of a shared filesystem
    (a newer file, a stale listing, hence another saved config) never makes the ranks disagree.
    `reader`: the one the command line read the saved config with, if any."""
    reader = reader or CheckpointReader()

    def decide():
        run_dir, created = pick_and_claim(cfg)
        try:
            return str(run_dir), created, _resume_path(cfg.train, run_dir, reader), cfg
        except BaseException:      # a run that did not start leaves no directory behind
            release_run_dir(run_dir, remove_if_empty=created)
            raise
    run_dir, created, path, config = dist.decided_on_main(decide)
    return RunPlan(Path(run_dir), created, Path(path) if path else None, config, reader)


def _resume_path(train: TrainConfig, run_dir: Path, reader: CheckpointReader) -> str | None:
    if not train.resume:
        return None
    if train.resume == "auto":
        path = reader.latest(run_dir)
        return str(path) if path else None
    if not Path(train.resume).is_file():
        raise CheckpointError(f"--resume {train.resume}: no such file")
    refuse_another_run(Path(train.resume), run_dir)
    return train.resume


def refuse_another_run(path: Path, run_dir: Path) -> None:
    """ConfigError when resuming `path` would write over another run's files in `run_dir` (where a
    resume writes): a file the trainer did not name itself (not last.pth, best.pth, epoch_N.pth)
    beside a run's files is another run's checkpoint."""
    if path.name in ("last.pth", "best.pth") or re.fullmatch(r"epoch_\d+\.pth", path.name):
        return
    theirs = [name for name in RUN_FILES if (run_dir / name).exists() and not same_file(run_dir / name, path)]
    if theirs:
        raise ConfigError(f"--resume {path}: {run_dir} holds another run ({', '.join(theirs)}), which "
                          "resuming there would write over; nothing was touched: copy the checkpoint "
                          f"into a folder of its own (e.g. NEW/last.pth) and resume it there")


def check_skeleton(theirs: Skeleton, ours: Skeleton, path, how: str) -> None:
    """CheckpointError when a checkpoint's skeleton is not the data's (see the messages)."""
    if theirs == ours:
        return
    fix = ("continue it on data of its skeleton, or start a new run from it with --weights "
           "and --allow-partial" if how == "resume" else
           "pass --allow-partial to load everything but the output heads and merges whose "
           "shapes differ (they start fresh)")
    raise CheckpointError(f"{path} was trained on skeleton {skeleton_words(theirs, ours)} but the data "
                          f"has {skeleton_words(ours, theirs)}: {fix}")


def load_start(model, plan: RunPlan | None, train: TrainConfig, skeleton: Skeleton, say) -> tuple:
    """Load the weights the run starts from into `model`; returns (resume state or None, the
    authors' checkpoint whose run continues or None, its path, the names of the tensors that
    --allow-partial left fresh). Without a `plan` (parts built outside a run): --weights only."""
    if plan is not None and plan.resume_path is not None:
        for option, path in (("--weights", train.weights), ("--resume-reference", train.resume_reference)):
            if path:
                say(f"{option} {path} not loaded: --resume auto continues the run from {plan.resume_path}")
        state = plan.reader.state(plan.resume_path)
        ckpt.check_resumable(state, plan.resume_path)
        check_skeleton(from_checkpoint(state), skeleton, plan.resume_path, "resume")
        ckpt.load_weights(model, state, source=f"checkpoint {plan.resume_path}")
        return state, None, plan.resume_path, ()
    if train.resume == "auto" and plan is not None:
        say(f"--resume auto: no checkpoint in {plan.run_dir} yet, starting afresh")
    if train.resume_reference:
        path = Path(train.resume_reference)
        reference = ckpt.read_reference(path)
        say(f"loaded weights from {path}: {load_summary(ckpt.load_weights(model, reference))}")
        return None, reference, path, ()
    if train.weights:
        weights = ckpt.read_file(train.weights)
        if isinstance(weights, dict) and "skeleton" in weights and not train.allow_partial:
            check_skeleton(from_checkpoint(weights), skeleton, train.weights, "weights")
        weights, ema_note = ckpt.preferred_weights(weights)
        report = ckpt.load_weights(model, weights, allow_partial=train.allow_partial,
                                   source=str(train.weights))
        say(f"loaded weights from {train.weights}: {load_summary(report)}"
            + (f"; {ema_note}" if ema_note else ""))
        return None, None, None, fresh_tensors(report)
    return None, None, None, ()


def _reshaped(report: dict) -> list[str]:
    """The tensors of a `load_weights` report whose shape differs in the file."""
    return [name.split(" (")[0] for name in report.get("mismatched") or []]


def fresh_tensors(report: dict) -> list[str]:
    """The tensors a `load_weights` report left at their initial values: missing from the file,
    or of another shape there."""
    return list(report.get("missing") or []) + _reshaped(report)


def load_summary(report: dict) -> str:
    loaded = report.get("loaded", "?")
    missing = report.get("missing") or []
    fresh = _reshaped(report)
    return (f"{loaded} tensors" + (f", {len(missing)} missing (--allow-partial)" if missing else "")
            + (f"; {report['converted']}" if report.get("converted") else "")
            + (f"; {len(fresh)} of another shape start fresh (--allow-partial): {', '.join(fresh)}"
               if fresh else ""))
