"""The watch every rank keeps on the others and on its own DataLoader workers: one that dies or
freezes ends the job in bounded time with one `error:` line; time this rank was stopped is not counted."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import astuple, dataclass
from pathlib import Path

from common.errors import UserError, print_error

ERROR_KEY = "error"
BEAT_KEY, WHO_KEY = "beat/{}", "who/{}"       # a rank's heartbeat count, its "HOST PID" (.format(rank))


def read_key(store, key: str) -> str | None:
    return store.get(key).decode() if store.check([key]) else None


def post_error(store, message: str) -> str:
    """Leave `message` as the job's error unless one is there: the one there (`message` if no store)."""
    with contextlib.suppress(RuntimeError):        # torch's DistError: the store is gone
        store.compare_set(ERROR_KEY, "", message)
        return store.get(ERROR_KEY).decode()
    return message


def proc_state(pid) -> str:
    """The state letter of process `pid` here (/proc/PID/stat: R, S, T stopped, Z...), X if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


def fate(rank: int, who: str | None) -> str:
    """"rank R ..." and what became of its process `who` ("HOST PID"), as far as /proc here tells."""
    host, _, pid = (who or "").partition(" ")
    if host != socket.gethostname() or not pid.isdigit() or not Path("/proc/self").exists():
        return f"rank {rank} was killed, stopped or froze (SIGKILL, out of memory, SIGSTOP?)"
    deadline = time.monotonic() + 1.0
    while True:
        state = proc_state(pid)
        if state in ("X", "Z"):
            return f"rank {rank} (pid {pid}) was killed (SIGKILL, or out of memory)"
        if state in ("T", "t"):
            return f"rank {rank} (pid {pid}) is stopped (SIGSTOP)"
        if time.monotonic() > deadline:
            return f"rank {rank} (pid {pid}) froze"
        time.sleep(0.1)


@dataclass(frozen=True)
class WatchSettings:
    host: str                   # who serves the store, and at which ADDR:PORT, for the lines
    where: str
    silent_s: float             # dist.heartbeat_timeout_s
    every_s: float = 1.0        # how often to look
    grace_s: float = 5.0        # from a verdict to this rank's end


class RankWatch:
    """`verdict`: the `UserError` that ends this rank, once there is one; `stop()` ends the watch."""

    def __init__(self, store, rank: int, world: int, settings: WatchSettings, abort, leave):
        self.store, self.rank, self.peer = store, rank, (rank + 1) % world
        self.host, self.where, self.silent_s, self.every_s, self.grace_s = astuple(settings)
        self.abort, self.leave = abort, leave
        self.verdict: UserError | None = None
        self.gone: set[int] = set()              # the watched rank, once found silent
        self.who: dict[int, str] = {}            # "HOST PID" of the watched rank and of rank 0
        self.workers: dict[int, str] = {}        # pid -> name of this rank's own processes, watched too
        self._decided = self._answered = time.monotonic()
        self._stopped, self._lock, self._ending = threading.Event(), threading.Lock(), threading.Lock()
        self._threads = [threading.Thread(target=target, name=f"rank-watch-{target.__name__[1:]}",
                                          daemon=True) for target in (self._pulse, self._judge)]
        for thread in self._threads:
            thread.start()

    def decide(self, verdict: UserError) -> None:
        """The first verdict stands; the group is aborted at once."""
        with self._lock:
            if self.verdict is not None or self._stopped.is_set():
                return
            self.verdict, self._decided = verdict, time.monotonic()
        with contextlib.suppress(Exception):  # noqa: BLE001 - no group left to abort: the verdict stands
            self.abort()

    def store_lost(self, what: str) -> UserError:
        """The verdict when the store's host is gone or stopped (`what` the store did)."""
        if self.host == "rank 0" and 0 in self.who:
            return UserError(f"{fate(0, self.who[0])}: the job's store it serves at {self.where} "
                             f"{what}; the other ranks end")
        return UserError(f"{self.host}, which serves the job's store at {self.where}, was killed, "
                         f"stopped or froze: the store {what}; the other ranks end")

    def _pulse(self) -> None:
        store, last, seen, stopped = self.store, None, time.monotonic(), {}
        with contextlib.suppress(RuntimeError):
            store.set(WHO_KEY.format(self.rank), f"{socket.gethostname()} {os.getpid()}")    # for `fate`
        while not self._stopped.wait(self.every_s):
            try:
                store.add(BEAT_KEY.format(self.rank), 1)
                error = read_key(store, ERROR_KEY)
                count = store.add(BEAT_KEY.format(self.peer), 0)
                found = {rank: read_key(store, WHO_KEY.format(rank))
                         for rank in {0, self.peer} - self.who.keys()}
                self.who.update((rank, who) for rank, who in found.items() if who is not None)
            except RuntimeError:          # torch's DistError: the store closed
                self.decide(self.store_lost("is gone"))
                return
            now = time.monotonic()
            if now - self._answered > 3 * self.every_s:    # it did not look meanwhile (this process
                seen, stopped = now, {}                    # stopped, or the store): no evidence
            self._answered = now
            if error is not None:
                self.decide(UserError(error))
                return
            for pid, name in list(self.workers.items()):   # stopped, its rank would wait on it forever
                since = stopped.setdefault(pid, now) if proc_state(pid) in ("T", "t") else stopped.pop(pid, 0)
                if since and now - since > self.silent_s:
                    self.decide(UserError(post_error(store, (
                        f"rank {self.rank}'s {name} (pid {pid}) is stopped (SIGSTOP): stopped for "
                        f"{now - since:.0f} s (dist.heartbeat_timeout_s {self.silent_s:g} s); "
                        "the other ranks end"))))
                    return
            if count != last:
                last, seen = count, now
            elif now - seen > self.silent_s:
                self.gone.add(self.peer)
                message = (f"{fate(self.peer, self.who.get(self.peer))}: no sign of life for "
                           f"{now - seen:.0f} s (dist.heartbeat_timeout_s {self.silent_s:g} s); "
                           "the other ranks end")
                self.decide(UserError(post_error(store, message)))
                return

    def _judge(self) -> None:
        tick = resumed = time.monotonic()
        while not self._stopped.wait(self.every_s):
            now = time.monotonic()
            if now - tick > 3 * self.every_s:      # this process itself was stopped meanwhile
                resumed = now
            tick = now
            if self.verdict is None and now - max(self._answered, resumed) > self.silent_s:
                self.decide(self.store_lost(f"has not answered for {now - self._answered:.0f} s"))
            if self.verdict is not None and now - self._decided > self.grace_s:
                break
        with self._ending:
            if self._stopped.is_set():
                return
            print_error(self.verdict)
            sys.stdout.flush()
            self.leave()
            for pid in self.workers:                     # a stopped one would outlive the rank
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            os._exit(self.verdict.exit_code)

    def stop(self) -> None:
        with self._ending:                       # once the judge ends the process, it ends it
            self._stopped.set()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=2 * self.every_s + 1)   # the pulse may wait on a stopped store
