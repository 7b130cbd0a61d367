"""Layers import one way (README, "The layout"): config, then data and models, then runtime
(checkpoint files, collectives), then engine, then inference and the entry scripts. A module that
imports a layer above its own, even inside a function, fails here."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ABOVE = {                   # package -> the packages it must never import
    "config": {"data", "models", "runtime", "engine", "inference"},
    "data": {"runtime", "engine", "inference"},
    "models": {"data", "runtime", "engine", "inference"},
    "runtime": {"engine", "inference"},
    "engine": {"inference"},
    "inference": {"engine"},
}


def imported_packages(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("package", sorted(ABOVE))
def test_a_layer_imports_nothing_above_it(package):
    wrong = {f"{path.relative_to(ROOT)}: {sorted(imported_packages(path) & ABOVE[package])}"
             for path in sorted((ROOT / package).rglob("*.py")) if imported_packages(path) & ABOVE[package]}
    assert not wrong, wrong
