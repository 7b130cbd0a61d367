"""engine/logger.py's metrics.jsonl as resumed runs leave it: resume markers hide the records of
rolled-back steps from read() (and so from curves.png), however many resumes and cut lines; and how
often curves.png is drawn."""
from __future__ import annotations

from pathlib import Path

import engine.logger
from engine.logger import CURVES_EVERY_S, RunLogger


def train_records(log: RunLogger) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in log.read() if r["kind"] == "train"]


def test_read_after_several_resumes_keeps_only_the_training_that_counts(tmp_path):
    log = RunLogger(tmp_path, True, tensorboard=False)
    for step in range(1, 11):
        log.log("train", step, loss=1.0)
    log = RunLogger(tmp_path, True, tensorboard=False).open(resumed_step=6)
    for step in range(7, 10):
        log.log("train", step, loss=2.0)
    log = RunLogger(tmp_path, True, tensorboard=False).open(resumed_step=8)
    for step in range(9, 12):
        log.log("train", step, loss=3.0)
    assert train_records(log) == [(s, 1.0) for s in range(1, 7)] + [(7, 2.0), (8, 2.0)] + \
        [(s, 3.0) for s in (9, 10, 11)]


def test_a_resume_marker_after_a_line_cut_by_a_crash_still_counts(tmp_path):
    log = RunLogger(tmp_path, True, tensorboard=False)
    for step in range(1, 6):
        log.log("train", step, loss=1.0)
    with open(tmp_path / "metrics.jsonl", "a") as fh:    # a node crash cut the record of step 6
        fh.write('{"kind": "train", "step": 6, "lo')
    log = RunLogger(tmp_path, True, tensorboard=False).open(resumed_step=3)
    log.log("train", 4, loss=2.0)
    assert train_records(log) == [(1, 1.0), (2, 1.0), (3, 1.0), (4, 2.0)]


def test_curves_are_drawn_at_most_once_a_minute_and_at_the_runs_end(tmp_path, monkeypatch):
    clock, drawn = [1000.0], []
    monkeypatch.setattr(engine.logger.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr("matplotlib.figure.Figure.savefig",
                        lambda figure, path, **options: drawn.append(clock[0]) or Path(path).write_bytes(b"png"))
    log = RunLogger(tmp_path, True, tensorboard=False).open()
    for epoch, seconds in enumerate((10, 40, 20, 5, 50)):       # an epoch's end after each
        clock[0] += seconds
        log.log("train", epoch + 1, loss=1.0, lr=0.1)
        log.plot_curves()
    assert drawn == [1070.0]                                   # 70 s after the start, not again 55 s on
    log.close()                                                # the run's end draws whatever the time
    assert drawn == [1070.0, 1125.0] and (tmp_path / "curves.png").read_bytes() == b"png"
    assert CURVES_EVERY_S == 60.0
