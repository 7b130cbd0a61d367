"""Bad checkpoints and resumes: weights of another model or layout, damaged or newer files, files
that would run code, saved configs that no longer fit, and where a resumed run writes; the rows of
the table in docs/bad-input.md about them. (tests/bad_inputs.py says what each case asserts.)
"""
from __future__ import annotations

import shutil

import pytest
import torch

import evaluate
from runtime.checkpoint import FORMAT_VERSION, load_checkpoint, save_checkpoint
from bad_inputs import TABLE_ROWS, check_row, refused, snapshot, train_cli


def test_resume_of_a_copied_checkpoint_writes_next_to_it(env, capsys):
    copy = env["root"] / "copy"
    copy.mkdir()
    shutil.copy(env["runs"] / "done" / "last.pth", copy / "last.pth")
    done = snapshot(env["runs"] / "done")
    assert train_cli(["--resume", copy / "last.pth", "--train-h5", env["train_h5"], "--epochs", "2",
                      "--set", "train.max_steps_per_epoch=1"]) == 0
    assert load_checkpoint(copy / "last.pth")["epoch"] == 2
    assert snapshot(env["runs"] / "done") == done
    refused(capsys, train_cli, ["--resume", copy / "last.pth", "--run-name", "done", "--out-dir", env["runs"],
                                "--epochs", "3"],
            ["continues the run in", "not --run-name done"], env["root"])
    shutil.rmtree(copy)


def test_resume_auto_refuses_a_newer_or_damaged_checkpoint_and_keeps_it(env, capsys):
    work = env["runs"] / "newer"
    shutil.copytree(env["runs"] / "done", work)
    torch.save({"format_version": FORMAT_VERSION + 1, "step": 99}, work / "epoch_9.pth")
    refused(capsys, train_cli, env["trainer"] + ["--run-name", "newer", "--resume", "auto"],
            [str(work / "epoch_9.pth"), "newer than this trainer", "Nothing was overwritten"], env["root"])
    shutil.rmtree(work)


def test_a_requeued_job_resumes_and_says_its_weights_are_not_loaded(env, capsys):
    """`--resume auto --weights W` in a job script: the first start loads W, a restart resumes the run
    from its checkpoint and says W was not loaded."""
    work = env["runs"] / "requeued"
    shutil.copytree(env["runs"] / "done", work)
    weights = env["runs"] / "done" / "last.pth"
    capsys.readouterr()
    assert train_cli(env["trainer"] + ["--run-name", "requeued", "--resume", "auto", "--weights", weights,
                                       "--epochs", "2", "--set", "train.max_steps_per_epoch=1"]) == 0
    printed = capsys.readouterr()
    lines = (printed.out + printed.err).splitlines()
    not_loaded = f"--weights {weights} not loaded: --resume auto continues the run from {work / 'last.pth'}"
    assert not_loaded in lines
    assert any(line.startswith(f"resumed from {work / 'last.pth'}: epoch 2") for line in lines)
    shutil.rmtree(work)


@pytest.mark.parametrize("change,says", [
    (lambda s: s.pop("optimizer"), "it has no 'optimizer'"),
    (lambda s: s.__setitem__("epoch", "1"), "epoch is str"),
])
def test_a_damaged_checkpoint_to_resume_is_one_line(env, capsys, tmp_path, change, says):
    state = load_checkpoint(env["runs"] / "done" / "last.pth")
    change(state)
    (tmp_path / "run").mkdir()
    save_checkpoint(tmp_path / "run" / "last.pth", state)
    refused(capsys, train_cli, ["--config", env["preset"], "--resume", tmp_path / "run" / "last.pth",
                                "--train-h5", env["train_h5"]],
            [str(tmp_path / "run" / "last.pth"), says], tmp_path)


def test_a_saved_config_that_no_longer_fits_names_the_file_and_the_way_on(env, capsys, tmp_path):
    state = load_checkpoint(env["runs"] / "done" / "last.pth")
    state["config"]["model"]["old_width"] = 3                         # a field renamed since
    (tmp_path / "run").mkdir()
    save_checkpoint(tmp_path / "run" / "last.pth", state)
    refused(capsys, train_cli, ["--resume", tmp_path / "run" / "last.pth", "--train-h5", env["train_h5"]],
            [f"the config saved in checkpoint {tmp_path / 'run' / 'last.pth'}", "'model.old_width'",
             "--config PRESET"], tmp_path)
    state["config"]["model"].pop("old_width")
    save_checkpoint(tmp_path / "run" / "last.pth", state)
    line = refused(capsys, train_cli, ["--resume", tmp_path / "run" / "last.pth", "--train-h5",
                                       env["train_h5"], "--lr", "nan"], ["option optim.lr"], tmp_path)
    assert "saved in checkpoint" not in line                          # the flag is wrong, not the file
    state["config"]["model"]["stacks"] = 10 ** 9                      # would build forever
    save_checkpoint(tmp_path / "run" / "last.pth", state)
    refused(capsys, evaluate.main, ["--weights", tmp_path / "run" / "last.pth", "--h5", env["train_h5"],
                                    "--device", "cpu", "--out", tmp_path / "r.json"],
            ["the config saved in checkpoint", "option model.stacks"], tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("row", TABLE_ROWS["test_bad_checkpoints"])
def test_table_row_gets_one_error_line_naming_what_to_fix(table, row):
    check_row(table, row)


@pytest.mark.slow
def test_a_checkpoint_that_runs_code_runs_none(table):
    assert not (table["root"] / "code_ran").exists()
