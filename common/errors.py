"""Errors a user can fix: each says what is wrong and where (file, option, item). Entry scripts print
a `UserError` on one line and exit with its code (`run_cli`); anything else is a bug and keeps its
traceback. `ArgumentParser`'s mistakes are one such line too.
"""
from __future__ import annotations

import argparse


class UserError(Exception):
    """A problem with the user's input or environment, with a message that says how to fix it."""

    exit_code = 2


class ConfigError(UserError):
    """An impossible or unknown setting (option name in the message)."""


class DataError(UserError):
    """A bad dataset file, image or annotation (file and item in the message)."""


class CheckpointError(UserError):
    """A checkpoint or weights file that cannot be loaded (file and reason in the message)."""


class TrainingDiverged(UserError):
    """Too many consecutive steps with non-finite or abnormal loss or gradients."""

    exit_code = 3


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, except that a mistake on the command line ends like any other bad input:
    one `error:` line naming the option, exit code 2, instead of the whole usage first (`--help`
    still prints it)."""

    def error(self, message: str):
        self.exit(2, f"error: {' '.join(message.split())} (see {self.prog} --help)\n")


def os_reason(exc: OSError) -> str:
    """What an operating-system error says, in lower case, for the middle of an error line."""
    return (exc.strerror or str(exc)).lower()


class Terminated(KeyboardInterrupt):
    """SIGTERM, in a command that stops on it as on Ctrl-C (`run_cli` with `kept`): raised in the
    main thread, so `finally` blocks remove temporary files and no `except Exception` swallows it."""


_STOP_SIGNALS_SEEN: list[int] = []    # the stop signals a command run by `run_cli` received


def _terminate(signum, frame):
    _STOP_SIGNALS_SEEN.append(signum)
    raise Terminated()


def _interrupt(signum, frame):
    _STOP_SIGNALS_SEEN.append(signum)
    raise KeyboardInterrupt()


TRAINING_KEPT = "the last completed checkpoint is kept"


def chained_os_reason(exc: BaseException) -> str:
    """The most telling reason in an exception chain (torch and onnx hide a write's OSError as
    its context), in lower case; the exception's type and text when the chain holds none."""
    seen = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.strerror:
            return os_reason(seen)
        seen = seen.__cause__ or seen.__context__
    return f"{type(exc).__name__}: {exc}"


def run_cli(main, argv=None, kept: str = TRAINING_KEPT) -> int:
    """Call `main(argv)` and return the exit code: 0, or a `UserError`'s after `print_error` printed it.
    Ctrl-C ends with one line saying what the command `kept` (exit code 130); a command other than
    training (whose trainer saves on SIGTERM itself) stops on SIGTERM the same way (143), removing its
    temporary files. Once such a command has received a stop signal, whatever ends it is that stop (a
    signal inside a library's C code can surface as a TypeError or an ImportError there)."""
    import signal
    import threading

    handles_term = kept != TRAINING_KEPT and threading.current_thread() is threading.main_thread()
    previous = ((signal.signal(signal.SIGTERM, _terminate), signal.signal(signal.SIGINT, _interrupt))
                if handles_term else None)
    _STOP_SIGNALS_SEEN.clear()
    try:
        main(argv)
    except Exception as exc:
        if handles_term and _STOP_SIGNALS_SEEN:
            return _stopped(_STOP_SIGNALS_SEEN[0] == signal.SIGTERM, kept)
        if not isinstance(exc, UserError):
            raise
        return print_error(exc)
    except KeyboardInterrupt as exc:
        return _stopped(isinstance(exc, Terminated), kept)
    finally:
        if handles_term:
            signal.signal(signal.SIGTERM, previous[0])
            signal.signal(signal.SIGINT, previous[1])
    return 0


def print_error(exc: UserError) -> int:
    """`exc`'s one line on stderr (`error: ...`; a clean stop's message as is); its exit code.
    It goes through `tqdm.write`, so a progress bar left open is cleared first."""
    import sys

    from tqdm import tqdm
    prefix = "" if getattr(exc, "plain_message", False) else "error: "
    tqdm.write(f"{prefix}{exc}", file=sys.stderr)
    sys.stderr.flush()
    return exc.exit_code


def _stopped(by_sigterm: bool, kept: str) -> int:
    """The one line of a command stopped by SIGTERM or Ctrl-C, and its exit code."""
    import sys

    from tqdm import tqdm
    tqdm.write(f"{'stopped by SIGTERM' if by_sigterm else 'interrupted (Ctrl-C)'}; {kept}", file=sys.stderr)
    sys.stderr.flush()
    return 143 if by_sigterm else 130
