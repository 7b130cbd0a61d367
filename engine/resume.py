"""Where a run's weights start from, and what it continues: a `CheckpointReader`, made by the entry
script and handed to the command line (`engine.cli.config_from_args`) and to `build_trainer`,
scans a run directory for `--resume auto` and reads a checkpoint once for both; `load_start` puts
the weights a run starts from (resume, the authors' run, --weights) into the model;
engine/train_state.py restores the rest once the optimiser exists.

Continuing the authors' training run: a training checkpoint of the reference holds, besides the
weights, its SGD state by parameter index (`optimizer_weight`), the 0-based `epoch` it finished
(their script restarts at epoch + 1) and, in the successor project, an Apex `amp` state.
`resume_state` turns these into what `Checkpoints.restore` reads from one of our checkpoints:
momentum buffers keyed by the index of our optimiser's parameters (mapped by name through
`models.reference`), the loss scale and the steps since the last overflow as GradScaler fields, the
next epoch at its first batch. The LR is not taken from the file: it is a function of (epoch,
batch), so the run continues on the curve. `convert` writes the whole as a checkpoint file
(`python -m engine.convert_reference`).
"""
from __future__ import annotations

from pathlib import Path

from common.errors import CheckpointError, ConfigError
from config.loader import to_dict
from config.schema import Config, OptimConfig, TrainConfig
from data.skeleton import Skeleton, from_checkpoint
from data.skeleton_words import skeleton_words
from models.reference import momentum_by_name
from runtime import checkpoint as ckpt
from engine.precision.loss_scale import grad_scaler_fields
from engine.train_state import check_resumable


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


def load_start(model, plan, train: TrainConfig, skeleton: Skeleton, say) -> tuple:
    """Load the weights the run starts from into `model`; returns (resume state or None, the
    authors' checkpoint whose run continues or None, its path, the names of the tensors that
    --allow-partial left fresh). Without a `plan` (`engine.run_dir.RunPlan`: parts built outside a
    run): --weights only."""
    if plan is not None and plan.resume_path is not None:
        for option, path in (("--weights", train.weights), ("--resume-reference", train.resume_reference)):
            if path:
                say(f"{option} {path} not loaded: --resume auto continues the run from {plan.resume_path}")
        state = plan.reader.state(plan.resume_path)
        check_resumable(state, plan.resume_path)
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


def _param_groups(optimizer) -> list[dict]:
    """`optimizer.state_dict()["param_groups"]` without asking the optimiser for its state."""
    groups, start = [], 0
    for group in optimizer.param_groups:
        count = len(group["params"])
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": list(range(start, start + count))})
        start += count
    return groups


def resume_state(reference: dict, source: str, model, optimizer, names: list[str], optim: OptimConfig,
                 depth: int, strict: bool = True) -> dict:
    """The resume state of `reference` (a file of the authors' layout, already loaded into `model`,
    an hourglass of `depth` levels) for `optimizer`, whose parameters are `model`'s parameters
    `names`, in that order. Another optimiser than SGD with momentum (`optim`) is refused when
    `strict`, else it starts without momentum."""
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
    return {"optimizer": {"state": state, "param_groups": _param_groups(optimizer)}, "scaler": scaler,
            "epoch": epoch + 1 if isinstance(epoch, int) else 0, "iteration": 0, "step": None,
            "origin": origin}


def convert(source: str, out: str, cfg: Config) -> dict:
    """Write `source` (the authors' layout) as a checkpoint of this trainer at `out`, its config
    `cfg` included: weights, momentum, loss scale, and the epoch to continue at."""
    from data.skeleton import builtin
    from engine.optim import build_optimizer
    from models import build_model

    coco = builtin("coco")          # the authors trained on COCO persons
    reference = ckpt.read_reference(source)
    model = build_model(cfg.model, coco)
    ckpt.load_weights(model, reference)
    names = [name for name, _ in model.named_parameters()]
    optimizer = build_optimizer(model.parameters(), cfg.optim)
    state = resume_state(reference, source, model, optimizer, names, cfg.optim, cfg.model.depth,
                         strict=False)
    state.update(model=model.state_dict(), config=to_dict(cfg), skeleton=coco.to_spec())
    ckpt.save_checkpoint(out, state)
    return state
