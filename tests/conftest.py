"""Shared pytest fixtures (the real COCO sample directory, a small synthetic HDF5 dataset, the
bad-input tests' fixtures from tests/bad_inputs.py) and the guard of the fast tier: a test not
marked `slow` fails when it, or a fixture it sets up, starts a process."""
from __future__ import annotations

import compileall
import contextlib
import multiprocessing.process
import os
import re
import subprocess
from pathlib import Path

import matplotlib.font_manager  # noqa: F401  (builds the font cache, with `fc-list`, before any test)
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
COCO4_DIR = REPO / "tests" / "data" / "coco4"

# One thread in this process and in those it starts (tests/child_env.py says so too): the tests'
# tensors are small, and two threads of them on a busy machine mostly wait for each other.
torch.set_num_threads(1)
os.environ["OMP_NUM_THREADS"] = "1"

pytest_plugins = ["bad_inputs"]        # the fixtures and checks of the bad-input tests


def pytest_configure(config):
    """Byte-compile the repository once, in the controller, before any test starts a process:
    where PYTHONDONTWRITEBYTECODE is set (as on this project's machines) each process the tests
    start would otherwise compile every module it imports again, about 0.3 s of CPU each."""
    if not hasattr(config, "workerinput"):
        compileall.compile_dir(REPO, quiet=1, rx=re.compile(r"/\.|/checkpoints/"))


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


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`-n 3` (pytest-xdist, the README's command): a module's tests run on one worker, which sets
    its module fixtures up once; so do the modules that read the bad-input table (tests/bad_inputs.py),
    a session fixture of 22 processes. (xdist's own `--dist loadgroup` reads groups from node ids,
    which pytest 9 no longer lets a plugin change.)"""
    if config.getvalue("dist") != "load":          # another --dist asked for: xdist's own
        return None
    from xdist.scheduler import LoadScopeScheduling
    from bad_inputs import TABLE_ROWS

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::")[0]
            return "bad-input table" if Path(module).stem in TABLE_ROWS else module
    return ByModule(config, log)


def pytest_collection_modifyitems(items):
    """The table's readers are the modules named in TABLE_ROWS: elsewhere a worker would run it again."""
    from bad_inputs import TABLE_ROWS
    strays = [item.nodeid for item in items if "table" in item.fixturenames
              and item.module.__name__ not in TABLE_ROWS]
    if strays:
        raise pytest.UsageError(f"{strays[0]} reads the bad-input table: name its module in TABLE_ROWS")


@contextlib.contextmanager
def _processes_started():
    """The list of the processes (subprocess or multiprocessing) started inside the block, but for
    `git`: a run asks it for the commit it records (runtime/environment.py), in milliseconds."""
    started, originals = [], []
    for cls, method in ((subprocess.Popen, "_execute_child"), (multiprocessing.process.BaseProcess, "start")):
        original = getattr(cls, method)
        originals.append((cls, method, original))

        def record(*args, _original=original, **kwargs):
            what = args[1] if len(args) > 1 else args[0]          # Popen's command, or the Process
            if not (isinstance(what, (list, tuple)) and what[:1] == ["git"]):
                started.append(what)
            return _original(*args, **kwargs)
        setattr(cls, method, record)
    try:
        yield started
    finally:
        for cls, method, original in originals:
            setattr(cls, method, original)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _fast_only(item, "its fixtures"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _fast_only(item, "it"))


def _fast_only(item, who: str):
    """A test not marked `slow` fails when it, or a fixture it sets up, starts a process."""
    if item.get_closest_marker("slow"):
        return (yield)
    with _processes_started() as started:
        result = yield
    assert not started, (f"{item.nodeid}: {who} started a process ({started[0]!r}); a test that starts "
                         "processes is marked @pytest.mark.slow")
    return result
