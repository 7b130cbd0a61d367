"""Shared pytest fixtures: the real COCO sample directory and a small synthetic HDF5 dataset."""
from __future__ import annotations

from pathlib import Path

import pytest

COCO4_DIR = Path(__file__).resolve().parent / "data" / "coco4"


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
