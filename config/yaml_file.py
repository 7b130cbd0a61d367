"""A YAML file the user names (a preset or a run's config.yaml, a skeleton): its content, or one
`ConfigError` line that names the file and what is wrong with it (unreadable, not text, too large,
malformed YAML with its line and column)."""
from __future__ import annotations

from pathlib import Path

import yaml

from common.errors import ConfigError, os_reason

MAX_BYTES = 16 << 20          # a config or skeleton is a few kB; more is another kind of file


def read_yaml(path, source: str | None = None):
    """The parsed content of the YAML file at `path`; `source` is how errors name it (the path)."""
    path, source = Path(path), source or str(path)
    try:
        size = path.stat().st_size
        if size > MAX_BYTES:
            raise ConfigError(f"{source}: {size >> 20} MiB is too large for a YAML "
                              "config or skeleton file; is it the file you meant?")
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{source}: not a YAML file (not UTF-8 text)") from None
    except OSError as exc:
        raise ConfigError(f"{source}: cannot be read ({os_reason(exc)})") from None
    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{source}: malformed YAML{where}: {' '.join(str(exc.problem).split())}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: malformed YAML ({' '.join(str(exc).split())})") from None
