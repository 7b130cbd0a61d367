"""Continuing the authors' training run: their checkpoint as a resume state of this trainer.

A training checkpoint of the reference holds, besides the weights, its SGD state by parameter
index (`optimizer_weight`), the 0-based `epoch` it finished (their script restarts at epoch + 1)
and, in the successor project, an Apex `amp` state. `resume_state` turns these into what
`engine.train_state.restore` reads from one of our checkpoints: momentum buffers keyed by the index of our
optimiser's parameters (mapped by name through `models.reference`), the loss scale and the
steps since the last overflow as GradScaler fields, the next epoch at its first batch. The LR is
not taken from the file: it is a function of (epoch, batch), so the run continues on the curve.
`convert` writes the whole as a checkpoint file (`python -m engine.convert_reference`).
"""
from __future__ import annotations

from common.errors import CheckpointError, ConfigError
from config.loader import to_dict
from config.schema import Config, OptimConfig
from runtime.checkpoint import load_weights, read_reference, save_checkpoint
from engine.precision.loss_scale import grad_scaler_fields
from models.reference import momentum_by_name


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
    reference = read_reference(source)
    model = build_model(cfg.model, coco)
    load_weights(model, reference)
    names = [name for name, _ in model.named_parameters()]
    optimizer = build_optimizer(model.parameters(), cfg.optim)
    state = resume_state(reference, source, model, optimizer, names, cfg.optim, cfg.model.depth,
                         strict=False)
    state.update(model=model.state_dict(), config=to_dict(cfg), best_metric=None, skeleton=coco.to_spec())
    save_checkpoint(out, state)
    return state
