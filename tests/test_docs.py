"""What README.md and docs/*.md say about the code, checked against it: every command they show
parses with its own script's parser (nothing runs), every option they name is an option of one of
the project's commands, every config key they name is a field, every dotted name of the code they
name (`inference.predict.MAX_ASPECT`) and every file of the repository they name exists; and
bench/RESULTS.md, which they cite, stays short and names files that exist."""
from __future__ import annotations

import argparse
import importlib
import re
import shlex
import sys
from pathlib import Path

import pytest

from bench.helpers import run_entry
from config.schema import Config, declared

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SCRIPTS = ["train", "train_parallel", "train_distributed", "evaluate", "demo", "export",
           "data.make_hdf5", "data.synthetic", "data.preview", "models.summary", "engine.convert_reference",
           "bench.train_throughput", "bench.data_pipeline", "bench.grouping", "bench.inference",
           "bench.dataset_flows", "bench.gpu_smoke", "bench.group_of_one"]
# options of other programs the docs show: launchers, pip, pytest, git
FOREIGN = {"--nproc_per_node", "--nnodes", "--node_rank", "--master_addr", "--master_port", "--max-restarts",
           "--standalone", "--ntasks-per-node", "--gpus-per-task", "--disable-pip-version-check",
           "--no-cache-dir", "--no-build-isolation", "--config-settings", "--global-option", "--build-option",
           "--cpp_ext", "--cuda_ext", "--isolated", "--no-deps", "--only-binary", "--python-version",
           "--implementation", "--platform", "--no-index", "--target",
           "--bogus"}    # docs/bad-input.md's unknown option
APEX = {"amp.initialize", "amp.scale_loss", "amp.master_params", "amp.state_dict"}   # Apex's, not keys
CODE = ("common", "config", "data", "models", "runtime", "engine", "inference")
FILE_ENDINGS = ("py", "md", "yaml", "sh", "json", "jsonl", "log", "h5", "pth", "png", "onnx", "lock", "txt", "mp4")


def text() -> str:
    return "\n".join(doc.read_text() for doc in DOCS)


def commands() -> list[str]:
    """The command lines the docs show: the lines of their code blocks, and `python ...` in prose."""
    found = []
    for doc in DOCS:
        content = doc.read_text()
        found += re.findall(r"(?<!`)`((?:python|torchrun) [^`]+)`", content.replace("\n", " "))
        for block in re.split(r"\n(?! {4}|\n)", re.sub(r"\\\n\s*", " ", content)):
            found += [line.strip() for line in block.splitlines() if line.startswith("    ")
                      and re.match(r"(\w+=\S+ )*(python|torchrun|srun|taskset)\b", line.strip())]
    return found


def script_and_arguments(line: str) -> tuple[str, list[str]] | None:
    """(module of the script, its arguments) of a command line as the docs write it: comments,
    `...` and the brackets of optional parts dropped; None for a command of another program."""
    words = shlex.split(line.split(" #")[0].replace("[", " ").replace("]", " "))
    for i, word in enumerate(words):
        module = word[:-3].replace("/", ".") if word.endswith(".py") else \
            words[i + 1] if word == "-m" and i + 1 < len(words) else None
        if module in SCRIPTS:
            rest = words[i + 1 + (word == "-m"):]
            return module, [w for w in rest if w not in ("...", "|")]
    return None


class _Recorded(BaseException):
    """Ends a script at its parse_args (past its `except Exception` and its Ctrl-C handling)."""


def parser_options(module: str) -> set[str]:
    """The option strings of a script's parser (its parse_args stopped before it parses)."""
    seen = []
    parse = argparse.ArgumentParser.parse_args

    def record(self, args=None, namespace=None):
        seen.append(self)
        raise _Recorded
    argparse.ArgumentParser.parse_args = record
    try:
        importlib.import_module(module).main([])
    except _Recorded:
        pass
    finally:
        argparse.ArgumentParser.parse_args = parse
    return {option for p in seen for a in p._actions for option in a.option_strings}


@pytest.mark.parametrize("line", commands())
def test_each_command_in_the_docs_parses(line, monkeypatch):
    called = script_and_arguments(line)
    if called is None:
        assert line.split()[0] != "python" or " -m torch." in line or "pytest" in line, line
        return
    module, argv = called
    monkeypatch.setattr(sys, "argv", [module, *argv])
    if "--help" in argv:          # prints the usage and exits 0
        with pytest.raises(SystemExit) as done:
            importlib.import_module(module).main(argv)
        assert done.value.code in (0, None), line
        return
    assert run_entry(importlib.import_module(module).main, argv, check=True) == {"parsed": True}, line


def test_each_option_the_docs_name_is_an_option_of_a_command():
    known = set().union(*(parser_options(module) for module in SCRIPTS))
    named = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", text()))
    assert named - known - FOREIGN == set()


def test_each_config_key_the_docs_name_is_a_field():
    sections = {s for s in Config.__dataclass_fields__ if s != "preset"}
    keys = set(re.findall(rf"\b((?:{'|'.join(sections)})\.[a-z_]+)\b(?![.(/\w])", text()))
    fields = {k for k in keys - APEX if k.split(".")[1] not in FILE_ENDINGS and not importable(k)}
    assert {k for k in fields if declared(k)["flag"] is None and not field_exists(k)} == set()


def field_exists(key: str) -> bool:
    section, name = key.split(".")
    return name in type(getattr(Config(), section)).__dataclass_fields__


def importable(dotted: str) -> bool:
    """Whether `dotted` (`inference.predict.MAX_ASPECT`, `engine.logger.RunLogger.read`) names a
    module of the project or something in one."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for part in parts[cut:]:
                obj = getattr(obj, part)
        except AttributeError:
            return False
        return True
    return False


def test_each_name_of_the_code_the_docs_give_exists():
    names = set(re.findall(rf"`((?:{'|'.join(CODE)})\.[\w.]+?)(?:\(\))?`", text()))
    names = {n for n in names if n.rsplit(".", 1)[-1] not in FILE_ENDINGS}
    assert {n for n in names if not importable(n) and not (n.count(".") == 1 and n.split(".")[0] in
                                                              Config.__dataclass_fields__ and field_exists(n))} == set()


def test_each_file_of_the_repository_the_docs_name_exists():
    folders = "|".join(CODE + ("tests", "bench", "docs", "config/presets", ".ci"))
    paths = set(re.findall(rf"(?<![\w/.])((?:{folders})/[\w/.-]*\w)", text()))
    assert {p for p in paths if not (REPO / p).exists() and "*" not in p} == set()


def test_bench_results_hold_todays_figures_and_what_they_name_exists():
    """bench/RESULTS.md, which README and the docs cite: at most 20 kB, a table in each benchmark's
    section; every file of bench/results/ that it or a dated page there names exists."""
    results = REPO / "bench" / "RESULTS.md"
    assert results.stat().st_size <= 20_000 and "bench/RESULTS.md" in text()
    sections = results.read_text().split("\n## ")[1:]
    assert len(sections) >= 5 and all("\n| --- |" in s or "\n|---|" in s for s in sections)
    cited = set()
    for page in [results, *(REPO / "bench" / "results").glob("*.md")]:
        named = set(re.findall(r"(?<![\w/])(?:bench/)?(results/[\w./-]*\w)", page.read_text()))
        assert {n for n in named if not (REPO / "bench" / n).exists()} == set(), page
        cited |= {(REPO / "bench" / n).resolve() for n in named}
    dated = {p.resolve() for p in (REPO / "bench" / "results").glob("*.md")}
    assert dated and dated <= cited, "a dated page that RESULTS.md or another page does not cite"
