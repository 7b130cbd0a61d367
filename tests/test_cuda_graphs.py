"""`amp.cuda_graphs`: the network's training forward and backward replayed as CUDA graphs
(engine/cuda_graphs.py). On a CPU the capture is stood in by `graphed_stand_in`, which keeps
`torch.cuda.make_graphed_callables`' contract for a module (torch/cuda/graphs.py): warm-up passes
and a capture pass that really run the network (so BatchNorm statistics move), then a `forward` set
on the module that replays only the captured input's shape, layout and type, and falls back to the
module's own forward in the other training mode; a replay returns detached views of its static
outputs, and its backward hands the parameters detached views of the SAME static gradient buffers
at every replay. While it captures, pinned memory allocated by another thread fails it, as CUDA's
global capture mode does. A run with graphs must train exactly as the eager run."""
from __future__ import annotations

import threading
import time

import pytest
import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from common.errors import ConfigError
from config.schema import AmpConfig, OptimConfig
from engine.build import ModelWithLoss, TrainerBuilder
from engine.cuda_graphs import GraphedNetwork, use_cuda_graphs
from engine.loaders import to_model_input
from engine.optim import OptimStep
from engine.precision import NativePrecision
from engine.trainer import Trainer, LoopInputs
from models import FocalL2Loss
from runtime.distributed import DistContext

PINNED_BY = []             # (thread, capturing) of each pinned allocation, `pinning_stand_in`'s
CAPTURING = threading.Event()


def graphed_stand_in(captures: list, capture_s: float = 0.0):
    def make_graphed(module, sample_args, num_warmup_iters=3):
        (static_in,) = sample_args                 # torch keeps the sample itself as the static input
        CAPTURING.set()
        params = tuple(module.parameters())
        trained = [p for p in params if p.requires_grad]
        for _ in range(num_warmup_iters + 1):      # the warm-up passes and the capture's
            outputs, spec = tree_flatten(module(static_in))
            torch.autograd.grad(outputs, trained, [torch.zeros_like(o) for o in outputs], allow_unused=True)
        deadline = time.monotonic() + capture_s    # a capture that lasts: other threads go on meanwhile
        while time.monotonic() < deadline and not any(capturing for _, capturing in PINNED_BY):
            time.sleep(0.01)
        CAPTURING.clear()
        static_out = [o.detach().clone() for o in outputs]
        static_grads = [torch.zeros_like(p) for p in trained]
        kept = {}
        captured = (static_in.shape, static_in.stride(), static_in.dtype)

        class Replayed(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, *weights):
                assert (x.shape, x.stride(), x.dtype) == captured, "a graph replays its captured input only"
                if x.data_ptr() != static_in.data_ptr():
                    static_in.copy_(x)
                with torch.enable_grad():          # the forward graph's replay
                    kept["outputs"] = tree_flatten(type(module).forward(module, static_in))[0]
                for static, out in zip(static_out, kept["outputs"]):
                    static.copy_(out.detach())
                captures[-1]["replays"] += 1
                return tuple(o.detach() for o in static_out)

            @staticmethod
            @torch.autograd.function.once_differentiable
            def backward(ctx, *grads):             # the backward graph's replay into its static buffers
                found = torch.autograd.grad(kept["outputs"], trained, grads, allow_unused=True)
                for static, grad in zip(static_grads, found):
                    static.copy_(grad if grad is not None else torch.zeros_like(static))
                each = iter(static_grads)
                return (None,) + tuple(next(each).detach() if p.requires_grad else None for p in params)

        training, own_forward = module.training, module.forward

        def replay(x):
            if module.training != training:
                return own_forward(x)
            return tree_unflatten(list(Replayed.apply(x, *params)), spec)
        module.forward = replay
        captures.append({"shape": tuple(static_in.shape), "replays": 0})
        return module
    return make_graphed


def train(tiny_cfg, inputs, graphs: list | None, accumulate: int = 1):
    from data.skeleton import builtin
    from models import build_model
    torch.manual_seed(0)
    model = build_model(tiny_cfg.model, builtin("coco"))
    precision = NativePrecision(AmpConfig(), torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = OptimStep(precision, optimizer, list(model.parameters()), model, OptimConfig())
    net = ModelWithLoss(model, FocalL2Loss(tiny_cfg.loss, builtin("coco")), precision)
    if graphs is not None:
        net.graphed = GraphedNetwork(model, precision, make_graphed=graphed_stand_in(graphs))
    seen = []
    trainer = Trainer(LoopInputs(net, step, LoopInputs.feed(inputs), batches_per_epoch=len(inputs),
                                 accumulate=accumulate))
    seen.append(trainer.train_one_epoch(0))
    with torch.no_grad():
        net.eval()
        val = net(*inputs[0])[0]
    return seen, model.state_dict(), val


@pytest.mark.slow
@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_run_with_graphs_trains_exactly_as_the_eager_run_and_replays_only_its_captured_input(
        tiny_cfg, accumulate):
    torch.manual_seed(1)
    channels = 50                              # the coco skeleton's maps
    inputs = [(torch.rand(n, 3, 64, 64), torch.rand(n, channels, 16, 16) * 0.1, torch.ones(n, 1, 16, 16))
              for n in (2,) * 8 + (3, 3)]      # last batches of another size
    captures = []
    eager_losses, eager_state, eager_val = train(tiny_cfg, inputs, None, accumulate)
    graph_losses, graph_state, graph_val = train(tiny_cfg, inputs, captures, accumulate)
    assert captures == [{"shape": (2, 3, 64, 64), "replays": 5}]   # warm 3, captured at the 4th
    assert graph_losses == eager_losses
    for name, value in eager_state.items():    # weights and BatchNorm statistics alike
        assert torch.equal(graph_state[name], value), name
    assert torch.equal(graph_val, eager_val)   # eval runs the module's own forward


def test_cuda_graphs_are_used_where_they_can_be_and_refused_in_one_line_where_asked_and_impossible():
    class LaunchOn:
        def __init__(self, device, mode="single"):
            self.ctx, self.mode = DistContext(device=torch.device(device)), mode

    assert use_cuda_graphs(AmpConfig(), LaunchOn("cuda")) is True
    for amp, launch in [(AmpConfig(), LaunchOn("cpu")), (AmpConfig(), LaunchOn("cuda", "ddp")),
                        (AmpConfig(backend="apex"), LaunchOn("cuda")),
                        (AmpConfig(compile=True), LaunchOn("cuda")),
                        (AmpConfig(cuda_graphs=False), LaunchOn("cuda"))]:
        assert use_cuda_graphs(amp, launch) is False
    with pytest.raises(ConfigError, match=r"^option amp.cuda_graphs \(--cuda-graphs\): .* here the launch "
                                          r"mode is dataparallel; leave it at auto$"):
        use_cuda_graphs(AmpConfig(cuda_graphs=True), LaunchOn("cuda", "dataparallel"))


@pytest.mark.slow
def test_no_capture_meets_pinned_memory_allocated_by_the_dataloaders_thread(tiny_cfg, synthetic_h5, monkeypatch):
    from dataclasses import replace
    from torch.utils.data._utils import pin_memory as pinning
    # a CUDA machine as the DataLoader sees it, its pinning stood in: who pins, and during a capture?
    for name, value in (("is_available", lambda: True), ("current_device_index", lambda: 0),
                        ("current_accelerator", lambda *args: torch.device("cuda")),
                        ("set_device_index", lambda index: None)):
        monkeypatch.setattr(torch.accelerator, name, value)
    monkeypatch.setattr(pinning, "pin_memory", lambda data, device=None: PINNED_BY.append(
        (threading.current_thread(), CAPTURING.is_set())) or data)
    PINNED_BY.clear()

    class Built(Exception):
        pass

    class Builder(TrainerBuilder):          # the run's data as the builder makes it, then no further
        def build_data(self, cfg, ctx):
            raise Built(super().build_data(cfg, ctx))

    class CudaLaunch:
        ctx, mode = DistContext(device=torch.device("cuda")), "single"

    cfg = replace(tiny_cfg, data=replace(tiny_cfg.data, train_h5=str(synthetic_h5[0]), val_h5="", workers=2,
                                         input_size=64), train=replace(tiny_cfg.train, batch_size=2))
    with pytest.raises(Built) as built:
        Builder().build(cfg, CudaLaunch())
    data = built.value.args[0]
    from models import build_model
    torch.manual_seed(0)
    model = build_model(cfg.model, data.skeleton)
    precision = NativePrecision(AmpConfig(), torch.device("cpu"))
    step = OptimStep(precision, torch.optim.SGD(model.parameters(), lr=0.01), list(model.parameters()), model,
                     OptimConfig())
    net = ModelWithLoss(model, FocalL2Loss(cfg.loss, data.skeleton), precision)
    captures = []
    net.graphed = GraphedNetwork(model, precision, make_graphed=graphed_stand_in(captures, capture_s=3.0))
    painter = data.train_set.painter_for(torch.device("cpu"))
    feed = lambda epoch, start: (to_model_input(b, torch.device("cpu"), painter) for b in data.loader)  # noqa: E731
    try:
        Trainer(LoopInputs(net, step, feed, batches_per_epoch=6)).train_one_epoch(0)
    finally:
        data.loader.close()
    assert captures and captures[0]["replays"] == 3
    assert [thread.name for thread, capturing in PINNED_BY if capturing] == []
