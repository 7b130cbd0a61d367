"""Layers import one way (README, "The layout"): common (errors, output files), config, then data
and models (which take the keypoint layout, data.skeleton, from data and nothing else), then
runtime (checkpoint files, collectives), then engine, then inference and the entry scripts. A
module that imports a layer above its own, even inside a function, fails here. And the layers below the
engine (data, models, runtime) and inference receive their own part of the configuration (a
section, or a view of `config.views`), never the whole `Config`: a public function or method there
that takes one fails here."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SKELETON = "data.skeleton"  # the keypoint layout: data, and the heads and loss of models, follow it
ABOVE = {                   # package -> the packages it must never import
    "common": {"config", "data", SKELETON, "models", "runtime", "engine", "inference"},
    "config": {"data", SKELETON, "models", "runtime", "engine", "inference"},
    "data": {"runtime", "engine", "inference"},
    "models": {"data", "runtime", "engine", "inference"},
    "runtime": {"engine", "inference"},
    "engine": {"inference"},
    "inference": {"engine"},
}


def imported_packages(path: Path) -> set[str]:
    """The project's packages `path` imports; `data.skeleton` stands apart from the rest of data."""
    def package(module: str) -> str:
        return SKELETON if module == SKELETON or module.startswith(SKELETON + ".") else module.split(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(package(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(package(node.module))
    return found


@pytest.mark.parametrize("package", sorted(ABOVE))
def test_a_layer_imports_nothing_above_it(package):
    wrong = {f"{path.relative_to(ROOT)}: {sorted(imported_packages(path) & ABOVE[package])}"
             for path in sorted((ROOT / package).rglob("*.py")) if imported_packages(path) & ABOVE[package]}
    assert not wrong, wrong


# -- the layers below the engine, and inference, take their part of the config ----------------------
WHOLE_CONFIG = re.compile(r"\bConfig\b")         # the whole Config; InferenceConfig etc. do not match
READS_A_CHECKPOINT = {"inference/loading.py"}    # turns a file's saved whole config into the parts


def whole_config_parameters(source: str, name: str = "<source>") -> list[str]:
    """'function(parameter)' of each public function or method (nested ones included: they are
    returned as parts) with a parameter annotated as the whole `Config`, or an unannotated one
    named cfg or config."""
    found = []
    for node in ast.walk(ast.parse(source, name)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if node.name.startswith("_") and not (node.name.startswith("__") and node.name.endswith("__")):
            continue
        arguments = node.args
        for arg in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs,
                    *filter(None, [arguments.vararg, arguments.kwarg])]:
            annotation = ast.unparse(arg.annotation) if arg.annotation is not None else None
            if (WHOLE_CONFIG.search(annotation) if annotation is not None
                    else arg.arg in ("cfg", "config")):
                found.append(f"{node.name}({arg.arg})")
    return found


def test_the_check_finds_a_whole_config_parameter():
    assert whole_config_parameters("def f(x, cfg: Config): ...") == ["f(cfg)"]
    assert whole_config_parameters("class A:\n    def __init__(self, c: 'schema.Config | None'): ...\n"
                                   "    def _private(self, cfg: Config): ...") == ["__init__(c)"]
    assert whole_config_parameters("def g():\n    def evaluate(model, cfg): ...") == ["evaluate(cfg)"]
    assert whole_config_parameters("def f(settings: PredictSettings, inference: InferenceConfig): ...") == []


@pytest.mark.parametrize("package", ["data", "models", "runtime", "inference"])
def test_layers_below_the_engine_and_inference_take_their_part_of_the_config(package):
    wrong = {str(path.relative_to(ROOT)): found for path in sorted((ROOT / package).rglob("*.py"))
             if str(path.relative_to(ROOT)) not in READS_A_CHECKPOINT
             and (found := whole_config_parameters(path.read_text(), str(path)))}
    assert not wrong, wrong


def test_the_engines_public_functions_and_classes_have_one_name_each():
    """Two `check_backend` in engine/ (the registry's and apex_checks') read as one; the command-line
    modules' own `build_parser`, `main` and `run` are excepted."""
    where: dict[str, list[str]] = {}
    for path in sorted((ROOT / "engine").rglob("*.py")):
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_") \
                    and node.name not in ("build_parser", "main", "run"):
                where.setdefault(node.name, []).append(str(path.relative_to(ROOT)))
    assert not {name: paths for name, paths in where.items() if len(paths) > 1}
