"""Apex 25.04's own code on a CPU: the one place where its CUDA-only pieces are stood in, and the
marker of the tests that need it.

Apex is not on any registry; `.ci/run` unpacks `../shared/vendor/apex-25.04-python.tar.gz` (its
Python package, no compiled extension) into `vendor_local/apex-25.04` and puts it on PYTHONPATH.
Where it does not import, the `requires_apex` tests skip ("Apex not importable").

What runs is Apex's real code: `amp.initialize` (its checks, O2/O3's casting and patched forward,
its O2 state-dict hook, O2's master weights in `_process_optimizer`), O1's patching of torch's
functions (`amp.init`), `amp.scale_loss` and its Python loss scaler (overflow check, dynamic
scale, the patched skip of `optimizer.step`), `amp.state_dict`, `apex.parallel.convert_syncbn_model`
with its Python SyncBatchNorm, and `apex.parallel.DistributedDataParallel` over gloo. Stood in,
each as narrowly as its use allows (`install()`; `remove()` gives everything back):

1. `torch.cuda.IntTensor` makes a CPU IntTensor: Apex's loss scaler keeps its overflow flag in
   one, and its DDP broadcasts its bucket structure in one.
2. `torch.cuda.nvtx.range_push` / `range_pop` do nothing: profiler marks in Apex's Python
   SyncBatchNorm (a CPU build of torch raises on them).
3. `torch.cuda.current_stream()` gives a placeholder and `torch.cuda.stream(s)` a null context:
   Apex's DDP keeps its "main stream" and all-reduces inside `with torch.cuda.stream(main)`. That is
   its `delay_allreduce` path (one all-reduce after the backward), which the tests use; its
   overlapping path needs CUDA streams and events and is not stood in.
4. `Tensor.type()` called from Apex's own modules on a CPU tensor answers the CUDA type name
   (`torch.HalfTensor` -> `torch.cuda.HalfTensor`): Apex sorts parameters by these names (O2's
   master weights, DDP's buckets) and refuses any other. Calls from anywhere else are untouched.
5. Apex's `_amp_state.allow_incoming_model_not_fp32` is set: its own switch that skips the check
   refusing parameters off the GPU (the model it is given is float32 either way).
6. `Tensor.record_stream(s)` does nothing for that placeholder stream: Apex's DDP records its
   all-reduced bucket on its stream.
7. Apex's O1 casts (`apex.amp.utils.maybe_half` / `maybe_float`) cast CPU tensors too: Apex's
   own ones return any tensor that is not on CUDA as it is, so O1 would run in float32 here, and
   its cast cache, holding the uncast weight itself, fails its own parent check at the next
   lookup. With this, O1 runs in float16 on a CPU as it does on a GPU.
8. The engine's refusal of the apex backend without CUDA (`apex_checks._check_cuda`) passes.

`remove()` gives everything back and also undoes O1's patching of torch (Apex's
`handle._deactivate()`), as a new process would start without it. O2 and O3 need nothing more:
they cast the model to float16 without looking at its device.

Apex's compiled extensions, for the tests that ask for them (each a fixture; a CUDA build of Apex
has all three):

9. `syncbn` (`apex_syncbn_kernels`): the kernels of Apex's optimized SyncBatchNorm as CPU
   functions with their contracts (apex/csrc/syncbn.cpp, welford.cu): `welford_mean_var` gives the
   per-channel mean and biased variance over every dim but dim 1, `welford_mean_var_c_last` over
   every dim but the LAST; `welford_parallel` merges the ranks' [mean], [biased variance] and
   counts into the global mean, unbiased variance and 1 / sqrt(biased variance + eps); the
   forward kernels normalise along dim 1 (`_c_last`: the last dim); `reduce_bn(_c_last)` gives
   the local sums of dy and dy * (x - mean) and the weight and bias gradients; the backward
   kernels give the input gradient from the global sums and the ranks' counts. Statistics come
   in float32 for float16 inputs, outputs in the input's dtype. With it importable,
   `apex.parallel.SyncBatchNorm` is the optimized class (Apex decides when `apex.parallel` is
   first imported; the fixture swaps the class in for its test).
10. `amp_C.multi_tensor_scale` (`apex_amp_c`): dst = src * scale for each pair of tensors, each
   walked as data_ptr + numel, i.e. in MEMORY order (the CUDA launcher's view of any dense
   tensor); the no-op flag set where a value is not finite. Apex's DDP copies its all-reduced
   buffer back with it when `amp_C` imports.
11. `apex_C` (`apex_c`) is not stood in but BUILT: Apex's plain C++ extension (flatten and
   unflatten, the contract of torch._utils._flatten_dense_tensors / _unflatten_dense_tensors)
   compiled from tests/apex_C.cpp (written for this project: Apex's csrc is not in the vendored
   tarball) with torch.utils.cpp_extension, once per machine into a temporary directory named
   after the source and torch version (about 20 s on two cores; cached after). Apex's DDP then
   flattens and unflattens with it. Without a C++ compiler or ninja the test skips, saying so.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import os
import shutil
import sys
import tempfile
import types
import warnings
from pathlib import Path

import pytest
import torch


def apex_importable() -> bool:
    try:
        return importlib.util.find_spec("apex") is not None and \
            importlib.util.find_spec("apex.amp") is not None
    except Exception:          # noqa: BLE001 - a broken apex is not importable
        return False


def requires_apex(test):
    """The `apex` marker, and a skip ("Apex not importable") where Apex is not on the path."""
    return pytest.mark.apex(pytest.mark.skipif(not apex_importable(), reason="Apex not importable")(test))


class _Placeholder:
    """What `torch.cuda.current_stream()` gives: Apex only stores it and enters it."""


def _type_from_apex(real):
    def type_(self, *args, **kwargs):
        name = real(self, *args, **kwargs)
        if args or kwargs or not isinstance(name, str) or name.startswith("torch.cuda."):
            return name
        caller = sys._getframe(1).f_globals.get("__name__", "")
        return name.replace("torch.", "torch.cuda.", 1) if caller.startswith("apex.") else name
    return type_


def _record_stream(real):
    def record_stream(self, stream):
        return None if isinstance(stream, _Placeholder) else real(self, stream)
    return record_stream


def _cast_on_any_device(utils, to: str):
    """Apex's maybe_half / maybe_float (apex/amp/utils.py) without their `is_cuda` test."""
    def cast(x, name="", verbose=False):
        if utils.is_nested(x):
            return type(x)([cast(y) for y in x])
        if utils.type_string(x) == ("HalfTensor" if to == "half" else "FloatTensor"):
            return x
        return x.half() if to == "half" else x.float()
    return cast


_saved: list[tuple[object, str, object]] = []


def _set(owner, name, value) -> None:
    _saved.append((owner, name, getattr(owner, name, None)))
    setattr(owner, name, value)


def install() -> None:
    """Put the stand-ins in place (idempotent until `remove()`)."""
    if _saved:
        return
    _set(torch.cuda, "IntTensor", lambda data, device=None: torch.tensor(data, dtype=torch.int32))
    _set(torch.cuda.nvtx, "range_push", lambda *args, **kwargs: None)
    _set(torch.cuda.nvtx, "range_pop", lambda *args, **kwargs: None)
    _set(torch.cuda, "current_stream", lambda *args, **kwargs: _Placeholder())
    _set(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    _set(torch.Tensor, "type", _type_from_apex(torch.Tensor.type))
    _set(torch.Tensor, "record_stream", _record_stream(torch.Tensor.record_stream))
    from apex.amp import utils
    _set(utils, "maybe_half", _cast_on_any_device(utils, "half"))
    _set(utils, "maybe_float", _cast_on_any_device(utils, "float"))
    from apex.amp._amp_state import _amp_state
    from engine.precision import apex_checks
    _set(_amp_state, "allow_incoming_model_not_fp32", True)
    _set(apex_checks, "_check_cuda", lambda device: None)
    warnings.filterwarnings("ignore", message="An input tensor was not cuda")
    warnings.filterwarnings("ignore", message=".*is deprecated and will be removed")


def remove() -> None:
    """Everything back as it was, O1's patching of torch included."""
    from apex.amp._amp_state import _amp_state
    handle = getattr(_amp_state, "handle", None)
    if handle is not None and hasattr(handle, "_deactivate"):
        handle._deactivate()
        _amp_state.handle = None
    while _saved:
        owner, name, value = _saved.pop()
        setattr(owner, name, value)


@pytest.fixture
def apex_cpu():
    """The stand-ins for one test; Apex's `amp` module."""
    install()
    try:
        yield importlib.import_module("apex.amp")
    finally:
        remove()


# -- Apex's compiled extensions (9-11 of the module's doc) -------------------------------------------
def _channel_rows(x: torch.Tensor, channel_dim: int) -> torch.Tensor:
    """x as [values, channels] in float32: every dim but `channel_dim` flattened."""
    return x.movedim(channel_dim, -1).reshape(-1, x.shape[channel_dim]).float()


def _along(v: torch.Tensor, x: torch.Tensor, channel_dim: int) -> torch.Tensor:
    """A per-channel vector shaped to broadcast along `channel_dim` of x, in float32."""
    shape = [1] * x.dim()
    shape[channel_dim] = -1
    return v.float().reshape(shape)


def _syncbn_module() -> types.ModuleType:
    """Apex's `syncbn` extension, its kernels as CPU functions with their contracts (9.)."""
    def mean_var(x, channel_dim=1):
        var, mean = torch.var_mean(_channel_rows(x, channel_dim).double(), 0, correction=0)
        return mean.float(), var.float()

    def welford_parallel(means, biased_vars, counts, eps):
        n = counts.double()[:, None]
        mean = (means.double() * n).sum(0) / n.sum()
        m2 = ((biased_vars.double() + (means.double() - mean) ** 2) * n).sum(0)
        return mean.float(), (m2 / (n.sum() - 1)).float(), (m2 / n.sum() + eps).rsqrt().float()

    def forward(x, mean, inv_std, weight, shift, channel_dim=1, z=None, fuse_relu=False):
        y = (x.float() - _along(mean, x, channel_dim)) * _along(inv_std, x, channel_dim)
        y = y * _along(weight, x, channel_dim) if weight is not None else y
        y = y + _along(shift, x, channel_dim) if shift is not None else y
        y = y + z.float() if z is not None else y
        return (y.clamp_min(0) if fuse_relu else y).to(x.dtype)

    def reduce(dy, x, mean, inv_std, weight, channel_dim=1):
        rows = _channel_rows(dy, channel_dim)
        sum_dy, sum_dy_xmu = rows.sum(0), (rows * (_channel_rows(x, channel_dim) - mean.float())).sum(0)
        if weight is None:
            return sum_dy, sum_dy_xmu, None, None
        return sum_dy, sum_dy_xmu, (sum_dy_xmu * inv_std).to(weight.dtype), sum_dy.to(weight.dtype)

    def backward(dy, x, mean, inv_std, weight, sum_dy, sum_dy_xmu, counts, channel_dim=1):
        n = counts.double().sum().float()
        scale = inv_std.float() if weight is None else inv_std.float() * weight.float()
        xmu = x.float() - _along(mean, x, channel_dim)
        dx = (dy.float() - _along(sum_dy / n, x, channel_dim)
              - xmu * _along(inv_std.float() ** 2 * sum_dy_xmu / n, x, channel_dim))
        return (dx * _along(scale, x, channel_dim)).to(x.dtype)

    last = -1
    module = types.ModuleType("syncbn")
    module.welford_mean_var, module.welford_parallel = mean_var, welford_parallel
    module.batchnorm_forward, module.reduce_bn, module.batchnorm_backward = forward, reduce, backward
    module.welford_mean_var_c_last = lambda x: mean_var(x, last)
    module.batchnorm_forward_c_last = lambda x, z, mean, inv_std, weight, shift, fuse_relu: forward(
        x, mean, inv_std, weight, shift, last, z, fuse_relu)
    module.reduce_bn_c_last = lambda *args: reduce(*args, channel_dim=last)
    module.batchnorm_backward_c_last = lambda *args: backward(*args, channel_dim=last)
    return module


_OPTIMIZED = ("apex.parallel.optimized_sync_batchnorm", "apex.parallel.optimized_sync_batchnorm_kernel")


@pytest.fixture
def apex_syncbn_kernels(apex_cpu, monkeypatch):
    """`syncbn` stood in (9.), and `apex.parallel.SyncBatchNorm` Apex's optimized class."""
    monkeypatch.setitem(sys.modules, "syncbn", _syncbn_module())
    optimized = importlib.import_module(_OPTIMIZED[0])
    monkeypatch.setattr(sys.modules["apex.parallel"], "SyncBatchNorm", optimized.SyncBatchNorm)
    try:
        yield optimized.SyncBatchNorm
    finally:
        for name in _OPTIMIZED:          # imported with this stand-in: gone with it
            sys.modules.pop(name, None)


def _multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale):
    """amp_C.multi_tensor_scale on a CPU (10.): every tensor walked in memory order."""
    for src, dst in zip(*tensor_lists):
        values = src.as_strided((src.numel(),), (1,))
        if not torch.isfinite(values).all():
            noop_flag.fill_(1)
        dst.as_strided((dst.numel(),), (1,)).copy_(values * scale)


@pytest.fixture
def apex_amp_c(apex_cpu, monkeypatch):
    """`amp_C` with its `multi_tensor_scale` stood in (10.), and Apex's multi-tensor applier on."""
    from apex.multi_tensor_apply import MultiTensorApply, multi_tensor_applier
    amp_c = types.ModuleType("amp_C")
    amp_c.multi_tensor_scale = _multi_tensor_scale
    monkeypatch.setitem(sys.modules, "amp_C", amp_c)
    monkeypatch.setattr(MultiTensorApply, "available", True)
    monkeypatch.setattr(multi_tensor_applier, "chunk_size", 2048 * 32, raising=False)
    return amp_c


APEX_C_SOURCE = Path(__file__).resolve().with_name("apex_C.cpp")


@pytest.fixture(scope="session")
def apex_c_built():
    """Apex's `apex_C` built from tests/apex_C.cpp (11.), once per machine; a skip saying why
    where it cannot be built here."""
    from torch.utils.cpp_extension import is_ninja_available, load
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        pytest.skip(f"apex_C not built: no C++ compiler ({compiler}) on this machine")
    if not is_ninja_available():
        pytest.skip("apex_C not built: no ninja on this machine")
    digest = hashlib.sha256(APEX_C_SOURCE.read_bytes() + torch.__version__.encode()).hexdigest()[:12]
    build = Path(tempfile.gettempdir()) / f"apex_C-{digest}"
    build.mkdir(exist_ok=True)
    return load("apex_C", [str(APEX_C_SOURCE)], build_directory=str(build))


@pytest.fixture
def apex_c(apex_cpu, apex_c_built, monkeypatch):
    """Apex's DDP flattening with the built `apex_C` (its own import of it, at first use)."""
    distributed = importlib.import_module("apex.parallel.distributed")
    monkeypatch.setitem(sys.modules, "apex_C", apex_c_built)
    monkeypatch.setattr(distributed, "imported_flatten_impl", False)
    for name in ("flatten_impl", "unflatten_impl"):
        monkeypatch.setattr(distributed, name, None, raising=False)
    return apex_c_built


def run_module_with_standins(module: str, argv: list[str]) -> None:
    """A child process's entry: the stand-ins, then `module`'s main as `python -m module argv`.
    Each conversion to Apex's SyncBatchNorm prints how many layers it made ("apex SyncBatchNorm
    layers: N") for the test to read."""
    import runpy
    from pathlib import Path
    repo = str(Path(__file__).resolve().parents[1])
    if repo not in sys.path:
        sys.path.insert(0, repo)
    install()
    from engine import parallel
    convert = parallel.apex_sync_bn

    def counted(model):
        model = convert(model)
        made = [m for m in model.modules() if type(m).__module__.startswith(("apex.", parallel.__name__))
                and "SyncBatchNorm" in type(m).__name__]
        print(f"apex SyncBatchNorm layers: {len(made)}", flush=True)
        return model

    parallel.apex_sync_bn = counted
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__")


if __name__ == "__main__":          # python tests/apex_cpu_standins.py MODULE ARGS...
    run_module_with_standins(sys.argv[1], sys.argv[2:])
