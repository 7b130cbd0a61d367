"""torchrun that ends as the run does: `python -m runtime.launch [torchrun's options] SCRIPT ...`
exits with the ranks' code and line (2 when stopped by SIGTERM / SIGUSR1), not torchrun's 1 and traceback."""
from __future__ import annotations

import os
import signal
import sys
import tempfile
from pathlib import Path

from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record

from common.errors import ENDINGS_FOLDER, TRAINING_KEPT, stopped


def main(argv=None) -> int:
    """torchrun's `run` with torchrun's options `argv`; the exit code the ranks' endings give."""
    args = torchrun.parse_args(argv)
    if "SIGUSR1" not in args.signals_to_handle:      # the ranks save on it, as on SIGTERM
        args.signals_to_handle += ",SIGUSR1"
    with tempfile.TemporaryDirectory(prefix="endings-") as folder:
        os.environ[ENDINGS_FOLDER] = folder         # the ranks inherit it
        try:
            torchrun.run(args)
        except SignalException as exc:       # the agent has sent it on to the ranks and waited for them
            if (ended := _ended(folder, sorted(int(p.name) for p in Path(folder).iterdir()))) is not None:
                return ended
            if exc.sigval in (signal.SIGTERM, signal.SIGINT):
                return stopped(exc.sigval == signal.SIGTERM, TRAINING_KEPT)
            raise
        except ChildFailedError as exc:
            rank, failure = exc.get_first_failure()
            if failure.exitcode > 1:          # its own ending (a Python bug is 1, a signal below 0)
                return _ended(folder, [rank]) or _say(
                    failure.exitcode, f"error: rank {rank} (pid {failure.pid}) ended with exit code "
                                      f"{failure.exitcode}; its own line above (or in its log) says why")
            raise
    return 0


def _ended(folder: str, ranks: list[int]) -> int | None:
    """The exit code of the first of `ranks` that left its line in `folder`, after saying that line."""
    for rank in ranks:
        path = Path(folder, str(rank))
        if path.exists():
            code, line = path.read_text().split(" ", 1)
            return _say(int(code), line)
    return None


def _say(code: int, line: str) -> int:
    print(line, file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(record(main)())
