"""Whether a script takes a command line, without running it: the script starts as it would, and
stops right after its parser has accepted the arguments. For dry runs of the GPU scripts
(bench/gpu_smoke.sh --cpu-check) on a machine without the GPU.

    python bench/check_args.py train.py --opt-level O1 --device cuda ...
    python bench/check_args.py python3 train.py --opt-level O1 --device cuda ...
    python bench/check_args.py torchrun --standalone --nproc_per_node 1 train_distributed.py ...

Prints `accepted` and exits 0, or the script's own one-line error with its exit code (2). A
launcher in front (torchrun, python -m torch.distributed.run) is skipped up to the script.
"""
from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

LAUNCHERS = ("torchrun", "torch.distributed.run", "torch.distributed.launch")


class _Accepted(BaseException):
    """Raised once the script's parser has taken the arguments (past any `except Exception`)."""


def script_and_arguments(command: list[str]) -> tuple[str, list[str]]:
    """The script a command line runs and its arguments, past the interpreter, a launcher and
    their options."""
    if command and Path(command[0]).name.startswith("python"):
        command = command[1:]
    if command and (Path(command[0]).name in LAUNCHERS or command[:2] in (["-m", LAUNCHERS[1]],
                                                                          ["-m", LAUNCHERS[2]])):
        scripts = [i for i, arg in enumerate(command) if arg.endswith(".py")]
        if not scripts:
            raise SystemExit(f"error: no script in {' '.join(command)}")
        return command[scripts[0]], command[scripts[0] + 1:]
    return command[0], command[1:]


def main(command: list[str]) -> int:
    if not command:
        print(__doc__.strip().splitlines()[0])
        return 2
    script, arguments = script_and_arguments(command)
    parse_args = argparse.ArgumentParser.parse_args

    def parse_only(self, args=None, namespace=None):
        parse_args(self, args, namespace)
        raise _Accepted

    argparse.ArgumentParser.parse_args = parse_only
    sys.argv = [script, *arguments]
    sys.path.insert(0, str(Path.cwd()))
    try:
        runpy.run_path(script, run_name="__main__")
    except _Accepted:
        print("accepted")
        return 0
    print(f"error: {script} ended without parsing its arguments")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
