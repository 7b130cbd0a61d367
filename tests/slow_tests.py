"""Which tests start a process or train: conftest.py marks them `slow`, and fails any other test
that starts a process anyway.

A test is slow when its own code, a fixture it uses, or a helper either calls (functions and
modules of tests/, followed through every call, nested functions and lambdas included) refers to
`subprocess`, `multiprocessing` or `torch.multiprocessing`, to an entry script that trains
(`train`, `train_parallel`, `train_distributed`) or to a benchmark (`bench`), uses a class with
a `fit` method (the `Trainer`: built, it trains) or a function that returns one (`build_trainer`),
or runs code from text with `exec` (a documented example: it cannot be read here, so it counts as
slow). The names are read from the
compiled code, so a new test is classified as it is written; a process started by a test that was
not classified slow is reported by `process_guard` (conftest.py) as a failure of that test; such a
test (DataLoader workers started by the product's code from a config value) carries
`@pytest.mark.slow` itself.
"""
from __future__ import annotations

import builtins
import dis
import importlib
import inspect
import sys
import types
import typing
from pathlib import Path

TESTS = Path(__file__).resolve().parent
PROCESS_MODULES = ("subprocess", "multiprocessing", "torch.multiprocessing", "concurrent.futures.process")
TRAINING_MODULES = frozenset({"train", "train_parallel", "train_distributed"})
BENCHMARKS = "bench"             # the package of benchmarks: they train or infer over many steps
GUARD = "process_guard"          # conftest's autouse fixture that watches for processes


def _in_tests(obj) -> bool:
    try:
        return Path(inspect.getfile(obj)).resolve().is_relative_to(TESTS)
    except (TypeError, OSError):
        return False


def _module_name(obj) -> str | None:
    return obj.__name__ if isinstance(obj, types.ModuleType) else None


def _is_benchmark(module) -> bool:
    return isinstance(module, str) and (module == BENCHMARKS or module.startswith(BENCHMARKS + "."))


def _starts_processes(module) -> bool:
    return isinstance(module, str) and any(module == name or module.startswith(name + ".")
                                           for name in PROCESS_MODULES)


def _references(code: types.CodeType, namespace: dict):
    """(objects the code names: its globals and what it imports; attribute names it reads)."""
    objects, attributes, module = [], set(), None
    for ins in dis.get_instructions(code):
        if ins.opname == "IMPORT_NAME":
            module = ins.argval
            objects.append(("module", ins.argval))
        elif ins.opname == "IMPORT_FROM" and module:
            objects.append(("from", (module, ins.argval)))
        elif ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            found = namespace.get(ins.argval, getattr(builtins, ins.argval, None))
            if found is not None:
                objects.append(("object", found))
        elif ins.opname in ("LOAD_ATTR", "LOAD_METHOD"):
            attributes.add(ins.argval)
    return objects, attributes


def _resolve(kind: str, value):
    if kind == "object":
        return value
    name, attr = (value, None) if kind == "module" else value
    if _starts_processes(name) or name in TRAINING_MODULES or _is_benchmark(name):
        return name
    try:
        module = sys.modules.get(name) or importlib.import_module(name)
    except Exception:       # a module that does not import here is not one the test reaches
        return None
    return module if attr is None else getattr(module, attr, None)


def _returns_a_trainer(func) -> bool:
    """Whether `func` is annotated to return a class with a `fit` method (it builds a run, which
    also starts processes: git, for the run's environment.json)."""
    try:
        returned = typing.get_type_hints(func).get("return")
    except Exception:             # an annotation that does not resolve here
        return False
    return inspect.isclass(returned) and callable(getattr(returned, "fit", None))


class SlowCode:
    """Decides, once per function, whether code reaches a process start or training."""

    def __init__(self):
        self.seen: dict[types.CodeType, bool] = {}

    def function(self, func) -> bool:
        func = inspect.unwrap(getattr(func, "__func__", func))
        code = getattr(func, "__code__", None)
        return code is not None and self.code(code, func.__globals__)

    def code(self, code: types.CodeType, namespace: dict) -> bool:
        if code in self.seen:
            return self.seen[code]
        self.seen[code] = False          # a recursion meets "not (yet) slow"
        objects, attributes = _references(code, namespace)
        slow = any(self.reaches(_resolve(kind, value), attributes) for kind, value in objects) or any(
            self.code(const, namespace) for const in code.co_consts if isinstance(const, types.CodeType))
        self.seen[code] = slow
        return slow

    def reaches(self, obj, attributes: set) -> bool:
        if obj is None:
            return False
        if obj is exec:                  # code run from text (a documented example) cannot be read
            return True
        module = obj if isinstance(obj, str) else _module_name(obj)
        if _starts_processes(module) or module in TRAINING_MODULES or _is_benchmark(module):
            return True
        if _starts_processes(getattr(obj, "__module__", None)):        # Popen, Process, spawn, ...
            return True
        if inspect.isclass(obj) and callable(getattr(obj, "fit", None)):      # a trainer
            return True
        if inspect.isfunction(obj) and _returns_a_trainer(obj):             # build_trainer
            return True
        if module and _in_tests(obj):                                   # helpers used as module.attr
            return any(self.function(getattr(obj, attr)) for attr in attributes
                       if inspect.isfunction(getattr(obj, attr, None)) and _in_tests(getattr(obj, attr)))
        if (inspect.isfunction(obj) or inspect.ismethod(obj)) and _in_tests(obj):
            return self.function(obj)
        if inspect.isclass(obj) and _in_tests(obj):
            return any(self.function(member) for member in vars(obj).values() if inspect.isfunction(member))
        return False


def starts_processes_or_trains(item, judge: SlowCode) -> bool:
    """Whether the test `item`, or a fixture it uses, reaches a process start or training."""
    if judge.function(item.function):
        return True
    fixtures = getattr(item, "_fixtureinfo", None)
    for name, defs in (fixtures.name2fixturedefs.items() if fixtures else ()):
        if name != GUARD and any(judge.function(fixture.func) for fixture in defs if _in_tests(fixture.func)):
            return True
    return False

