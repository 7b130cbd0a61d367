"""Layers import one way (README, "The layout"): common (errors, output files), config, then data
and models (which take the keypoint layout, data.skeleton, from data and nothing else), then
runtime (checkpoint files, collectives), then engine, then inference and the entry scripts. A
module that imports a layer above its own, even inside a function, fails here. And the layers below the
engine (data, models, runtime) and inference receive their own part of the configuration (a
section, or a view of `config.views`), never the whole `Config`: a public function or method there
that takes one fails here. Inside the engine, the loop (trainer.py), the precision backends, the
parallel wrappers, the loaders and the logger import only what their role needs, and precision/
knows no parallelism."""
from __future__ import annotations

import ast
import re
import sys
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


def imported_modules(path: Path) -> set[str]:
    """The dotted names `path` imports, anywhere in it (`from a.b import c`: a.b and a.b.c)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.update([node.module, *(f"{node.module}.{alias.name}" for alias in node.names)])
    return found


def imported_packages(path: Path) -> set[str]:
    """The project's packages `path` imports; `data.skeleton` stands apart from the rest of data."""
    return {SKELETON if module == SKELETON or module.startswith(SKELETON + ".") else module.split(".")[0]
            for module in imported_modules(path)}


@pytest.mark.parametrize("package", sorted(ABOVE))
def test_a_layer_imports_nothing_above_it(package):
    wrong = {f"{path.relative_to(ROOT)}: {sorted(imported_packages(path) & ABOVE[package])}"
             for path in sorted((ROOT / package).rglob("*.py")) if imported_packages(path) & ABOVE[package]}
    assert not wrong, wrong


# -- inside the engine: the loop, precision, parallelism and the data feed stay apart --------------
ENGINE_RULES = {    # a file or folder of engine/ -> the project's modules it may import (and theirs)
    "trainer.py": {"common", "runtime"},          # the loop alone, run by whoever hands it its parts
    "precision/": {"common", "config", "runtime.launch_env", "runtime.environment", "engine.precision"},
    "parallel.py": {"config", "runtime"},         # SyncBN and DDP: no precision backend, no loop
    "loaders.py": {"common", "config", "data", "runtime"},   # the data feed knows no network
    "logger.py": {"common", "runtime"},
}
PARALLELISM = ("engine.parallel", "runtime.distributed", "torch.distributed", "torch.nn.parallel",
               "apex.parallel")


def engine_imports(rule: str) -> dict[str, set[str]]:
    """{file: the modules of the project it imports} for a rule's file or folder of engine/."""
    where = ROOT / "engine" / rule
    return {str(path.relative_to(ROOT)): {m for m in imported_modules(path) if m.split(".")[0] in ABOVE}
            for path in (sorted(where.rglob("*.py")) if rule.endswith("/") else [where])}


def outside(modules: set[str], allowed) -> list[str]:
    return sorted(m for m in modules if not any(m == a or m.startswith(a + ".") for a in allowed))


@pytest.mark.parametrize("rule", sorted(ENGINE_RULES))
def test_engine_files_import_only_what_their_role_needs(rule):
    wrong = {path: outside(found, ENGINE_RULES[rule]) for path, found in engine_imports(rule).items()}
    assert not {path: found for path, found in wrong.items() if found}


def test_precision_knows_no_parallelism():
    found = set().union(*map(imported_modules, (ROOT / "engine" / "precision").rglob("*.py")))
    assert not {m for m in found if m.startswith(PARALLELISM)}


def test_the_engine_rules_find_a_wrong_import(tmp_path, monkeypatch):
    (tmp_path / "engine" / "precision").mkdir(parents=True)
    (tmp_path / "engine" / "trainer.py").write_text("from engine.optim import OptimStep\nimport data.dataset")
    (tmp_path / "engine" / "precision" / "x.py").write_text("def f():\n    from runtime import distributed")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert outside(engine_imports("trainer.py")["engine/trainer.py"], ENGINE_RULES["trainer.py"]) == [
        "data.dataset", "engine.optim", "engine.optim.OptimStep"]
    with pytest.raises(AssertionError):
        test_precision_knows_no_parallelism()
    with pytest.raises(AssertionError):
        test_engine_files_import_only_what_their_role_needs("precision/")


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


def test_runtime_reads_and_writes_checkpoint_files_but_names_none_of_their_entries():
    """engine/checkpoints.py owns what a checkpoint holds (models/checkpoint_weights.py, the weights
    evaluation prefers); "model" stays one of the keys any file's weights may sit under."""
    from engine.checkpoints import RESUME_FIELDS, RESUME_OPTIONAL, TrainState
    from models.checkpoint_weights import EMA_KEY
    entries = {*RESUME_FIELDS, *RESUME_OPTIONAL, *TrainState.__dataclass_fields__, EMA_KEY, "global_step",
               "skeleton", "fresh_tensors", "decay", "updates", "best_metric"} - {"model"}
    named = {f"{path.relative_to(ROOT)}: {node.value!r}" for path in sorted((ROOT / "runtime").rglob("*.py"))
             for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Constant)
             and isinstance(node.value, str) and node.value in entries}
    assert not named, sorted(named)


def test_no_stand_in_of_a_test_takes_the_name_of_an_engine_class():
    """A test's own class named as one of the engine's (two `Launch`) reads as the engine's."""
    engine = {node.name for path in (ROOT / "engine").rglob("*.py")
              for node in ast.parse(path.read_text()).body if isinstance(node, ast.ClassDef)}
    taken = {f"{path.name}: {node.name}" for path in sorted((ROOT / "tests").glob("*.py"))
             for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)
             and node.name in engine}
    assert not taken, sorted(taken)
