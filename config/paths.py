"""The paths a command writes: no output may be one of the command's inputs, none replaces a file
that exists unless the user passed --overwrite, and an output appears whole or not at all
(`written_whole`).

Paths are compared resolved (links, `..` and relative paths followed), so `--out ./a/../ann.json`
is recognised as `ann.json`.
"""
from __future__ import annotations

import contextlib
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


def refuse_existing(out_option: str, out, overwrite: bool) -> None:
    """ConfigError when a file `out` (given by `out_option`, or its default) exists and --overwrite
    was not given: a command never replaces a file the user has without being asked to. (A folder
    there is for the command to refuse in its own words.)"""
    if Path(out).exists() and not Path(out).is_dir() and not overwrite:
        raise ConfigError(f"{out_option} {out} already exists; remove it, choose another {out_option} "
                          "or pass --overwrite to replace it (nothing was written)")


def temporary_twin(path) -> Path:
    """The hidden file next to `path` that an output is written to before it takes `path`'s name:
    same folder (so the rename is atomic), same extension (OpenCV picks the format by it), this
    process's id (two writers never share one)."""
    path = Path(path)
    return path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")


@contextlib.contextmanager
def written_whole(path):
    """Write an output atomically: yields the temporary twin of `path` to write; when the block
    ends without an exception and the twin exists, it replaces `path`; otherwise the twin is
    removed and `path` (a file the user already had, or nothing) is left as it was."""
    temp = temporary_twin(path)
    try:
        yield temp
        if temp.is_file():
            os.replace(temp, path)
    finally:
        with contextlib.suppress(OSError):
            temp.unlink()
