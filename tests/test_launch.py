"""`python -m runtime.launch` (torchrun in-process) ends with its ranks' code and line: torch's
SignalException and ChildFailedError, raised by a stand-in for `torch.distributed.run.run` after the
ranks' `print_error`, become the exit code a requeue wrapper reads. The real processes:
test_preemption.py (SIGTERM to its group) and test_rank_errors.py (a rank's error)."""
from __future__ import annotations

import signal

import pytest
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from common.errors import ENDINGS_FOLDER, UserError, print_error
from engine.trainer import Interrupted
from runtime import launch

ARGS = ["--standalone", "--nproc_per_node", "2", "train_distributed.py"]
SAVED = "stopped by SIGTERM at epoch 1, batch 3; saved R/last.pth. Resume with the same command and " \
        "--resume auto --run-name R"


def launched(monkeypatch, capsys, endings: dict, ends) -> tuple[int, str]:
    """(exit code, last stderr line) of the launcher when ranks end with `endings` ({rank: error})
    and the agent then raises `ends`."""
    def run(args):
        assert args.nproc_per_node == "2" and "SIGUSR1" in args.signals_to_handle
        for rank, error in endings.items():
            monkeypatch.setenv("RANK", str(rank))
            print_error(error)
        raise ends
    monkeypatch.setattr(launch.torchrun, "run", run)
    monkeypatch.setenv(ENDINGS_FOLDER, "")          # given back as it was after the test
    code = launch.main(ARGS)
    return code, capsys.readouterr().err.splitlines()[-1]


def failed(rank: int, exitcode: int) -> ChildFailedError:
    return ChildFailedError("train_distributed.py", {rank: ProcessFailure(rank, 100 + rank, exitcode, "")})


def test_ranks_stopped_by_sigterm_end_the_launcher_with_code_2_and_rank_0s_resume_line(monkeypatch, capsys):
    endings = {1: Interrupted(SAVED), 0: Interrupted(SAVED.replace("SIGTERM", "a signal on another rank"))}
    stop = SignalException("got signal 15", sigval=signal.SIGTERM)
    assert launched(monkeypatch, capsys, endings, stop) == (2, endings[0].args[0])
    # ranks killed before they could say anything: the usual line of a stopped command
    assert launched(monkeypatch, capsys, {}, stop) == (
        143, "stopped by SIGTERM; the last completed checkpoint is kept")


def test_a_ranks_own_error_is_the_launchers_code_and_line_a_crash_keeps_torchs_error(monkeypatch, capsys):
    endings = {0: UserError("rank 1: bad image"), 1: UserError("bad image")}
    assert launched(monkeypatch, capsys, endings, failed(1, 2)) == (2, "error: bad image")
    assert launched(monkeypatch, capsys, {}, failed(1, 3)) == (
        3, "error: rank 1 (pid 101) ended with exit code 3; its own line above (or in its log) says why")
    with pytest.raises(ChildFailedError):
        launched(monkeypatch, capsys, {}, failed(1, 1))
