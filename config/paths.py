"""Checks on the paths a command is given: no output may be one of the command's inputs.

Paths are compared resolved (links, `..` and relative paths followed), so `--out ./a/../ann.json`
is recognised as `ann.json`.
"""
from __future__ import annotations

import os
from pathlib import Path

from config.errors import ConfigError


def same_file(a, b) -> bool:
    """Whether two paths name the same file (resolved; an existing pair also by inode)."""
    a, b = Path(a), Path(b)
    try:
        if a.exists() and b.exists():
            return os.path.samefile(a, b)
    except OSError:
        pass
    return a.resolve() == b.resolve()


def refuse_output_as_input(out_option: str, out, inputs: dict) -> None:
    """ConfigError when `out` (given by `out_option`) is one of `inputs` ({option: path})."""
    for option, path in inputs.items():
        if path and same_file(out, path):
            raise ConfigError(f"{out_option} {out} is the same file as {option} {path}: writing it would "
                              f"destroy the input; choose another {out_option}")
