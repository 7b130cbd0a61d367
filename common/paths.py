"""The paths a command writes: no output may be one of the command's inputs, lie inside a folder
it reads or be another of its outputs (`refuse_clashes`), none replaces a file that exists unless
the user passed --overwrite, and an output appears whole or not at all
(`written_whole`). A new output is created exclusively: when two commands write the same new path,
the second to finish fails in one line instead of replacing the first one's file unasked.

Paths are compared resolved (links, `..` and relative paths followed), so `--out ./a/../ann.json`
is recognised as `ann.json`.
"""
from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path

from common.errors import ConfigError, os_reason


def same_file(a, b) -> bool:
    """Whether two paths name the same file (resolved; an existing pair also by inode). A loop of
    symbolic links names no file, so it is the same as nothing."""
    a, b = Path(a), Path(b)
    try:
        if a.exists() and b.exists():
            return os.path.samefile(a, b)
        return a.resolve() == b.resolve()
    except (OSError, RuntimeError):        # RuntimeError: pathlib's answer to a loop of links
        return False


def _listed_paths(value) -> list[Path]:
    """A path, several, or none (None, "") as a list."""
    if not value:
        return []
    if isinstance(value, (str, os.PathLike)):
        return [Path(value)]
    return [Path(item) for item in value if item]


def _identity(path: Path, resolved: Path):
    """What names one file: its inode when it exists (hard links too), else its resolved path."""
    try:
        stat = path.stat()
        return stat.st_dev, stat.st_ino
    except OSError:
        return str(resolved)


def refuse_clashes(reads: dict, writes: dict) -> None:
    """ConfigError (one line) unless every path a command writes is safe to write: `writes` and
    `reads` are {option: a path, several, or None}, the files and folders the command writes and
    reads. A written path is refused when it is a loop of symbolic links, when it is the same file
    as one read, when it is a folder read or a file already inside one (a folder of pictures, say:
    the file may be one of them; a new file there is fine), and when another output writes it too. Every command calls this once, before it writes anything, with everything it
    reads (data, pictures, skeleton, weights, config) and writes, whether or not --overwrite was
    given."""
    sources = [(option, path) for option, value in reads.items() for path in _listed_paths(value)]
    folders = []
    for option, path in sources:
        try:
            if path.is_dir():
                folders.append((option, path, path.resolve()))
        except (OSError, RuntimeError):
            continue
    written: dict = {}
    for option, out in ((o, p) for o, value in writes.items() for p in _listed_paths(value)):
        try:
            resolved = out.resolve()
        except (OSError, RuntimeError):
            raise ConfigError(f"{option} {out}: a loop of symbolic links; give another path") from None
        for source_option, folder, folder_resolved in folders:
            if resolved == folder_resolved or (resolved.is_relative_to(folder_resolved) and out.exists()):
                raise ConfigError(f"{option} {out} is inside {source_option} {folder}, a folder this "
                                  f"command reads: writing it could destroy an input; choose "
                                  f"another {option}")
        for source_option, source in sources:
            if same_file(out, source):
                raise ConfigError(f"{option} {out} is the same file as {source_option} {source}: writing "
                                  f"it would destroy the input; choose another {option}")
        other = written.setdefault(_identity(out, resolved), (option, out))
        if other != (option, out):
            raise ConfigError(f"{option} {out} and {other[0]} {other[1]} are the same file: one output "
                              "would replace the other; give each its own path")


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


def _synced_size(temp: Path, option: str, path) -> int:
    """The size of `temp` once on disk (fsync); ConfigError naming `path` if it cannot be synced."""
    try:
        fd = os.open(temp, os.O_RDONLY)
        try:
            os.fsync(fd)
            return os.fstat(fd).st_size
        finally:
            os.close(fd)
    except OSError as exc:
        raise ConfigError(f"{option} {path}: cannot write the file there ({os_reason(exc)}); "
                          "nothing was written") from None


def _take_name_exclusively(temp: Path, path: Path, option: str) -> None:
    """Give `temp` the name `path` only if no file has it (a hard link, which never replaces, then
    the temporary name removed); a rename checked just before where links are not supported."""
    try:
        os.link(temp, path)
    except FileExistsError:
        raise ConfigError(f"{option} {path} was created by another command while this one wrote it; "
                          f"that file is kept as it is: choose another {option}, or pass --overwrite "
                          "to replace it") from None
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise
        if path.exists():
            raise ConfigError(f"{option} {path} was created by another command while this one wrote "
                              f"it; that file is kept as it is: choose another {option}") from None
        os.replace(temp, path)
        return
    temp.unlink()


@contextlib.contextmanager
def written_whole(path, overwrite: bool = True, option: str = "--out"):
    """Write an output atomically: yields the temporary twin of `path` to write; when the block
    ends without an exception and the twin exists, it is synced to disk and takes `path`'s name
    (replacing a file there only with `overwrite`; otherwise a file that appeared there meanwhile
    is a ConfigError naming `option`); on any failure, a signal's KeyboardInterrupt included, the
    twin is removed and `path` (a file the user already had, or nothing) is left as it was."""
    path = Path(path)
    temp = temporary_twin(path)
    try:
        yield temp
        if temp.is_file():
            if _synced_size(temp, option, path) == 0:
                raise ConfigError(f"{option} {path}: the file written is empty (full disk?); nothing "
                                  "was written")
            if overwrite:
                os.replace(temp, path)
            else:
                _take_name_exclusively(temp, path, option)
    finally:
        with contextlib.suppress(OSError):
            temp.unlink()
