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
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import warnings

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
    _set(torch.cuda, "IntTensor", lambda data: torch.tensor(data, dtype=torch.int32))
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
    from engine.precision import apex_parallel
    convert = apex_parallel.convert_sync_bn

    def counted(model, channels_last):
        model = convert(model, channels_last)
        made = [m for m in model.modules() if type(m).__module__.startswith(("apex.", apex_parallel.__name__))
                and "SyncBatchNorm" in type(m).__name__]
        print(f"apex SyncBatchNorm layers: {len(made)}", flush=True)
        return model

    apex_parallel.convert_sync_bn = counted
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__")


if __name__ == "__main__":          # python tests/apex_cpu_standins.py MODULE ARGS...
    run_module_with_standins(sys.argv[1], sys.argv[2:])
