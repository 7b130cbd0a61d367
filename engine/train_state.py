"""A run's checkpoints, written and read back in one place: `TrainState` is the run's position as
a checkpoint holds it; `Checkpoints` writes RUN/NAME (the parts' states: model, optimiser, scaler,
RNG; the position; the entries fixed for the run: config, skeleton, launch mode; each hook's
`state_dict()` under its `checkpoint_key`), never one that is no good to resume, and `restore`s
the same entries into a run built from the same configuration. `check_resumable` refuses a file
without what a resume reads; each hook checks its own entries (`Hook.load_state_dict`).
"""
from __future__ import annotations

import signal
from dataclasses import asdict, dataclass
from pathlib import Path

from common.errors import CheckpointError, TrainingDiverged
from engine.precision.loss_scale import checked_scaler_state, grad_scaler_fields, scaler_problem
from engine.trainer import Interrupted
from runtime import checkpoint as ckpt
from runtime import distributed as dist

DIVERGENCE_ADVICE = "lower optim.lr, enable --clip-grad, or use O0"
_STATE_ERRORS = (ValueError, KeyError, TypeError, RuntimeError, IndexError, AttributeError)
# what a checkpoint must hold to be resumed (and may hold), besides the hooks' entries, with types
RESUME_FIELDS = {"model": dict, "optimizer": dict, "epoch": int, "iteration": int, "step": int}
RESUME_OPTIONAL = {"scaler": (dict, type(None)), "skipped_steps": int, "rng": (dict, type(None))}


def bad_value(value, kind) -> bool:
    """Whether a stored value is not of `kind` (a bool or a negative int never is)."""
    return not isinstance(value, kind) or isinstance(value, bool) or (isinstance(value, int) and value < 0)


def check_resumable(state: dict, path) -> None:
    """CheckpointError naming `path` unless `state` holds everything a resume reads, well typed."""
    for key, kind in {**RESUME_FIELDS, **RESUME_OPTIONAL}.items():
        if key not in state:
            if key in RESUME_FIELDS:
                raise CheckpointError(f"checkpoint {path} cannot be resumed: it has no {key!r}; start from "
                                      "its weights with --weights instead of --resume")
        elif bad_value(state[key], kind):
            raise CheckpointError(f"checkpoint {path} is damaged: {key} is {type(state[key]).__name__} "
                                  f"{str(state[key])[:40]!r}; start from its weights with --weights "
                                  "instead of --resume")


@dataclass
class TrainState:
    epoch: int                         # the epoch the run is in (0-based)
    iteration: int                     # batches of that epoch done
    step: int | None                   # optimiser steps done (None: the authors' run, whose count is unknown)
    skipped_steps: int = 0             # steps skipped for a bad loss or gradients, all told
    validation_pending: bool = False   # saved before the epoch's validation, which a resume runs again

    @classmethod
    def of_checkpoint(cls, state: dict) -> "TrainState":
        return cls(state["epoch"], state["iteration"], state["step"], state.get("skipped_steps", 0),
                   bool(state.get("validation_pending", False)))


def _keys(hook) -> tuple:
    key = hook.checkpoint_key
    return key if isinstance(key, tuple) else (key,) if key else ()


class Checkpoints:
    """The checkpoints in `run_dir` of `model` (unwrapped), `optimizer` and `precision`; `fields`:
    the entries fixed for the run; `main`: this process writes them (every rank calls `save`);
    `say`: where its one line goes (a run whose every step was a loss scale's back-off)."""

    def __init__(self, run_dir, model, optimizer, precision, fields: dict | None = None, main: bool = True,
                 say=print):
        self.run_dir, self.model, self.optimizer, self.precision = Path(run_dir), model, optimizer, precision
        self.fields, self.main, self.say = fields or {}, main, say
        self.said_backoff = False      # that line is said once
        self.started_at = (0, 0)       # (step, skipped steps) when this process's run began
        self.resumed_from = None       # the checkpoint this process's run resumed

    def save(self, trainer, name: str, epoch: int, iteration: int, validation_pending: bool = False) -> None:
        """Write RUN/name on the main process (all ranks call: ZeRO consolidates the optimiser).
        A state that is no good to resume is never written (`refuse_unusable_state`)."""
        self.refuse_unusable_state(trainer, name)
        consolidate = getattr(self.optimizer, "consolidate_state_dict", None)    # ZeRO's
        if consolidate is not None:
            consolidate(to=0)
        hooks = {}                      # every rank computes them
        for hook in trainer.hooks:
            if isinstance(hook.checkpoint_key, tuple):
                hooks.update(hook.state_dict())
            elif hook.checkpoint_key:
                hooks[hook.checkpoint_key] = hook.state_dict()
        if self.main:
            position = TrainState(epoch, iteration, trainer.step, trainer.optim_step.skipped_total,
                                  validation_pending)
            state = {"model": self.precision.float32_state_dict(ckpt.unwrap_model(self.model)),
                     "optimizer": self.optimizer.state_dict(), "scaler": self.precision.state_dict(),
                     **asdict(position), "rng": ckpt.capture_rng_state(), **self.fields, **hooks}
            for hook in trainer.hooks:
                hook.before_save(trainer, name, state)
            dist.check_group()          # a rank whose group is lost trains alone: it saves nothing
            ckpt.save_checkpoint(self.run_dir / name, state)
        dist.barrier()

    def refuse_unusable_state(self, trainer, name: str) -> None:
        """`TrainingDiverged` on every rank (each holds the same state) instead of writing RUN/name
        when every step of this run was skipped (nothing trained) for another reason than a dynamic
        loss scale's back-off (a line says so then, and the file is written), when the weights hold a NaN or
        an infinite value, or when the loss scaler's state could not be resumed: the file keeps what
        it held."""
        path = self.run_dir / name
        kept = (f"{path} still holds the weights it held" if path.exists() else f"{path} was not written")
        ran, skipped = self._since_start(trainer)
        if ran and skipped == ran and trainer.optim_step.backoff_skips == ran:
            if not self.said_backoff:
                scale = grad_scaler_fields(self.precision.state_dict()).get("scale")
                self.say(f"all {ran} steps of this run overflowed the dynamic loss scale, which backed off to "
                         f"{scale:g}: no weight changed yet; {name} keeps the lowered scale, so a resume "
                         "trains from there")
                self.said_backoff = True
        elif ran and skipped == ran:
            raise TrainingDiverged(f"all {ran} steps of this run were skipped (a non-finite or abnormal loss "
                                   f"or gradients at each): nothing trained and {kept}. "
                                   f"{self.good_checkpoint(trainer)}: {DIVERGENCE_ADVICE}")
        bad = ckpt.non_finite(self.precision.weight_sources(ckpt.unwrap_model(self.model)))
        if bad:
            raise TrainingDiverged(f"after step {trainer.step} the weights hold NaN or infinite values "
                                   f"({len(bad)} tensors, the first {bad[0]}); {kept}: {DIVERGENCE_ADVICE}")
        problem = scaler_problem(self.precision.state_dict())
        if problem:
            raise TrainingDiverged(f"after step {trainer.step} the loss scaler's state is unusable "
                                   f"({problem}); {kept}: {DIVERGENCE_ADVICE}")

    def _since_start(self, trainer) -> tuple[int, int]:
        """(steps, skipped steps) of this process's run."""
        return trainer.step - self.started_at[0], trainer.optim_step.skipped_total - self.started_at[1]

    def good_checkpoint(self, trainer) -> str:
        """Which checkpoint a run that stops diverged names to go back to: last.pth, unless this run
        resumed a checkpoint and no step has succeeded since (that file is then no good start)."""
        ran, skipped = self._since_start(trainer)
        if self.resumed_from is not None and ran == skipped:
            return (f"Every step since the resume from {self.resumed_from} was skipped, so it is no good "
                    "start: go back to an earlier checkpoint of the run, or start from its weights with "
                    "--weights")
        last = self.run_dir / "last.pth"
        return f"The last good checkpoint is {last}" if last.exists() else "No checkpoint was written before"

    def interrupted(self, trainer, where: str) -> Interrupted:
        """The error that ends a run stopped by a signal, once last.pth holds what it resumes from."""
        name = signal.Signals(trainer.stop_signal).name if trainer.stop_signal else "a signal on another rank"
        return Interrupted(f"stopped by {name} {where}; saved {self.run_dir / 'last.pth'}. Resume with "
                           f"the same command and --resume auto --run-name {self.run_dir.name}")

    def restore(self, trainer, state: dict, path: Path, say=print) -> TrainState:
        """Optimiser, scaler, RNG and the hooks' states from `state` (the checkpoint at `path`), and
        the position `trainer` continues from. The scaler's state is checked first, as weights are
        (engine.precision.loss_scale)."""
        scaler, note = checked_scaler_state(state.get("scaler"), f"checkpoint {path}")
        try:
            self.optimizer.load_state_dict(state["optimizer"])
            self.precision.load_state_dict(scaler or {})
            if self.main and state.get("rng"):
                ckpt.restore_rng_state(state["rng"])
            for hook in trainer.hooks:
                found = {key: state[key] for key in _keys(hook) if key in state}
                if _keys(hook) and not found:
                    hook.state_missing(trainer, path)
                    continue
                try:
                    if found:
                        hook.load_state_dict(found if isinstance(hook.checkpoint_key, tuple)
                                             else found[hook.checkpoint_key])
                except CheckpointError as exc:          # what does not fit, in the hook's words
                    raise CheckpointError(f"checkpoint {path}: {exc}") from None
        except _STATE_ERRORS as exc:
            first_line = str(exc).splitlines()[0] if str(exc) else ""
            raise CheckpointError(f"checkpoint {path}: its optimiser, scaler or RNG state does not fit "
                                  f"this run ({type(exc).__name__}: {first_line}); start from its "
                                  "weights with --weights instead of --resume") from None
        if note:
            say(note)
        position = TrainState.of_checkpoint(state)
        trainer.optim_step.skipped_total = position.skipped_steps
        trainer.epoch, trainer.start_batch, trainer.resumed = position.epoch, position.iteration, position
        # a run started elsewhere (step None): the steps of the epochs it finished
        trainer.step = (position.step if position.step is not None
                        else trainer.epoch * (trainer.batches_per_epoch // trainer.accumulate))
        self.started_at, self.resumed_from = (trainer.step, position.skipped_steps), path
        origin = state.get("origin") or (f"saved by a {state.get('mode', '?')} run of "
                                         f"{state.get('world_size', '?')} process(es)")
        say(f"resumed from {path}: epoch {position.epoch + 1}, batch {position.iteration}"
            + (f", step {position.step}" if position.step is not None else "") + f" ({origin})")
        return position
