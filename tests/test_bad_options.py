"""Bad configuration values, options, environment variables and launch settings: refused with
one `error:` line naming the option before anything is built or written; the rows of the table in
docs/bad-input.md about them, and one case of each class of bad input in a real process.
(tests/bad_inputs.py says what each case asserts.)
"""
from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys

import pytest

from child_env import child_env
from bad_inputs import (TABLE_ROWS, check_row, first_ann, one_error_line, refused, skipped_lines, snapshot,
                        train_cli)
from test_preemption import REPO, worker_log


# -- config values: checked before anything is built or written ------------------------------------
@pytest.mark.parametrize("args,says", [
    (["--lr", "nan"], ["option optim.lr", "not a finite number"]),
    (["--lr", "inf"], ["option optim.lr", "not a finite number"]),
    (["--clip-grad", "nan"], ["option optim.clip_grad_norm", "not a finite number"]),
    (["--clip-grad", "-1"], ["option optim.clip_grad_norm", "-1.0 must be >= 0"]),
    (["--loss-scale", "nan"], ["option amp.loss_scale", "not a finite number"]),
    (["--set", "optim.warmup_start=-1"], ["option optim.warmup_start", "must be >= 0 and <= 1"]),
    (["--set", "optim.decay_factor=-0.2"], ["option optim.decay_factor", "must be > 0"]),
    (["--set", "train.max_steps_per_epoch=-1"], ["option train.max_steps_per_epoch", "must be >= 0"]),
    (["--workers", "-3"], ["option data.workers", "-3 must be >= 0"]),
    (["--seed", "-1"], ["option train.seed", "-1 must be >= 0"]),
    (["--set", "train.log_every=0"], ["option train.log_every", "0 must be >= 1"]),
    (["--set", "targets.keypoint_sigma=0"], ["option targets.keypoint_sigma", "must be > 0"]),
    (["--set", "optim.milestones=abc"], ["option optim.milestones", "expected a number, got 'abc'"]),
    (["--set", "inference.scales=[.inf]"], ["option inference.scales", "not a finite number"]),
    (["--set", "inference.scales=[]"], ["option inference.scales", "must have 1 to 16 items"]),
    (["--set", "optim.lr=[1]"], ["option optim.lr", "expected a number, got [1]"]),
    (["--set", "optim.lr=true"], ["option optim.lr", "expected a number, got True"]),
    (["--set", "train.batch_size=null"], ["option train.batch_size", "expected an integer, got null"]),
    (["--set", "dist.rendezvous_timeout_s=0"], ["option dist.rendezvous_timeout_s", "0 must be >= 1"]),
    (["--set", "dist.heartbeat_timeout_s=1"], ["option dist.heartbeat_timeout_s", "1 must be >= 3"]),
    (["--loss-scale", "1e30"], ["option amp.loss_scale", "1e+30 is not 'dynamic' or a number from 2^-24 to 2^24"]),
    (["--device", "tpu"], ["option train.device", "'tpu' is not auto, cpu, cuda"]),
    (["--set", "optim.max_bad_steps=0"], ["option optim.max_bad_steps", "0 must be >= 1"]),
    (["--set", "model.stacks=1000000000"], ["option model.stacks", "must be >= 1 and <= 64"]),
    (["--set", "model.stacks=16", "--set", "model.channels=2048"],
     ["option model.max_params_m", "million parameters", "--set model.max_params_m=N"]),
    (["--set", "data.input_size=500"], ["option data.input_size", "500 is not a positive multiple of 64"]),
    (["--set", "data.stride=8"], ["option data.stride", "8 is not 4", "the network's output stride is 4"]),
    (["--run-name", "..", "--overwrite"], ["option train.run_name", "'..' is not a plain folder name"]),
    (["--run-name", ".", "--overwrite"], ["option train.run_name", "'.' is not a plain folder name"]),
    (["--run-name", "../runs", "--overwrite"], ["option train.run_name", "not a plain folder name"]),
])
def test_bad_config_values_are_refused_before_anything_is_written(env, capsys, args, says):
    refused(capsys, train_cli, env["trainer"] + args, says, env["root"])


def test_null_is_refused_for_every_option_that_has_a_value(tmp_path):
    """An empty value in a YAML config (`lr:`) or `--set KEY=null` is one error naming the option,
    for every option of the schema; it used to reach the run as None (a traceback, at best)."""
    from common.errors import ConfigError
    from config.loader import build_config

    def options(section, prefix=""):
        for field in dataclasses.fields(section):
            value = getattr(section, field.name)
            if dataclasses.is_dataclass(value):
                yield from options(value, f"{prefix}{field.name}.")
            else:
                yield prefix + field.name, value
    found = list(options(build_config(None)))
    assert len(found) > 100
    for key, default in found:
        if default is None:                  # an option whose default is null takes it
            assert getattr(build_config(None, sets=[f"{key}=null"]).amp, "keep_batchnorm_fp32") is None
            continue
        with pytest.raises(ConfigError, match=rf"^option {re.escape(key)}: "):
            build_config(None, sets=[f"{key}=null"])
    preset = tmp_path / "empty_lr.yaml"
    preset.write_text("optim:\n  lr:\n")
    with pytest.raises(ConfigError, match=r"^option optim.lr: expected a number, got null .+, or leave the option out to keep "):
        build_config(str(preset))


def test_a_validation_file_without_training_data_is_refused_not_ignored(env, capsys, synthetic_h5):
    """Without --train-h5 the run trains on the synthetic dataset; it validated on that too, silently
    leaving the user's --val-h5 unread."""
    without_data = [a for a in env["trainer"] if a not in ("--train-h5", synthetic_h5[0])]
    refused(capsys, train_cli, without_data + ["--val-h5", synthetic_h5[1]],
            [f"--val-h5 {synthetic_h5[1]} without --train-h5", "give --train-h5 too"], env["root"])


@pytest.mark.slow
@pytest.mark.parametrize("row", TABLE_ROWS["test_bad_options"])
def test_table_row_gets_one_error_line_naming_what_to_fix(table, row):
    check_row(table, row)


# -- one of each class in a real process ------------------------------------------------------------------
@pytest.mark.slow
def test_one_case_per_class_in_a_real_process(env, tmp_path):
    root = env["root"]
    (env["images"] / "empty.jpg").write_bytes(b"")
    coco = json.loads(json.dumps(env["coco"]))
    coco["images"] = [dict(coco["images"][0], id=9, file_name="empty.jpg")]
    coco["annotations"] = []
    (tmp_path / "empty.json").write_text(json.dumps(coco))
    nan = json.loads(json.dumps(env["coco"]))
    first_ann(nan)["bbox"][0] = float("nan")
    (tmp_path / "nan.json").write_text(json.dumps(nan))
    py = sys.executable
    trainer = [py, "train.py"] + [str(a) for a in env["trainer"]]
    make = [py, "-m", "data.make_hdf5", "--images", str(env["images"]), "--quiet"]
    cases = {   # class: (command, texts of the error line)
        "data lost": (trainer + ["--run-name", "..", "--overwrite"], ["option train.run_name"]),
        "silently wrong": (make + ["--ann", str(tmp_path / "nan.json"), "--out", str(tmp_path / "o.h5")],
                           ["bbox holds nan"]),
        "hang": (trainer + ["--set", "model.stacks=1000000000"], ["option model.stacks"]),
        "traceback": (make + ["--ann", str(tmp_path / "empty.json"), "--out", str(tmp_path / "e.h5"),
                              "--skip-bad"], ["no image was kept"]),
        "unclear": (trainer + ["--device", "tpu"], ["option train.device", "'tpu'"]),
        "command line": (trainer + ["--epochs", "ten"], ["argument --epochs", "invalid int value: 'ten'",
                                                         "(see train.py --help)"]),
        "environment variable": ([py, "train_distributed.py", "--device", "cpu"] + trainer[2:],
                                 ["MASTER_PORT 99999 is not a port"]),
    }
    envs = {"environment variable": dict(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                         MASTER_PORT="99999")}
    before = snapshot(root)
    procs = {name: subprocess.Popen(command, cwd=REPO, env=child_env(**envs.get(name, {})),
                                    stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
             for name, (command, _) in cases.items()}
    for name, proc in procs.items():
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 2, (name, stderr[-2000:])
        listed, stderr = skipped_lines(stderr)          # --skip-bad lists what it skipped first
        assert listed == ([f"skipped: {env['images'] / 'empty.jpg'}: image 9 is an empty file (0 bytes)"]
                          if name == "traceback" else []), (name, listed)
        line = one_error_line(stderr)
        assert all(text in line for text in cases[name][1]), (name, line)
    assert snapshot(root) == before
    (env["images"] / "empty.jpg").unlink()


@pytest.mark.slow
def test_every_row_is_in_the_docs_table_and_checked_by_a_subject(table):
    section = (REPO / "docs" / "bad-input.md").read_text()
    rows = [row for subject in TABLE_ROWS.values() for row in subject]
    assert sorted(table["cases"]) == sorted(rows) and len(set(rows)) == len(rows)
    for row in rows:
        assert f"| {row} |" in section, row


@pytest.mark.slow
def test_both_ranks_refuse_an_indivisible_batch_and_torchrun_reports_their_exit_code(table):
    logs = table["logs"]
    for rank in (0, 1):
        assert "3 does not divide over 2 processes" in one_error_line(worker_log(logs, 0, rank, "stderr"),
                                                                      skip_progress=False)
    assert "exitcode: 2" in table["agent_stderr"]
