"""Errors a user can fix, each saying what is wrong and where: entry scripts print a `UserError` (or an
`ArgumentParser` mistake) on one line and exit with its code (`run_cli`); a bug keeps its traceback."""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading


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
    """argparse's parser, but a command-line mistake is one `error:` line and exit code 2."""

    def error(self, message: str):
        self.exit(2, f"error: {' '.join(message.split())} (see {self.prog} --help)\n")

    def _get_values(self, action, arg_strings):
        """An empty value is refused for every option: it never means "absent" or "this folder"."""
        if "" in arg_strings and action.option_strings:
            self.error(f"argument {'/'.join(action.option_strings)}: an empty value; give one or leave "
                       "the option out")
        return super()._get_values(action, arg_strings)


def refuse_inapplicable(given: dict, where: str, why: str) -> None:
    """ConfigError naming the options of `given` ({option: value or None}) that do not apply `where`."""
    if named := [option for option, value in given.items() if value is not None]:
        raise ConfigError(f"option{'s' * (len(named) > 1)} {' and '.join(named)} "
                          f"do{'es' * (len(named) == 1)} not apply {where}: {why}")


def os_reason(exc: Exception) -> str:
    """What an operating-system error (or a read's decoding error) says, in lower case, for the middle
    of an error line: its strerror, else its text (an OSError raised without an errno has no strerror)."""
    return (getattr(exc, "strerror", None) or str(exc)).lower()


class Terminated(KeyboardInterrupt):
    """SIGTERM as raised in a command that stops on it as on Ctrl-C (not an `Exception`)."""


_STOP_SIGNALS_SEEN: list[int] = []    # the stop signals a command run by `run_cli` received


def _stop(signum, frame):
    _STOP_SIGNALS_SEEN.append(signum)
    if len(_STOP_SIGNALS_SEEN) == 1:          # a second signal does not cut the first one's clean-up
        raise_if_stopped()


def raise_if_stopped() -> None:
    """Raise the stop a signal asked for. Its handler raises at once, but a finalizer or a C library's
    callback that was running then swallows that raise: loops and commits call this to honour it."""
    if _STOP_SIGNALS_SEEN:
        raise Terminated() if _STOP_SIGNALS_SEEN[0] == signal.SIGTERM else KeyboardInterrupt()


TRAINING_KEPT = "the last completed checkpoint is kept"


def chained_os_reason(exc: BaseException) -> str:
    """The OSError reason in an exception chain, in lower case; else the exception's type and text."""
    seen = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.strerror:
            return os_reason(seen)
        seen = seen.__cause__ or seen.__context__
    return f"{type(exc).__name__}: {exc}"


def run_cli(main, argv=None, kept: str = TRAINING_KEPT) -> int:
    """`main(argv)`'s exit code: 0, or a `UserError`'s after `print_error`. Ctrl-C (130) and SIGTERM (143;
    `Preemption` saves on it in training) end in one line of what was kept, whatever error follows."""
    on_main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT) if on_main}
    try:
        main(argv)
    except Exception as exc:
        if _STOP_SIGNALS_SEEN:
            return stopped(_STOP_SIGNALS_SEEN[0] == signal.SIGTERM, kept)
        if not isinstance(exc, UserError):
            raise
        return print_error(exc)
    except KeyboardInterrupt as exc:
        return stopped(isinstance(exc, Terminated), kept)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _STOP_SIGNALS_SEEN.clear()
    return 0


def _say(line: str) -> None:
    """`line` on stderr through `tqdm.write`, so that a progress bar does not cut it."""
    from tqdm import tqdm
    tqdm.write(line, file=sys.stderr)
    sys.stderr.flush()


# set by runtime.launch: the folder where each rank it starts leaves its exit code and last line
ENDINGS_FOLDER = "SIMPLE_POSE_ENDINGS"


def error_line(exc: UserError) -> str:
    """The line a command ends with on `exc`: `error: MESSAGE`, or the message alone if it is plain."""
    return f"{'' if getattr(exc, 'plain_message', False) else 'error: '}{exc}"


def print_error(exc: UserError) -> int:
    """`exc`'s one line on stderr (`error: ...`), also left for the launcher (`ENDINGS_FOLDER`); its code."""
    line = error_line(exc)
    _say(line)
    if os.environ.get(ENDINGS_FOLDER):
        with contextlib.suppress(OSError):
            with open(os.path.join(os.environ[ENDINGS_FOLDER], os.environ.get("RANK", "0")), "w") as file:
                file.write(f"{exc.exit_code} {line}")
    return exc.exit_code


def stopped(by_sigterm: bool, kept: str) -> int:
    """The one line of a command stopped by SIGTERM or Ctrl-C, and its exit code."""
    _say(f"{'stopped by SIGTERM' if by_sigterm else 'interrupted (Ctrl-C)'}; {kept}")
    exec("pass")    # clears CPython <=3.13's mark of a Ctrl-C that left exec'd code (it kills `-m` at exit)
    return 143 if by_sigterm else 130
