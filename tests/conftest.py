"""Shared pytest fixtures (the real COCO sample directory, a small synthetic HDF5 dataset, the
bad-input tests' fixtures from tests/bad_inputs.py) and the `slow` mark of every test that starts a
process or trains; a test that takes many CPU-seconds in this process carries the mark itself."""
from __future__ import annotations

import multiprocessing.process
import subprocess
from pathlib import Path

import pytest
import torch

COCO4_DIR = Path(__file__).resolve().parent / "data" / "coco4"

pytest_plugins = ["bad_inputs"]        # the fixtures and checks of the bad-input tests


@pytest.fixture(scope="session")
def coco4_dir() -> Path:
    """`tests/data/coco4`: four real COCO val2017 images and `test_coco.json` (see its NOTICE.md)."""
    assert (COCO4_DIR / "test_coco.json").is_file(), f"missing test data {COCO4_DIR}"
    return COCO4_DIR


@pytest.fixture(scope="session")
def synthetic_h5(tmp_path_factory) -> tuple[Path, Path]:
    """(train.h5, val.h5) of a small synthetic dataset (made once per test session)."""
    from data.synthetic import ensure_synthetic_h5

    cache = tmp_path_factory.mktemp("synthetic")
    train, val = ensure_synthetic_h5(cache, train_images=24, val_images=8)
    return Path(train), Path(val)


@pytest.fixture(scope="module")
def tiny_cfg():
    """The `tiny` preset's config."""
    from config import build_config

    return build_config("tiny")


@pytest.fixture(scope="module")
def tiny_model(tiny_cfg):
    """The tiny preset's COCO network as built from seed 0, in training mode."""
    from data.skeleton import builtin
    from models import build_model

    torch.manual_seed(0)
    return build_model(tiny_cfg.model, builtin("coco"))


@pytest.fixture(scope="module")
def tiny_network(tiny_cfg):
    """The tiny COCO network from seed 0 with weights of std 0.05, in eval mode: its maps are far
    from constant, so tests of flips, grouping and drawing can fail."""
    from data.skeleton import builtin
    from models import build_model

    torch.manual_seed(0)
    model = build_model(tiny_cfg.model, builtin("coco"))
    model.reset_parameters(0.05)
    return model.eval()


def pytest_collection_modifyitems(config, items):
    """Mark `slow` every test that starts a process or trains (tests/slow_tests.py says how)."""
    from slow_tests import SlowCode, starts_processes_or_trains

    judge = SlowCode()
    for item in items:
        if "slow" not in item.keywords and starts_processes_or_trains(item, judge):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def process_guard(request, monkeypatch):
    """A test not marked `slow` that starts a process fails: tests/slow_tests.py missed how it does."""
    if "slow" in request.keywords:
        yield
        return
    started = []
    for cls, method in ((subprocess.Popen, "_execute_child"), (multiprocessing.process.BaseProcess, "start")):
        original = getattr(cls, method)

        def record(*args, _original=original, **kwargs):
            started.append(args[0])
            return _original(*args, **kwargs)
        monkeypatch.setattr(cls, method, record)
    yield
    assert not started, (f"{request.node.nodeid} started a process ({started[0]!r}) but is not marked slow; "
                         "teach tests/slow_tests.py how it starts one")
