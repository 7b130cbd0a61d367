"""Every distributed run ends by itself: two real ranks under torchrun or the legacy launcher, each
with two DataLoader workers in its training and its validation loader, with and without --sync-bn,
end within 30 s of the line that says how the run ended (and leave no process behind), for each way
a run ends: its last epoch, a steps limit, early stopping, the divergence stop, pre-emption
(SIGTERM to the launcher, the ranks and their workers, as SLURM sends it), and an error on one
rank.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from child_env import child_env, find_free_port
from multiprocess_runs import BAD_DATA_MESSAGE
from test_preemption import REPO, logged_steps, write_micro_preset

pytestmark = pytest.mark.slow          # every test here starts processes

ENDS_WITHIN_S = 30.0
RUN_LIMIT_S = 400.0          # start-up of three torch processes on a loaded machine included
DRIVER = str(REPO / "tests" / "multiprocess_runs.py")
TORCHRUN, LEGACY = "torch.distributed.run", "torch.distributed.launch"

# end: (extra arguments, extra environment, the line that says how the run ended, exit 0 or not)
ENDS = {
    "last epoch": (["--epochs", "1"], {}, r"^done\. checkpoints: ", True),
    "steps limit": (["--epochs", "2", "--set", "train.max_steps_per_epoch=2"], {},
                    r"^done\. checkpoints: ", True),
    "early stop": (["--epochs", "4", "--set", "train.max_steps_per_epoch=1", "--early-stop", "1"],
                   {"TEST_FLAT_VAL": "1"}, r"^early stop after epoch 2: ", True),
    "divergence stop": (["--epochs", "1", "--set", "optim.max_bad_steps=1"], {"TEST_BLOW_UP": "1:2"},
                        r"^error: 1 consecutive steps had a non-finite or abnormal loss", False),
    "pre-emption": (["--epochs", "50", "--set", "train.max_steps_per_epoch=2"], {},
                    r"^stopped by SIGTERM (at epoch \d+, batch \d+|while validating epoch \d+ .*); "
                    r"saved .*Resume with ", False),
    "error on one rank": (["--epochs", "1"], {"TEST_BAD_DATA": "1:2"},
                          rf"^error: (rank 1: )?{re.escape(BAD_DATA_MESSAGE)}$", False),
}
CASES = [("last epoch", TORCHRUN, False), ("last epoch", LEGACY, True),
         ("steps limit", TORCHRUN, True), ("early stop", LEGACY, False),
         ("divergence stop", TORCHRUN, True), ("pre-emption", TORCHRUN, False),
         ("error on one rank", LEGACY, True)]


class TimedLines:
    """The lines a process writes (stdout and stderr, progress-bar redraws split apart), each with
    the monotonic time it was read."""

    def __init__(self, process: subprocess.Popen):
        self.lines: list[tuple[float, str]] = []
        self.readers = [threading.Thread(target=self._read, args=(stream,), daemon=True)
                        for stream in (process.stdout, process.stderr)]
        for reader in self.readers:
            reader.start()

    def _read(self, stream) -> None:
        for line in stream:
            now = time.monotonic()
            self.lines += [(now, piece.strip()) for piece in line.split("\r") if piece.strip()]

    def last_matching(self, pattern: str) -> float | None:
        times = [t for t, line in self.lines if re.search(pattern, line)]
        return times[-1] if times else None

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


def _process_table() -> dict[int, tuple[int, str]]:
    """{pid: (parent pid, state)} of every process (from /proc)."""
    table = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        table[int(stat.parent.name)] = (int(fields[1]), fields[0])
    return table


def descendants(pid: int) -> set[int]:
    """The processes `pid` started, and theirs (the launcher's ranks run in sessions of their own,
    so the launcher's process group does not hold them)."""
    table, found, todo = _process_table(), set(), [pid]
    while todo:
        parent = todo.pop()
        children = [child for child, (ppid, _) in table.items() if ppid == parent]
        found.update(children)
        todo += children
    return found


def still_running(pids: set[int]) -> list[int]:
    table = _process_table()
    return sorted(pid for pid in pids if pid in table and table[pid][1] != "Z")


@pytest.mark.parametrize("end, launcher, sync_bn", CASES,
                         ids=[f"{end}-{launcher.rsplit('.', 1)[1]}{'-sync-bn' * sync_bn}"
                              for end, launcher, sync_bn in CASES])
def test_a_two_rank_run_with_dataloader_workers_ends_by_itself(tmp_path, synthetic_h5, end, launcher,
                                                               sync_bn):
    extra, env, ending_line, succeeds = ENDS[end]
    command = [sys.executable, "-m", launcher, "--nproc_per_node", "2", "--master_port",
               str(find_free_port()), DRIVER, "--config", str(write_micro_preset(tmp_path)),
               "--train-h5", str(synthetic_h5[0]), "--val-h5", str(synthetic_h5[1]),
               "--out-dir", str(tmp_path), "--run-name", "run", "--batch-size", "4", "--device", "cpu",
               "--workers", "2", "--val-every", "1", "--ap-every", "0",
               "--set", "train.tensorboard=false", "--set", "dist.timeout_s=120",
               *(["--sync-bn"] if sync_bn else []), *extra]
    process = subprocess.Popen(command, cwd=REPO, env=child_env(**env), text=True, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    lines = TimedLines(process)
    started, deadline = set(), time.monotonic() + RUN_LIMIT_S
    try:
        if end == "pre-emption":
            while logged_steps(tmp_path / "run") < 2 and process.poll() is None \
                    and time.monotonic() < deadline:
                started |= descendants(process.pid)
                time.sleep(0.1)
            for pid in [process.pid, *descendants(process.pid)]:   # as torchrun and SLURM send it:
                with contextlib.suppress(ProcessLookupError):       # launcher, ranks and workers
                    os.kill(pid, signal.SIGTERM)
        while process.poll() is None and time.monotonic() < deadline:
            started |= descendants(process.pid)
            said = lines.last_matching(ending_line)
            if said is not None and time.monotonic() - said > ENDS_WITHIN_S:
                break                     # it should have ended by now
            time.sleep(0.1)
        ended = time.monotonic()
    finally:
        started |= descendants(process.pid)
        if process.poll() is None:
            process.kill()
            process.wait()
        grace = time.monotonic() + 10     # a worker notices within 5 s that its rank has gone
        while still_running(started) and time.monotonic() < grace:
            time.sleep(0.2)
        left = still_running(started)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for reader in lines.readers:
            reader.join(timeout=10)
    said = lines.last_matching(ending_line)
    assert said is not None, f"no line like {ending_line!r}:\n{lines.text()[-4000:]}"
    assert ended - said <= ENDS_WITHIN_S, (f"still running {ended - said:.0f} s after its last line "
                                           f"(rc {process.returncode}):\n{lines.text()[-3000:]}")
    assert not left, f"processes left behind 10 s after the launcher ended: {left}"
    assert (process.returncode == 0) == succeeds, lines.text()[-3000:]
    if succeeds:
        assert "Traceback" not in lines.text(), lines.text()[-3000:]
