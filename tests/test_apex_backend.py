"""The apex backend on a machine without Apex or CUDA: the one-line refusals, the loss
scaler state crossing between Apex's and GradScaler's layouts both ways, and the option reaching
the backend choice. Apex itself never runs here: its GPU checks are bench/gpu_smoke.py's apex
sections. The `apex` packages below are stand-ins written into tmp dirs, only to give the checks an
Apex without `amp`, one that fails to import, or one with `amp` on a machine without CUDA."""
from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from child_env import child_env
from common.errors import ConfigError
from config.loader import build_config
from config.schema import AmpConfig
from engine.cli import build_parser, config_from_args
from engine.precision import (NativePrecision as Precision, apex_checks as backend, build_precision,
                              check_backend)
from engine.precision.apex import ApexPrecision
from engine.precision.loss_scale import apex_amp_state, grad_scaler_fields

REPO = Path(__file__).resolve().parents[1]
APEX_STATE = {"loss_scaler0": {"loss_scale": 512.0, "unskipped": 37}}


def write_apex(root: Path, amp: bool = True, init: str = "") -> Path:
    """A stand-in `apex` package in `root`: with or without `amp` and `parallel`."""
    (root / "apex").mkdir(parents=True)
    (root / "apex" / "__init__.py").write_text(init)
    for name in ("amp", "parallel") if amp else ():
        (root / "apex" / name).mkdir()
        (root / "apex" / name / "__init__.py").write_text("")
    return root


@pytest.fixture
def apex_on_path(tmp_path, monkeypatch):
    """Put a stand-in apex first on sys.path (and forget any imported one afterwards)."""
    def install(**kwargs):
        monkeypatch.syspath_prepend(str(write_apex(tmp_path / "site", **kwargs)))
        importlib.invalidate_caches()
    for name in [m for m in sys.modules if m == "apex" or m.startswith("apex.")]:
        monkeypatch.delitem(sys.modules, name)
    yield install
    for name in [m for m in sys.modules if m == "apex" or m.startswith("apex.")]:
        del sys.modules[name]


def apex_config(*sets):
    return build_config("tiny", sets=["amp.backend=apex", "amp.opt_level=O1", "train.device=cpu", *sets])


def refusal(cfg) -> str:
    with pytest.raises(ConfigError) as err:
        check_backend(cfg)
    message = str(err.value)
    assert "\n" not in message
    return message


# -- point 2: refused in one line, before anything is built -----------------------------------------
def test_apex_not_installed_is_refused(monkeypatch):
    monkeypatch.setattr(backend.importlib.util, "find_spec", lambda name, *args: None)
    message = refusal(apex_config())
    assert "Apex is not installed" in message and "25.04" in message


def test_an_apex_without_amp_is_refused_naming_the_last_release_with_it(apex_on_path):
    apex_on_path(amp=False)
    message = refusal(apex_config())
    assert "no apex.amp" in message and "25.07" in message and "25.04 is the last release" in message


def test_an_apex_that_fails_to_import_is_refused_with_the_torch_version_and_its_error(apex_on_path):
    apex_on_path(init="import torch\ntorch.no_such_api_of_this_torch\n")
    message = refusal(apex_config())
    assert f"PyTorch {torch.__version__}" in message and "no_such_api_of_this_torch" in message


def test_a_torch_without_what_apex_patches_is_refused_naming_the_api(apex_on_path, monkeypatch):
    apex_on_path()
    monkeypatch.setattr(backend, "APEX_TORCH_NEEDS",
                        backend.APEX_TORCH_NEEDS + (("torch.cuda", "GoneTensor"),))
    message = refusal(apex_config())
    assert f"cannot patch PyTorch {torch.__version__}" in message and "torch.cuda.GoneTensor" in message


def test_this_torch_has_everything_apex_25_04_calls():
    assert backend.missing_torch_apis() == []


def test_apex_with_amp_but_no_cuda_is_refused(apex_on_path):
    apex_on_path()
    assert "runs on CUDA only" in refusal(apex_config())


@pytest.mark.parametrize("sets, words", [
    (["amp.dtype=bfloat16"], "float16 only"),
    (["amp.compile=true"], "--compile"),
    (["dist.zero=true", "amp.opt_level=O2"], "ZeroRedundancyOptimizer"),
    (["dist.zero=true", "amp.opt_level=O3"], "consolidate_state_dict"),
])
def test_combinations_apex_cannot_run_are_refused(sets, words):
    assert words in refusal(apex_config(*sets))


def test_dataparallel_over_gpus_is_refused_under_o2_and_o3_only():
    with pytest.raises(ConfigError, match="first GPU"):
        backend.check_data_parallel(apex_config("amp.opt_level=O2").amp, 2)
    backend.check_data_parallel(apex_config("amp.opt_level=O2").amp, 1)
    backend.check_data_parallel(apex_config("amp.opt_level=O1").amp, 4)


@pytest.mark.slow
def test_the_cli_refuses_in_one_line_before_the_run_directory_exists(tmp_path):
    site = write_apex(tmp_path / "site", amp=False)
    runs = tmp_path / "runs"
    proc = subprocess.run([sys.executable, "train.py", "--amp-backend", "apex", "--out-dir", str(runs),
                           "--run-name", "r", "--device", "cpu"], cwd=REPO, capture_output=True,
                          text=True, env=child_env(PYTHONPATH=str(site)), timeout=300)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --amp-backend apex:") and "25.04" in lines[0]
    assert not runs.exists()


# -- point 3: the loss scaler's state crosses backends -----------------------------------------------
def test_an_apex_amp_state_becomes_gradscaler_fields_and_back():
    fields = grad_scaler_fields(APEX_STATE)
    assert fields == {"scale": 512.0, "_growth_tracker": 37}
    assert apex_amp_state(fields) == APEX_STATE
    assert apex_amp_state(APEX_STATE) == APEX_STATE and grad_scaler_fields(fields) == fields
    assert grad_scaler_fields({}) == {} and apex_amp_state({}) == {} and grad_scaler_fields(None) == {}


def native_fp16() -> Precision:
    return Precision(AmpConfig(opt_level="O1", dtype="float16"), torch.device("cpu"))


def test_the_native_backend_resumes_an_apex_checkpoints_scale_and_writes_it_back():
    precision = native_fp16()
    precision.load_state_dict(APEX_STATE)                     # a checkpoint of the apex backend
    assert precision.scaler.get_scale() == 512.0 and precision.scaler._get_growth_tracker() == 37
    assert apex_amp_state(precision.state_dict()) == APEX_STATE   # what the apex backend will load


def test_the_apex_backend_loads_a_native_checkpoints_scale_as_apex_amp_state(apex_on_path, monkeypatch):
    apex_on_path()
    native = native_fp16()
    native.scaler.load_state_dict({**native.scaler.state_dict(), "scale": 2048.0, "_growth_tracker": 5})
    loaded = []
    amp = importlib.import_module("apex.amp")
    monkeypatch.setattr(amp, "load_state_dict", loaded.append, raising=False)
    apex = ApexPrecision(AmpConfig(opt_level="O1", dtype="float16"), torch.device("cpu"))
    apex.load_state_dict(native.state_dict())
    apex.load_state_dict({})                                  # a disabled scaler's: nothing to load
    assert loaded == [{"loss_scaler0": {"loss_scale": 2048.0, "unskipped": 5}}]


def test_o0_and_a_static_scale_keep_the_configs_scale(apex_on_path, monkeypatch):
    apex_on_path()
    loaded = []
    monkeypatch.setattr(importlib.import_module("apex.amp"), "load_state_dict", loaded.append, raising=False)
    for cfg in (AmpConfig(opt_level="O0"), AmpConfig(opt_level="O1", dtype="float16", loss_scale=128.0)):
        ApexPrecision(cfg, torch.device("cpu")).load_state_dict(APEX_STATE)
    assert loaded == []


# -- the option reaches the backend choice -----------------------------------------------------------
def test_amp_backend_flag_sets_the_config_and_native_is_the_default(capsys):
    parse = build_parser("test").parse_args
    assert config_from_args(parse([])).amp.backend == "native"
    with pytest.raises(ConfigError, match="--amp-backend apex"):
        config_from_args(parse(["--amp-backend", "apex", "--device", "cpu"]))
    with pytest.raises(SystemExit) as stop:                     # the field's choices are the flag's
        parse(["--amp-backend", "apx"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("error: argument --amp-backend") and err.count("\n") == 1


def test_build_precision_constructs_the_configured_backend(apex_on_path, monkeypatch):
    assert type(build_precision(AmpConfig(), torch.device("cpu"))) is Precision
    apex_on_path()
    with pytest.raises(ConfigError, match="CUDA only"):        # checked again where it is built
        build_precision(AmpConfig(backend="apex"), torch.device("cpu"))
    monkeypatch.setattr(backend, "_check_cuda", lambda device: None)
    precision = build_precision(AmpConfig(backend="apex", opt_level="O2"), torch.device("cpu"))
    assert type(precision).__name__ == "ApexPrecision" and precision.master_weights
    assert precision.describe().startswith("Apex amp O2")


# -- which Apex: the run's first lines name the build --------------------------------------------------
@pytest.mark.parametrize("extensions", [(), ("amp_C", "apex_C", "syncbn")])
def test_the_apex_backend_names_its_build_and_what_a_python_only_one_costs(apex_on_path, monkeypatch,
                                                                          extensions):
    apex_on_path()
    for name in ("amp_C", "apex_C", "syncbn"):
        if name in extensions:
            monkeypatch.setitem(sys.modules, name, type(sys)(name))
        else:
            monkeypatch.setitem(sys.modules, name, None)      # import fails, as without the build
    precision = ApexPrecision(AmpConfig(backend="apex", opt_level="O2"), torch.device("cpu"))
    text = precision.describe()
    if extensions:
        assert "with its CUDA extensions (amp_C, apex_C, syncbn)" in text and "Python-only" not in text
    else:
        assert "Python-only build (no amp_C, apex_C, syncbn)" in text
        assert "reads every gradient on the host" in text and "--cpp_ext --cuda_ext" in text
