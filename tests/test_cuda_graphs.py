"""`amp.cuda_graphs`: the network's training forward and backward replayed as CUDA graphs
(engine/build.py). On a CPU the capture is stood in by `graphed_stand_in`, which keeps
`torch.cuda.make_graphed_callables`' contract for a module: warm-up passes and a capture pass that
really run the network (so BatchNorm statistics move), then a `forward` set on the module that
replays only the captured input's shape, layout and type, and falls back to the module's own
forward in the other training mode. A run with graphs must train exactly as the eager run."""
from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_leaves

from common.errors import ConfigError
from config.schema import AmpConfig, OptimConfig
from engine.build import GraphedNetwork, ModelWithLoss, use_cuda_graphs
from engine.optim import OptimStep
from engine.precision import NativePrecision
from engine.trainer import Trainer, TrainParts
from models import FocalL2Loss
from runtime.distributed import DistContext


def graphed_stand_in(captures: list):
    def make_graphed(module, sample_args, num_warmup_iters=3):
        (sample,) = sample_args
        params = [p for p in module.parameters() if p.requires_grad]
        for _ in range(num_warmup_iters + 1):          # the warm-up passes and the capture's
            outputs = module(sample)
            torch.autograd.grad(sum(o.float().sum() for o in tree_leaves(outputs)), params, allow_unused=True)
        training, own_forward = module.training, module.forward
        captured = (sample.shape, sample.stride(), sample.dtype)

        def replay(x):
            if module.training != training:
                return own_forward(x)
            assert (x.shape, x.stride(), x.dtype) == captured, "a graph replays its captured input only"
            captures[-1]["replays"] += 1
            return own_forward(x)
        module.forward = replay
        captures.append({"shape": tuple(sample.shape), "replays": 0})
        return module
    return make_graphed


def train(tiny_cfg, inputs, graphs: list | None):
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
    trainer = Trainer(TrainParts(net, step, TrainParts.feed(inputs), batches_per_epoch=len(inputs)))
    seen.append(trainer.train_one_epoch(0))
    with torch.no_grad():
        net.eval()
        val = net(*inputs[0])[0]
    return seen, model.state_dict(), val


def test_a_run_with_graphs_trains_exactly_as_the_eager_run_and_replays_only_its_captured_input(tiny_cfg):
    torch.manual_seed(1)
    channels = 50                              # the coco skeleton's maps
    inputs = [(torch.rand(n, 3, 64, 64), torch.rand(n, channels, 16, 16) * 0.1, torch.ones(n, 1, 16, 16))
              for n in (2, 2, 2, 2, 2, 3)]     # a last batch of another size
    captures = []
    eager_losses, eager_state, eager_val = train(tiny_cfg, inputs, None)
    graph_losses, graph_state, graph_val = train(tiny_cfg, inputs, captures)
    assert captures == [{"shape": (2, 3, 64, 64), "replays": 2}]   # warm 3, captured at the 4th
    assert graph_losses == eager_losses
    for name, value in eager_state.items():    # weights and BatchNorm statistics alike
        assert torch.equal(graph_state[name], value), name
    assert torch.equal(graph_val, eager_val)   # eval runs the module's own forward


def test_cuda_graphs_are_used_where_they_can_be_and_refused_in_one_line_where_asked_and_impossible():
    class Launch:
        def __init__(self, device, mode="single"):
            self.ctx, self.mode = DistContext(device=torch.device(device)), mode

    assert use_cuda_graphs(AmpConfig(), Launch("cuda")) is True
    for amp, launch in [(AmpConfig(), Launch("cpu")), (AmpConfig(), Launch("cuda", "ddp")),
                        (AmpConfig(backend="apex"), Launch("cuda")), (AmpConfig(compile=True), Launch("cuda")),
                        (AmpConfig(cuda_graphs=False), Launch("cuda"))]:
        assert use_cuda_graphs(amp, launch) is False
    with pytest.raises(ConfigError, match=r"^option amp.cuda_graphs \(--cuda-graphs\): .* here the launch "
                                          r"mode is dataparallel; leave it at auto$"):
        use_cuda_graphs(AmpConfig(cuda_graphs=True), Launch("cuda", "dataparallel"))
