"""Where a run's weights start from, and what it continues: a `CheckpointReader` (made by the entry
script) finds the checkpoint of `--resume auto` and reads it once; `load_start` loads the starting
weights (resume, the authors' run, --weights); engine/train_state.py restores the rest.

`resume_state` continues the authors' training run: their SGD state by parameter index (mapped
by name through `models.reference`), the loss scale and the next epoch; the LR follows from
(epoch, batch). `convert` writes it as a checkpoint (`python -m engine.convert_reference`).
"""
from __future__ import annotations

from pathlib import Path

from common.errors import CheckpointError, ConfigError
from config.loader import to_dict
from config.schema import Config, OptimConfig, TrainConfig
from data.skeleton import Skeleton, from_checkpoint, skeleton_words
from models.reference import momentum_by_name
from runtime import checkpoint as ckpt
from engine.precision.loss_scale import grad_scaler_fields
from engine.train_state import check_resumable


class CheckpointReader:
    """Reads a checkpoint, and finds a run's latest, once while the files stay the same."""

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
    """Load the weights the run starts from into `model`; returns (resume state, the authors'
    checkpoint whose run continues, its path, the tensors --allow-partial left fresh). Without a
    `plan`: --weights only."""
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
    """The tensors a `load_weights` report left at their initial values."""
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
    """The resume state of `reference` (the authors' layout, loaded into `model`) for `optimizer`
    over `model`'s parameters `names`. An optimiser other than SGD with momentum is refused when
    `strict`, else starts without momentum."""
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
    """Write `source` (the authors' layout) as a checkpoint of this trainer at `out`."""
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
