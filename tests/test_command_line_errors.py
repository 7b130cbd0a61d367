"""A mistake on any command line of the project (an unknown option, a value of the wrong type or
choice, a missing argument) is one `error:` line naming the option, exit code 2, like every other
bad input: not argparse's whole usage block first. `--help` still prints the usage. A command
stopped by a signal ends as that stop, whatever exception the signal became on its way out.

Each case calls the command's `main(argv)` in this process; `tests/test_bad_options.py` runs
one through a real `train.py` process.
"""
from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bad_inputs import one_error_line
from child_env import child_env
from common.errors import ConfigError, run_cli

CASES = [   # module, argv, texts of the error line
    ("train", ["--epochs", "ten"], ["argument --epochs", "invalid int value: 'ten'"]),
    ("train", ["--optimizer", "adam"], ["argument --optimizer", "invalid choice: 'adam'"]),
    ("train", ["--no-such-option"], ["unrecognized arguments: --no-such-option"]),
    ("train_parallel", ["--gpus"], ["argument --gpus: expected one argument"]),
    ("train_distributed", ["--local_rank", "q"], ["argument --local_rank", "invalid int value: 'q'"]),
    ("evaluate", ["--scales", "x"], ["argument --scales", "invalid float value: 'x'"]),
    ("demo", ["--weights", "w.pth", "--camera", "front"], ["argument --camera", "'front'"]),
    ("export", ["--weights", "w.pth", "--out", "o.onnx", "--opset", "17.5"], ["argument --opset"]),
    ("engine.convert_reference", ["in.pth"], ["required: OUT.pth", "python -m engine.convert_reference"]),
    ("data.make_hdf5", ["--ann", "a.json"], ["required: --images, --out", "python -m data.make_hdf5"]),
    ("data.preview", ["--h5", "f.h5", "--out", "o.png", "--n", "many"], ["argument --n"]),
    ("data.synthetic", ["--out", "d", "--size", "1e3"], ["argument --size", "'1e3'"]),
    ("models.summary", ["--no-such-option"], ["unrecognized arguments", "python -m models.summary"]),
]


@pytest.mark.parametrize("module,argv,says", CASES, ids=[f"{c[0]}:{c[1][-1]}" for c in CASES])
def test_a_command_line_mistake_is_one_error_line_naming_the_option(capsys, module, argv, says):
    try:                  # a command's main() exits as argparse does, or returns run_cli's code
        code = importlib.import_module(module).main(argv)
    except SystemExit as stop:
        code = stop.code
    assert code == 2
    captured = capsys.readouterr()
    line = one_error_line(captured.err)
    assert captured.out == ""
    for text in says + ["--help)"]:
        assert text in line, line


def test_help_still_prints_the_usage(capsys):
    with pytest.raises(SystemExit) as stop:
        importlib.import_module("train").main(["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ") and "--epochs EPOCHS" in out


# the commands but export.py, whose --help names the newest ONNX opset torch writes;
# train_distributed.py's mistakes import torch: they tell the other ranks, through its store
QUICK = [["train.py", "--help"], ["train.py", "--epochs", "ten"], ["train_parallel.py", "--help"],
         ["train_parallel.py", "--gpus"], ["train_distributed.py", "--help"], ["evaluate.py", "--help"],
         ["evaluate.py", "--flipp"], ["demo.py", "--help"], ["demo.py", "--video"],
         ["-m", "data.preview", "--help"], ["-m", "data.preview", "--n", "2"]]


@pytest.mark.slow
@pytest.mark.parametrize("command", QUICK, ids=" ".join)
def test_help_and_mistakes_answer_before_torch_is_imported(command):
    """`--help` and a mistyped flag read the command line only: no 2 s of importing torch first
    (`python -X importtime` lists every module a process imports, on stderr)."""
    done = subprocess.run([sys.executable, "-X", "importtime", *command], env=child_env(),
                          cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=120)
    timed = [line for line in done.stderr.splitlines() if line.startswith("import time:")]
    imported = [line.split("|")[-1].strip() for line in timed]
    assert "config.schema" in imported and not [name for name in imported if name.split(".")[0] == "torch"]
    if command[-1] == "--help":
        assert done.returncode == 0 and done.stdout.startswith("usage: "), done.stderr[-2000:]
    else:
        assert done.returncode == 2 and done.stdout == ""
        one_error_line("\n".join(line for line in done.stderr.splitlines() if line not in timed))


def _mangled_by_c_code(sig, error):
    """A command whose library turns the stop signal it receives into another exception, as
    numpy's `__array__` fallback inside pycocotools' decode turns it into a TypeError, or as an
    interrupted `import onnxruntime` becomes "ONNX files need the optional package onnxruntime"."""
    def main(argv):
        try:
            os.kill(os.getpid(), sig)
            time.sleep(5)                      # the handler raises here
        except KeyboardInterrupt:
            raise error from None
    return main


MANGLED = [TypeError("__array__() got an unexpected keyword argument 'copy'"),
           ConfigError("ONNX files need the optional package onnxruntime: pip install -r requirements-export.txt")]


@pytest.mark.parametrize("error", MANGLED, ids=["TypeError", "ConfigError"])
@pytest.mark.parametrize("sig,code,says", [(signal.SIGTERM, 143, "stopped by SIGTERM; nothing kept"),
                                           (signal.SIGINT, 130, "interrupted (Ctrl-C); nothing kept")])
def test_a_stop_signal_mangled_into_another_error_still_ends_as_that_stop(capsys, sig, code, says, error):
    assert run_cli(_mangled_by_c_code(sig, error), [], kept="nothing kept") == code
    assert capsys.readouterr().err.strip() == says


def test_the_same_error_without_a_stop_signal_is_raised_as_it_is():
    def main(argv):
        raise TypeError("a bug")
    with pytest.raises(TypeError, match="a bug"):
        run_cli(main, [], kept="nothing kept")
