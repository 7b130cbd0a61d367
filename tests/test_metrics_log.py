"""engine/logger.py's metrics.jsonl as resumed runs leave it: resume markers hide the records of
rolled-back steps from read() (and so from curves.png), however many resumes and cut lines."""
from __future__ import annotations

from engine.logger import RunLogger


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
