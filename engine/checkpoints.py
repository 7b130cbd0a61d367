"""A run's checkpoints in one place, the one owner of their entries: what a run starts from
(`load_start`), what `Checkpoints.save` writes (position, parts' and hooks' states) and restores."""
from __future__ import annotations

import itertools
import signal
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from common.errors import CheckpointError, ConfigError, TrainingDiverged, os_reason
from config.loader import differences, setting, to_dict
from config.schema import Config, OptimConfig, TrainConfig
from data.skeleton import Skeleton, from_checkpoint, skeleton_words
from models.checkpoint_weights import preferred_weights
from models.reference import momentum_by_name
from engine.precision.loss_scale import checked_scaler_state, grad_scaler_fields, scaler_problem
from engine.trainer import Interrupted
from engine.optim import load_optimizer_state
from runtime import checkpoint as ckpt
from runtime import distributed as dist

DIVERGENCE_ADVICE = "lower optim.lr, enable --clip-grad, or use O0"
_STATE_ERRORS = (ValueError, KeyError, TypeError, RuntimeError, IndexError, AttributeError)
# what a checkpoint must hold to be resumed (and may hold), besides the hooks' entries, with types
RESUME_FIELDS = {"model": dict, "optimizer": dict, "epoch": int, "iteration": int, "step": int}
RESUME_OPTIONAL = {"scaler": (dict, type(None)), "skipped_steps": int, "rng": (dict, type(None)),
                   "fresh_tensors": list}


def bad_value(value, kind) -> bool:
    """Whether a stored value is not of `kind` (a bool or a negative int never is)."""
    return not isinstance(value, kind) or isinstance(value, bool) or (isinstance(value, int) and value < 0)


def find_latest_checkpoint(run_dir) -> Path | None:
    """The checkpoint of `run_dir` with the highest stored step, or None (unreadable ones raise)."""
    order = {}
    for path in sorted(Path(run_dir).glob("*.pth")):
        try:
            state = ckpt.load_checkpoint(path, mmap=True)
            step, epoch = state.get("step", state.get("global_step")), state.get("epoch")
            order[path] = (step if isinstance(step, int) else -1, epoch if isinstance(epoch, int) else -1,
                           path.name == "last.pth", path.stat().st_mtime)
        except (CheckpointError, OSError) as exc:
            reason = exc if isinstance(exc, CheckpointError) else f"{path}: {os_reason(exc)}"
            raise CheckpointError(f"--resume auto: {reason}. Nothing was overwritten: move that file out "
                                  f"of {run_dir}, or resume from another checkpoint with --resume PATH"
                                  ) from None
    return max(order, key=order.get, default=None)


class CheckpointReader:
    """Reads a checkpoint, and finds a run's latest, once while the files stay the same."""

    def __init__(self):
        self._read: dict[str, tuple] = {}     # "latest", "state": (the files' identities, what was read)

    def _once(self, kind: str, where: Path, files, read):
        """read(), again only once `files` (at `where`) changed (an OSError: read, to say what)."""
        try:
            key = (str(where.resolve()), tuple(sorted((p.name, st.st_ino, st.st_size, st.st_mtime_ns)
                                                      for p in files for st in [p.stat()])))
        except OSError:
            return read()
        if kind not in self._read or self._read[kind][0] != key:
            self._read[kind] = (key, read())
        return self._read[kind][1]

    def latest(self, run_dir) -> Path | None:
        """`find_latest_checkpoint(run_dir)`, which reads every checkpoint there."""
        run_dir = Path(run_dir)
        found = self._once("latest", run_dir, run_dir.glob("*.pth"),
                           lambda: getattr(find_latest_checkpoint(run_dir), "name", None))
        return run_dir / found if found else None

    def state(self, path) -> dict:
        path = Path(path)
        return self._once("state", path, [path], lambda: ckpt.load_checkpoint(path, mmap=True))

    def forget(self) -> None:
        """Give back what was read (the next look reads the files again)."""
        self._read = {}


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


class Start(NamedTuple):
    """What a run starts from, as `load_start` loaded it."""
    state: dict | None = None          # the checkpoint resumed
    reference: dict | None = None      # the authors' checkpoint whose run continues
    path: Path | None = None           # the file of either
    fresh: list | tuple = ()           # the tensors --allow-partial left fresh


def load_start(model, plan, train: TrainConfig, skeleton: Skeleton, say) -> Start:
    """Load the weights the run starts from into `model`. Without a `plan`: --weights only."""
    if plan is not None and plan.resume_path is not None:
        for option, path in (("--weights", train.weights), ("--resume-reference", train.resume_reference)):
            if path:
                say(f"{option} {path} not loaded: --resume auto continues the run from {plan.resume_path}")
        state, path = plan.reader.state(plan.resume_path), plan.resume_path
        for key, kind in {**RESUME_FIELDS, **RESUME_OPTIONAL}.items():      # what a resume reads
            if key not in state and key in RESUME_FIELDS:
                raise CheckpointError(f"checkpoint {path} cannot be resumed: it has no {key!r}; start from "
                                      "its weights with --weights instead of --resume")
            if key in state and bad_value(state[key], kind):
                raise CheckpointError(f"checkpoint {path} is damaged: {key} is {type(state[key]).__name__} "
                                      f"{str(state[key])[:40]!r}; start from its weights with --weights "
                                      "instead of --resume")
        check_skeleton(from_checkpoint(state), skeleton, path, "resume")
        ckpt.load_weights(model, state, source=f"checkpoint {path}")
        return Start(state, None, path, list(state.get("fresh_tensors", ())))
    if train.resume == "auto" and plan is not None:
        say(f"--resume auto: no checkpoint in {plan.run_dir} yet, {plan.restart}")
    if train.resume_reference:
        path = Path(train.resume_reference)
        reference = ckpt.read_reference(path)
        say(f"loaded weights from {path}: {load_summary(ckpt.load_weights(model, reference))}")
        return Start(None, reference, path)
    if train.weights:
        weights = ckpt.read_file(train.weights)
        if isinstance(weights, dict) and "skeleton" in weights and not train.allow_partial:
            check_skeleton(from_checkpoint(weights), skeleton, train.weights, "weights")
        weights, ema_note = preferred_weights(weights)
        report = ckpt.load_weights(model, weights, allow_partial=train.allow_partial,
                                   source=str(train.weights))
        say(f"loaded weights from {train.weights}: {load_summary(report)}"
            + (f"; {ema_note}" if ema_note else ""))
        return Start(fresh=list(report.get("missing") or []) + _reshaped(report))
    return Start()


def _reshaped(report: dict) -> list[str]:
    """The tensors of a `load_weights` report whose shape differs in the file."""
    return [name.split(" (")[0] for name in report.get("mismatched") or []]


def load_summary(report: dict) -> str:
    missing, fresh = report.get("missing") or [], _reshaped(report)
    return (f"{report.get('loaded', '?')} tensors"
            + (f", {len(missing)} missing (--allow-partial)" if missing else "")
            + (f"; {report['converted']}" if report.get("converted") else "")
            + (f"; {len(fresh)} of another shape start fresh (--allow-partial): {', '.join(fresh)}"
               if fresh else ""))


def resume_state(reference: dict, source: str, model, optimizer, optim: OptimConfig, depth: int,
                 strict: bool = True) -> dict:
    """The resume state of `reference` (the authors' layout, loaded into `model`) for `optimizer`; an
    optimiser other than SGD with momentum is refused when `strict`, else starts without momentum."""
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    sgd = optim.name == "sgd" and bool(optim.momentum)
    if strict and not sgd:
        raise ConfigError(f"{source}: the authors trained with SGD and momentum; continuing their run "
                          f"needs optim.name=sgd with momentum (this config: {optim.name})")
    saved = reference.get("optimizer_weight") if sgd else None
    momentum = {}
    if saved is not None:
        try:
            momentum = momentum_by_name(saved, model, depth)
        except ValueError as exc:
            raise CheckpointError(f"{source}: its optimiser state does not fit the model ({exc})") from None
    epoch, scaler = reference.get("epoch"), grad_scaler_fields(reference.get("amp"))
    state = {i: {"momentum_buffer": momentum[n].clone()} for i, n in enumerate(names) if n in momentum}
    origin = (f"the authors' run: SGD momentum of {len(state)} of {len(names)} parameters" if sgd
              else f"the authors' run: no momentum, optim.name is {optim.name}")
    origin += f", loss scale {scaler['scale']:g}" if scaler else ""
    index = itertools.count()   # optimizer.state_dict()'s param_groups, without asking for its state
    groups = [{**group, "params": [next(index) for _ in group["params"]]} for group in optimizer.param_groups]
    return {"optimizer": {"state": state, "param_groups": groups}, "scaler": scaler,
            "epoch": epoch + 1 if isinstance(epoch, int) else 0, "iteration": 0, "step": None,
            "origin": origin}


def reference_checkpoint(reference: dict, source, model, optimizer, cfg: Config, skeleton: Skeleton) -> dict:
    """A checkpoint of this trainer continuing the authors' run `reference` (loaded into `model`)."""
    state = resume_state(reference, str(source), model, optimizer, cfg.optim, cfg.model.depth, strict=False)
    return {**state, "model": model.state_dict(), "config": to_dict(cfg), "skeleton": skeleton.to_spec()}


def _batchnorm_batch(config, world_size) -> int | None:
    """The samples each BatchNorm layer normalises in a run of `config` on `world_size` processes."""
    try:
        batch = config["train"]["batch_size"]
        return batch if config["dist"]["sync_bn"] or world_size == 1 else batch // world_size
    except (KeyError, TypeError):
        return None


@dataclass
class TrainState:
    epoch: int                         # the epoch the run is in (0-based)
    iteration: int                     # batches of that epoch done
    step: int | None                   # optimiser steps done (None: the authors' run, whose count is unknown)
    skipped_steps: int = 0             # steps skipped for a bad loss or gradients, all told
    validation_pending: bool = False   # saved before the epoch's validation, which a resume runs again


def _keys(hook) -> tuple:
    key = hook.checkpoint_key
    return key if isinstance(key, tuple) else (key,) if key else ()


class Checkpoints:
    """A run's checkpoints, the one owner of their entries; `fields`: `run_fields`; `main`: it writes."""

    @staticmethod
    def run_fields(cfg: Config, skeleton: Skeleton, mode: str, world_size: int, fresh=()) -> dict:
        """The entries of a run's every checkpoint: its config, skeleton and launch, and the tensors
        --allow-partial left fresh (a resume keeps them trainable under --freeze)."""
        return {"config": to_dict(cfg), "skeleton": skeleton.to_spec(), "mode": mode,
                "world_size": world_size, "fresh_tensors": list(fresh)}

    def __init__(self, run_dir, model, optimizer, precision, fields: dict | None = None, main: bool = True,
                 say=print):
        self.run_dir, self.model, self.optimizer, self.precision = Path(run_dir), model, optimizer, precision
        self.fields, self.main, self.say = fields or {}, main, say
        self.said_backoff = False      # that line is said once
        self.started_at = (0, 0)       # (step, skipped steps) when this process's run began
        self.resumed_from = None       # the checkpoint this process's run resumed

    def save(self, trainer, name: str, epoch: int, iteration: int, validation_pending: bool = False) -> None:
        """Write RUN/name on the main process (all ranks call: ZeRO consolidates the optimiser)."""
        self.refuse_unusable_state(trainer, name)
        if (consolidate := getattr(self.optimizer, "consolidate_state_dict", None)) is not None:    # ZeRO's
            consolidate(to=0)
        hooks = {}                      # every rank computes them
        for hook in filter(_keys, trainer.hooks):
            kept = hook.state_dict()
            hooks.update(kept if isinstance(hook.checkpoint_key, tuple) else {hook.checkpoint_key: kept})
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
        """`TrainingDiverged` on every rank instead of writing RUN/name when every step was skipped (a
        dynamic scale's back-off is only said), the weights are not finite, or the scaler's state is bad."""
        path = self.run_dir / name
        kept = (f"{path} still holds the weights it held" if path.exists() else f"{path} was not written")
        ran, skipped = self._since_start(trainer)
        if ran and skipped == ran and self.precision.dynamic and trainer.optim_step.overflow_streak >= ran:
            if not self.said_backoff:
                scale = grad_scaler_fields(self.precision.state_dict()).get("scale")
                self.say(f"all {ran} steps of this run overflowed the dynamic loss scale, which backed off "
                         f"to {scale:g}: no weight changed yet; {name} keeps the lowered scale, so a resume "
                         "trains from there")
                self.said_backoff = True
        elif ran and skipped == ran:
            raise TrainingDiverged(f"all {ran} steps of this run were skipped (a non-finite or abnormal loss "
                                   f"or gradients at each): nothing trained and {kept}. "
                                   f"{self.good_checkpoint(trainer)}: {self.advice(trainer, ran)}")
        if bad := ckpt.non_finite(self.precision.weight_sources(ckpt.unwrap_model(self.model))):
            raise TrainingDiverged(f"after step {trainer.step} the weights hold NaN or infinite values "
                                   f"({len(bad)} tensors, the first {bad[0]}); {kept}: {DIVERGENCE_ADVICE}")
        if problem := scaler_problem(self.precision.state_dict()):
            raise TrainingDiverged(f"after step {trainer.step} the loss scaler's state is unusable "
                                   f"({problem}); {kept}: {DIVERGENCE_ADVICE}")

    def _since_start(self, trainer) -> tuple[int, int]:
        """(steps, skipped steps) of this process's run."""
        return trainer.step - self.started_at[0], trainer.optim_step.skipped_total - self.started_at[1]

    def good_checkpoint(self, trainer) -> str:
        """The checkpoint to go back to: last.pth, unless no step succeeded since the resumed one."""
        ran, skipped = self._since_start(trainer)
        if self.resumed_from is not None and ran == skipped:
            return (f"Every step since the resume from {self.resumed_from} was skipped; that checkpoint is "
                    "as it was; resume it with one of these changes (if its steps skip again, go back to "
                    "an earlier checkpoint of the run)")
        last = self.run_dir / "last.pth"
        return f"The last good checkpoint is {last}" if last.exists() else "No checkpoint was written before"

    def advice(self, trainer, steps: int) -> str:
        """What to change after `steps` skipped steps in a row (a fixed loss scale that overflowed, named)."""
        scale = self.precision.fixed_scale
        if scale and trainer.optim_step.overflow_streak >= steps:
            return (f"the fixed loss scale {scale:g} (--loss-scale) overflowed float16's gradients at each: "
                    "use --loss-scale dynamic or a lower number")
        return DIVERGENCE_ADVICE

    def interrupted(self, trainer, where: str) -> Interrupted:
        """The error that ends a run stopped by a signal, once last.pth holds what it resumes from."""
        name = signal.Signals(trainer.stop_signal).name if trainer.stop_signal else "a signal on another rank"
        return Interrupted(f"stopped by {name} {where}; saved {self.run_dir / 'last.pth'}. Resume with "
                           f"the same command and --resume auto --run-name {self.run_dir.name}")

    def optimizer_settings(self, state: dict) -> str:
        """The settings that decide what the optimiser trains, where they differ from `state`'s run."""
        ours = self.fields.get("config") or {}
        theirs = state.get("config") if isinstance(state.get("config"), dict) else {}
        differ = {key: pair for key, pair in differences(theirs, ours).items()
                  if key in ("train.freeze", "train.allow_partial", "optim.name", "dist.zero")}
        if differ:
            return "; ".join(f"{setting(key)} was {old!r} in that run and is {new!r} now"
                             for key, (old, new) in differ.items()) + ": resume with that run's value"
        freeze = " ".join(ours.get("train", {}).get("freeze") or [])
        return (f"--freeze {freeze} (train.freeze) freezes other tensors than in that run, whose checkpoint "
                "does not record which tensors --allow-partial left fresh (saved by an older version); "
                "start from its weights with --weights" if freeze else
                "start from its weights with --weights instead of --resume")

    def restore(self, trainer, state: dict, path: Path, say=print) -> TrainState:
        """Optimiser, scaler, RNG and hooks' states from `state`, and `trainer`'s position."""
        scaler, note = checked_scaler_state(state.get("scaler"), f"checkpoint {path}")
        try:
            try:
                load_optimizer_state(self.optimizer, state["optimizer"])
            except ValueError as exc:
                raise CheckpointError(f"checkpoint {path}: its optimiser state does not fit this run's "
                                      f"trainable parameters ({str(exc).splitlines()[0]}): "
                                      f"{self.optimizer_settings(state)}") from None
            self.precision.load_state_dict(scaler or {})
            if self.main and state.get("rng"):
                ckpt.restore_rng_state(state["rng"])
            for hook in trainer.hooks:
                found = {key: state[key] for key in _keys(hook) if key in state}
                if _keys(hook) and not found:
                    hook.state_missing(trainer, path)
                elif found:
                    try:
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
        position = TrainState(state["epoch"], state["iteration"], state["step"],
                              state.get("skipped_steps", 0), bool(state.get("validation_pending", False)))
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
        theirs, ours = (_batchnorm_batch(run.get("config"), run.get("world_size"))
                        for run in (state, self.fields))
        if theirs and ours and theirs != ours and any(
                isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in self.model.modules()):
            say(f"BatchNorm now normalises batches of {ours} samples, not {theirs} as in the run resumed "
                f"({state['world_size']} process(es) then, {self.fields['world_size']} now, --sync-bn "
                f"{'on' if self.fields['config']['dist']['sync_bn'] else 'off'}): the weights will differ "
                "from that run's straight through; --sync-bn normalises the whole batch on any count")
        return position
