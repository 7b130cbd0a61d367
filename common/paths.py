"""The paths a command writes: no output may be an input, lie inside a folder read or be another
output (`refuse_clashes`; paths compared resolved, links and `..` followed), none replaces a file
without --overwrite, and an output appears whole or not at all (`written_whole`), a new one
created exclusively (of two commands writing it, the second fails in one line).
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


def _identity(path: Path):
    """What names one file: its device and inode when it exists (links, hard links and `a/../`
    spellings too), else its resolved path; OSError or RuntimeError for a loop of symbolic links."""
    resolved = path.resolve()
    try:
        stat = resolved.stat()
        return stat.st_dev, stat.st_ino
    except OSError:
        return str(resolved)


def refuse_clashes(reads: dict, writes: dict) -> None:
    """ConfigError (one line) unless every path a command writes is safe to write. `writes` and `reads`
    are {option: a path, several, or None}: the command's outputs, and the files and folders it reads
    (as exactly as it knows them: the pictures a JSON names, not their folder). An output is refused
    when it is a loop of symbolic links, another output, the same file as one read, or a folder read
    or a file already inside one. Every command calls this before it writes, --overwrite or not."""
    written: dict = {}                   # identity -> (option, path, resolved path)
    for option, out in ((o, p) for o, value in writes.items() for p in _listed_paths(value)):
        try:
            resolved, identity = out.resolve(), _identity(out)
        except (OSError, RuntimeError):
            raise ConfigError(f"{option} {out}: a loop of symbolic links; give another path") from None
        other = written.setdefault(identity, (option, out, resolved))
        if other[:2] != (option, out):
            raise ConfigError(f"{option} {out} and {other[0]} {other[1]} are the same file: one output "
                              "would replace the other; give each its own path")
    for source_option, source in ((o, p) for o, value in reads.items() for p in _listed_paths(value)):
        try:
            identity, folder = _identity(source), source.resolve() if source.is_dir() else None
        except (OSError, RuntimeError):
            continue                     # a loop of links reads nothing
        clash = written.get(identity)
        if clash is None and folder is not None:
            clash = next((entry for entry in written.values() if entry[2].is_relative_to(folder)
                          and entry[1].exists()), None)
        if clash is None:
            continue
        option, out, _ = clash
        if folder is None:
            raise ConfigError(f"{option} {out} is the same file as {source_option} {source}: writing it "
                              f"would destroy the input; choose another {option}")
        raise ConfigError(f"{option} {out} is inside {source_option} {source}, a folder this command "
                          f"reads: writing it could destroy an input; choose another {option}")


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


def write_text(option: str, path, text: str, overwrite: bool = True) -> None:
    """Write `text` to `path` whole (`written_whole`, its folder made), refusing an existing file
    without `overwrite`; ConfigError naming `option` when it cannot be written there."""
    refuse_existing(option, path, overwrite)
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with written_whole(path, overwrite, option) as temp:
            temp.write_text(text)
    except OSError as exc:
        raise ConfigError(f"{option} {path}: cannot write the file there ({os_reason(exc)})") from None
