"""Building a run's components apart from running them: `TrainerBuilder`, one method per component
in the engine's order (a subclass replaces any), and `ModelWithLoss`, what every launch mode wraps."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from common.errors import ConfigError, DataError, os_reason
from config.schema import AmpConfig, Config, DataConfig, LossConfig, ModelConfig, OptimConfig
from data.h5format import KeypointH5, check_split
from data.skeleton import Skeleton, skeleton_words
from config.views import SampleSettings
from runtime import distributed as dist
from engine.parallel import convert_sync_bn, wrap_ddp
from engine.cuda_graphs import GraphedNetwork, use_cuda_graphs
from engine.precision import PrecisionBackend, build_precision
from engine.freeze import freeze, trainable_parameters
from engine.optim import OptimStep, build_optimizer, peak_lr
from engine.loaders import train_loader
from engine.checkpoints import Start, load_start
from engine.validation import Validator


@dataclass
class Data:
    train_set: object
    loader: object
    sampler: object
    val_set: object | None
    train_h5: str
    val_h5: str | None

    @property
    def skeleton(self) -> Skeleton:      # the data's: heads, loss, checkpoints follow it
        return self.train_set.skeleton


@dataclass
class RunComponents:
    data: Data
    model: nn.Module            # the network, unwrapped, prepared for its precision
    precision: PrecisionBackend  # the precision backend
    optimizer: torch.optim.Optimizer
    optim_step: OptimStep
    net: nn.Module              # model and loss, wrapped for the launch mode: what trains
    eval_net: nn.Module         # what validates (eager, wrapped only under DataParallel)
    start: Start                # what the weights start from
    frozen: dict | None         # counts of freeze()


class TrainerBuilder:
    """The components of a run, each built once by its method, in `build`'s order."""

    def build_data(self, cfg: Config, ctx) -> Data:
        from data.dataset import KeypointDataset
        # the user's files, or the synthetic dataset made once; decided on rank 0
        train_h5, val_h5 = dist.decided_on_main(lambda: _resolve_data(cfg.data))
        if not cfg.data.train_h5 and not ctx.is_main:    # made, or found, on nodes without a shared cache
            train_h5, val_h5 = _resolve_data(cfg.data)
        # augmentation drawn per (seed, epoch, sample), not per rank: N processes train as one
        samples = SampleSettings.of(cfg)
        train_set = KeypointDataset(train_h5, samples, train=True, rank=0)
        loader, sampler = train_loader(train_set, cfg.data, cfg.train, ctx)
        val_set = KeypointDataset(val_h5, samples, train=False) if val_h5 else None
        if val_set is not None and val_set.skeleton != train_set.skeleton:
            theirs, ours = val_set.skeleton, train_set.skeleton
            raise DataError(f"--val-h5 {val_h5}: its skeleton ({skeleton_words(theirs, ours)}) is not "
                            f"that of --train-h5 {train_h5} ({skeleton_words(ours, theirs)}); convert "
                            "both with the same skeleton")
        return Data(train_set, loader, sampler, val_set, train_h5, val_h5)

    def build_model(self, cfg: ModelConfig, skeleton: Skeleton, seed: int) -> nn.Module:
        """The network, its initial weights drawn from `seed` (the same on every rank)."""
        from models import build_model
        torch.manual_seed(seed)
        return build_model(cfg, skeleton)

    def build_loss(self, cfg: LossConfig, skeleton: Skeleton) -> nn.Module:
        """`loss(outputs, target, mask)` -> (per-sample loss [B], dict of per-sample parts)."""
        from models import FocalL2Loss
        return FocalL2Loss(cfg, skeleton)

    def build_precision(self, cfg: AmpConfig, device, cudnn_benchmark: bool) -> PrecisionBackend:
        return build_precision(cfg, device, cudnn_benchmark)

    def build_optimizer(self, params: list, cfg: OptimConfig, zero: bool, device_type: str,
                        native: bool = True):
        return build_optimizer(params, cfg, zero=zero, device_type=device_type, native=native)

    def build_parallel(self, module: nn.Module, cfg: Config, launch, wrap: bool = False) -> nn.Module:
        """Before the network goes to its device, its BatchNorm made cross-process (`--sync-bn`); `wrap`:
        the network and loss in the backend's DDP, or in DataParallel over `launch.device_ids`."""
        if not wrap:
            return convert_sync_bn(module, launch.ctx, cfg.amp) if cfg.dist.sync_bn else module
        if launch.mode == "ddp":
            return wrap_ddp(module, launch.ctx, cfg.amp, cfg.dist)
        ids = launch.device_ids or []
        return nn.DataParallel(module, device_ids=ids) if len(ids) > 1 else module

    def build_validator(self, cfg: Config, ctx, built: RunComponents, evaluator=None, draw=None,
                        run_dir: Path | None = None) -> Validator | None:
        """The run's validation (None without a validation set), of the weights hooks swap in (EMA)."""
        return None if built.data.val_set is None else Validator(cfg, ctx, built.data, built.eval_net,
                                                                 built.model, evaluator, draw, run_dir)

    def build(self, cfg: Config, launch, plan=None, say=print) -> RunComponents:
        """All components, in order; `plan` (engine.run_dir.plan_run) says what the weights start from."""
        ctx = launch.ctx
        graphs = use_cuda_graphs(cfg.amp, launch)
        # no DataLoader pin thread under graphs (a capture forbids other threads' pinned allocations):
        # DeviceFeed pins in this thread, between steps
        data = self.build_data(replace(cfg, data=replace(cfg.data, pin_memory=False)) if graphs else cfg, ctx)
        model = self.build_model(cfg.model, data.skeleton, cfg.train.seed)
        start = load_start(model, plan, cfg.train, data.skeleton, say)
        frozen = freeze(model, cfg.train.freeze, start.fresh) if cfg.train.freeze else None
        if frozen and frozen["fresh"]:
            say(f"--freeze {' '.join(cfg.train.freeze)}: {len(frozen['fresh'])} of the tensors it names "
                f"start fresh (--allow-partial), so they stay trainable: {', '.join(frozen['fresh'])}")
        dist.seed_everything(cfg.train.seed, ctx.rank)
        model = self.build_parallel(model, cfg, launch).to(ctx.device)
        precision = self.build_precision(cfg.amp, ctx.device, cfg.train.cudnn_benchmark)
        model = precision.prepare_model(model)
        trainable = trainable_parameters(model)
        optimizer = self.build_optimizer(precision.optimizer_params(trainable), cfg.optim,
                                         cfg.dist.zero and ctx.distributed, ctx.device.type,
                                         cfg.amp.backend == "native")
        # before any wrapper (Apex's amp.initialize refuses a wrapped model); Apex O2: its masters
        model, optimizer = precision.attach(model, optimizer)
        params = precision.optimizer_params(trainable)
        loss = self.build_loss(cfg.loss, data.skeleton).to(ctx.device)
        model_with_loss = ModelWithLoss(torch.compile(model) if cfg.amp.compile else model, loss, precision,
                                        cuda_graphs=graphs)
        net = self.build_parallel(model_with_loss, cfg, launch, wrap=True)
        # validation runs eagerly: under --compile each of its shapes would compile for minutes
        eval_net = ModelWithLoss(model, loss, precision) if cfg.amp.compile else model_with_loss
        if launch.mode == "dataparallel":    # not through DDP's wrapper: each rank validates its shard
            eval_net = self.build_parallel(eval_net, cfg, launch, wrap=True)
        optim_step = OptimStep(precision, optimizer, params, model, cfg.optim, net=net,
                               static_graph=cfg.dist.static_graph, rounding_lr=peak_lr(
                                   cfg.optim, cfg.train.batch_size * cfg.train.accumulate, ctx.world_size))
        return RunComponents(data, model, precision, optimizer, optim_step, net, eval_net, start, frozen)


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
    from data.synthetic import ensure_synthetic_h5
    try:
        paths = ensure_synthetic_h5(data.synthetic_dir)
    except OSError as exc:
        raise ConfigError(f"option data.synthetic_dir {data.synthetic_dir}: cannot make the synthetic "
                          f"dataset there ({os_reason(exc)}); choose a writable folder") from None
    return str(paths[0]), str(paths[1])


class ModelWithLoss(nn.Module):
    def __init__(self, model: nn.Module, loss: nn.Module, precision, cuda_graphs: bool = False):
        super().__init__()
        self.model, self.loss, self.precision = model, loss, precision
        self.graphed = GraphedNetwork(model, precision) if cuda_graphs else None   # not a submodule

    def forward(self, images: torch.Tensor, target: torch.Tensor, mask: torch.Tensor):
        """-> (per-sample loss [B], dict of per-sample loss parts), all float32."""
        images = self.precision.cast_input(images)
        network = self.graphed if self.graphed is not None and self.training else self.model
        with self.precision.autocast_context():
            outputs = network(images)
        return self.loss(outputs, target, mask)
