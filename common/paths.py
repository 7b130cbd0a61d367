"""The paths a command writes: no output may be an input, lie inside a folder read or be another output
(`refuse_clashes`; paths resolved), none replaces a file without --overwrite, each appears whole or not
at all (`written_whole`), a new one created exclusively (of two commands writing it, the second fails in
one line); a character device or FIFO is written into and a link followed, never replaced (`output_kind`)."""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import stat
import tempfile
from pathlib import Path

from common.errors import ConfigError, os_reason, raise_if_stopped


def _each_path(paths: dict):
    """(option, path) for each path of {option: a path, several, or none (None, "")}."""
    for option, value in paths.items():
        listed = [value] if isinstance(value, (str, os.PathLike)) else value or []
        yield from ((option, Path(item)) for item in listed if item)


def _identity(path: Path):
    """(device, inode) of an existing file, else its resolved path; raises for a symlink loop."""
    resolved = path.resolve()
    try:
        stat = resolved.stat()
        return stat.st_dev, stat.st_ino
    except OSError:
        return str(resolved)


def refuse_clashes(reads: dict, writes: dict) -> None:
    """ConfigError for an output of `writes` ({option: path(s)}) that is a symlink loop, another output,
    a file of `reads`, or in or of a folder read. Every command calls this before it writes."""
    written: dict = {}                   # identity -> (option, path, resolved path)
    for option, out in _each_path(writes):
        try:
            resolved, identity = out.resolve(), _identity(out)
        except (OSError, RuntimeError):
            raise ConfigError(f"{option} {out}: a loop of symbolic links; give another path") from None
        if (other := written.setdefault(identity, (option, out, resolved)))[:2] != (option, out):
            raise ConfigError(f"{option} {out} and {other[0]} {other[1]} are the same file: one output "
                              "would replace the other; give each its own path")
    for source_option, source in _each_path(reads):
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


def output_kind(option: str, out) -> str:
    """What the output `out` is: "absent", "file", "folder", or "stream" (a character device or FIFO,
    written into, never replaced); links followed; ConfigError for a block device (a disk)."""
    try:
        mode = Path(out).stat().st_mode
    except OSError:
        return "absent"
    if stat.S_ISBLK(mode):
        raise ConfigError(f"{option} {out} is a block device (a disk): writing there would destroy what "
                          f"it holds; choose a file for {option}")
    return ("folder" if stat.S_ISDIR(mode) else "stream" if stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)
            else "file")


def refuse_existing(out_option: str, out, overwrite: bool) -> None:
    """ConfigError when a file `out` exists without `overwrite` (a device or FIFO is written into)."""
    if output_kind(out_option, out) == "file" and not overwrite:
        raise ConfigError(f"{out_option} {out} already exists; remove it, choose another {out_option} "
                          "or pass --overwrite to replace it (nothing was written)")


def _write_into(path: Path, temp: Path, option: str) -> None:
    """Copy `temp` into the character device or FIFO `path` (a FIFO only while a process reads it)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        reason = "a FIFO no process reads; start its reader first" if exc.errno == errno.ENXIO else (
            f"cannot write there ({os_reason(exc)})")
        raise ConfigError(f"{option} {path}: {reason}; nothing was written") from None
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    with open(fd, "wb") as out, open(temp, "rb") as source:
        shutil.copyfileobj(source, out)


def _take_name_exclusively(temp: Path, path: Path, option: str) -> None:
    """Give `temp` the name `path` only if no file has it (a hard link, else a checked rename)."""
    taken = (f"{option} {path} was created by another command while this one wrote it; that file is "
             f"kept as it is: choose another {option}")
    try:
        os.link(temp, path)
    except FileExistsError:
        raise ConfigError(f"{taken}, or pass --overwrite to replace it") from None
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise
        if path.exists():
            raise ConfigError(taken) from None
        os.replace(temp, path)
        return
    temp.unlink()


@contextlib.contextmanager
def written_whole(path, overwrite: bool = True, option: str = "--out", temp=None):
    """Write an output atomically: yields `temp` (default: the hidden twin of `path` with this process's
    id), which, when the block ends well, is synced and takes `path`'s name (over a file only with
    `overwrite`, else ConfigError naming `option`); on any failure it is removed, `path` as it was."""
    path = Path(os.path.realpath(path)) if Path(path).is_symlink() else Path(path)
    stream = output_kind(option, path) == "stream"
    ancestor = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if ancestor is not None:            # a file stands where a folder must
        raise ConfigError(f"{option} {path}: {ancestor} is a file, not a folder; choose another {option}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{option} {path}: cannot create its folder ({os_reason(exc)})") from None
    twin = f".{path.stem}.{os.getpid()}.tmp{path.suffix}"
    temp = Path(temp) if temp else Path(tempfile.gettempdir(), twin) if stream else path.with_name(twin)
    try:
        yield temp
        raise_if_stopped()
        if temp.is_file():
            try:
                with open(temp, "rb") as file:          # on disk before it takes the name
                    os.fsync(file.fileno())
                    size = os.fstat(file.fileno()).st_size
            except OSError as exc:
                raise ConfigError(f"{option} {path}: cannot write the file there ({os_reason(exc)}); "
                                  "nothing was written") from None
            if size == 0:
                raise ConfigError(f"{option} {path}: the file written is empty (full disk?); nothing "
                                  "was written")
            if stream:
                _write_into(path, temp, option)
            elif overwrite:
                os.replace(temp, path)
            else:
                _take_name_exclusively(temp, path, option)
    finally:
        with contextlib.suppress(OSError):
            temp.unlink()


def write_text(option: str, path, text: str, overwrite: bool = True) -> None:
    """Write `text` to `path` whole (over a file only with `overwrite`); ConfigError naming `option`."""
    refuse_existing(option, path, overwrite)
    try:
        with written_whole(path, overwrite, option) as temp:
            temp.write_text(text)
    except OSError as exc:
        raise ConfigError(f"{option} {path}: cannot write the file there ({os_reason(exc)})") from None
