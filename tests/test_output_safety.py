"""Outputs never lose what a user has: run directories of other runs or in use, outputs equal to
an input, existing files without --overwrite, unwritable folders, a full disk and running out of
memory; the rows of the table in docs/bad-input.md about them. (tests/bad_inputs.py says what each
case asserts.)
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import cv2
import pytest
import torch

import evaluate
from data import make_hdf5
from data.h5format import KeypointH5
from runtime.checkpoint import load_checkpoint
from child_env import child_env
from bad_inputs import IMAGE, TABLE_ROWS, check_row, one_error_line, refused, snapshot, train_cli
from test_preemption import REPO, torchrun, worker_log


# -- run directories --------------------------------------------------------------------------------
def test_overwrite_waits_for_every_other_check_and_removes_only_the_trainers_files(env, capsys,
                                                                                   synthetic_h5):
    runs = env["runs"]
    work = runs / "again"
    shutil.copytree(runs / "done", work)
    (work / "val_pictures").mkdir()
    (work / "val_pictures" / "epoch_7.png").write_bytes(b"an earlier run's picture")
    refused(capsys, train_cli, env["trainer"] + ["--run-name", "again", "--overwrite", "--val-h5",
                                                 env["root"] / "nowhere.h5"],
            ["--val-h5", "no such file"], env["root"])
    # fine-tuning the run's own weights into it: --overwrite would remove them before the first save
    link = env["root"] / "start.pth"
    link.symlink_to(work / "last.pth")
    for weights in (work / "last.pth", link):
        refused(capsys, train_cli, env["trainer"] + ["--run-name", "again", "--overwrite", "--weights", weights],
                [f"--run-name/--out-dir {work / 'last.pth'} is the same file as --weights {weights}"],
                env["root"])
    link.unlink()
    assert train_cli(env["trainer"] + ["--run-name", "again", "--overwrite", "--epochs", "1",
                                       "--set", "train.max_steps_per_epoch=1"]) == 0
    assert (work / "mine.txt").read_text() == "a user's file inside a run"
    assert (work / "last.pth").is_file() and (runs / "notes.txt").is_file()
    # nothing of the replaced run is left to mix with this one's: its step losses, its pictures
    steps = [json.loads(line) for line in (work / "train_steps.jsonl").read_text().splitlines()]
    assert [record["step"] for record in steps] == [1]
    assert not (work / "val_pictures").exists()
    shutil.rmtree(work)


@pytest.mark.slow
def test_a_run_directory_in_use_is_refused_and_fresh_names_never_collide(env, capsys, monkeypatch):
    from engine.run_dir import pick_and_claim, release_run_dir
    from config.loader import build_config

    cfg = build_config(str(env["preset"]), sets=[f"train.out_dir={env['runs']}"])
    monkeypatch.setattr("time.strftime", lambda fmt: "run-20260101-000000")   # the same second
    first, made_first = pick_and_claim(cfg)
    second, made_second = pick_and_claim(cfg)
    assert first != second and made_first and made_second and second.name == "run-20260101-000000-2"
    release_run_dir(first, remove_if_empty=True)
    release_run_dir(second, remove_if_empty=True)
    busy = env["runs"] / "busy"
    busy.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from engine.run_dir import _claim; _claim(Path(sys.argv[1]), False); "
                               "print('locked', flush=True); time.sleep(60)", str(busy)],
                              cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        refused(capsys, train_cli, env["trainer"] + ["--run-name", "busy"],
                [str(busy), "is in use by another run right now"], env["root"])
    finally:
        holder.kill()
        holder.wait()
    shutil.rmtree(busy)


@pytest.mark.slow
def test_every_rank_gets_the_run_directory_error_and_nothing_hangs(env, tmp_path):
    """The main process picks and claims the directory; its refusal reaches the other ranks
    (they would otherwise wait for the path until the process group's timeout)."""
    before = snapshot(env["runs"])
    proc = subprocess.run(torchrun(tmp_path, *[str(a) for a in env["trainer"]], "--run-name", "done"),
                          cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0
    for rank in (0, 1):
        line = one_error_line(worker_log(tmp_path, 0, rank, "stderr"))
        assert f"{env['runs'] / 'done'} already holds a run" in line, line
    assert snapshot(env["runs"]) == before


# -- outputs are never inputs -------------------------------------------------------------------------
def test_an_output_equal_to_an_input_is_refused(env, capsys):
    root = env["root"]
    refused(capsys, make_hdf5.main, ["--ann", root / "coco.json", "--images", env["images"],
                                     "--out", root / "coco.json"],
            ["--out", "is the same file as --ann"], root)
    refused(capsys, make_hdf5.main, ["--ann", root / "coco.json", "--images", env["images"],
                                     "--out", env["images"] / ".." / "images" / IMAGE],
            [f"is the same file as --images {env['images'] / IMAGE}"], root)
    weights = env["runs"] / "done" / "last.pth"
    refused(capsys, evaluate.main, ["--weights", weights, "--h5", env["train_h5"], "--out", weights,
                                    "--device", "cpu"], ["--out", "same file as --weights"], root)


def test_an_output_that_is_a_loop_of_links_is_one_line_for_every_command(env, capsys, tmp_path):
    os.symlink(tmp_path / "b.json", tmp_path / "a.json")
    os.symlink(tmp_path / "a.json", tmp_path / "b.json")
    weights = env["runs"] / "done" / "last.pth"
    refused(capsys, evaluate.main, ["--weights", weights, "--h5", env["train_h5"], "--out", tmp_path / "a.json",
                                    "--device", "cpu"],
            [f"--out {tmp_path / 'a.json'}: a loop of symbolic links; give another path"], env["root"])


def test_an_existing_output_is_kept_unless_overwrite_is_given(env, capsys, tmp_path, synthetic_h5):
    """Every command that writes a file refuses one that is there (a user's own file, or an output of
    an earlier run) and leaves it byte-identical; --overwrite replaces it."""
    from data import preview
    import demo
    import export
    weights, picture, val_h5 = env["runs"] / "done" / "last.pth", env["images"] / IMAGE, synthetic_h5[1]
    commands = {   # the file each writes: (main, argv)
        "mine.h5": (make_hdf5.main, ["--ann", env["root"] / "coco.json", "--images", env["images"],
                                     "--quiet"]),
        "mine.json": (evaluate.main, ["--oracle", "--h5", val_h5, "--max-images", "1", "--no-progress"]),
        "mine.png": (preview.main, ["--h5", val_h5, "--n", "1"]),
        "mine.jpg": (demo.main, ["--weights", weights, "--image", picture]),
        "mine.avi": (demo.main, ["--weights", weights, "--video", env["root"] / "no_video_needed.avi"]),
        "mine.onnx": (export.main, ["--weights", weights]),
    }
    for name, (main, argv) in commands.items():
        (tmp_path / name).write_bytes(b"a file the user has")
        refused(capsys, main, argv + ["--out", tmp_path / name],
                [f"--out {tmp_path / name} already exists", "pass --overwrite to replace it"], tmp_path)
    for name in ("mine.h5", "mine.json", "mine.png", "mine.jpg"):
        main, argv = commands[name]
        assert main([str(a) for a in argv + ["--out", tmp_path / name, "--overwrite"]]) == 0, name
        assert (tmp_path / name).read_bytes() != b"a file the user has", name
    assert KeypointH5(tmp_path / "mine.h5").num_images == 4
    assert cv2.imread(str(tmp_path / "mine.jpg")) is not None


# -- the environment -------------------------------------------------------------------------------
def test_a_file_or_read_only_out_dir_is_one_line(env, capsys, tmp_path, monkeypatch):
    import errno
    (tmp_path / "file").write_text("not a folder")
    refused(capsys, train_cli, env["trainer"] + ["--out-dir", tmp_path / "file"],
            ["--out-dir", "a file, not a folder"], tmp_path)
    refused(capsys, train_cli, ["--config", env["preset"], "--out-dir", tmp_path / "runs",
                                "--set", f"data.synthetic_dir={tmp_path / 'file'}"],
            ["option data.synthetic_dir", "cannot make the synthetic dataset there"], tmp_path)
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o555)
    if os.geteuid() == 0:                 # root writes anywhere: the refusal it would get, faked
        mkdir = Path.mkdir

        def refuse(self, *args, **kwargs):
            if self.parent == read_only:
                raise PermissionError(errno.EACCES, "Permission denied")
            return mkdir(self, *args, **kwargs)
        monkeypatch.setattr(Path, "mkdir", refuse)
    refused(capsys, train_cli, env["trainer"] + ["--out-dir", read_only],
            ["cannot create the run directory there", "(permission denied)"], tmp_path)


def test_an_os_error_without_an_errno_is_quoted_by_its_text_not_as_none(env, capsys, tmp_path, monkeypatch):
    """A file system's OSError may carry no errno (strerror None): the line said '(None)'."""
    def refuse(self, *args, **kwargs):
        raise OSError("the network share went away")
    monkeypatch.setattr(Path, "mkdir", refuse)
    line = refused(capsys, train_cli, env["trainer"] + ["--out-dir", tmp_path / "share"],
                   ["--out-dir", "(the network share went away)"], tmp_path)
    assert "None" not in line


def test_a_picture_that_cannot_be_written_says_why_as_every_other_output(tmp_path, monkeypatch):
    """write_image (demo.py, data.preview, validation pictures) quotes the OSError as `os_reason`
    does: lower case, and its text where it has no errno."""
    import errno
    import re

    import numpy as np
    from common.errors import DataError
    from data.picture_files import write_image

    for error, says in ((OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), "(no space left on device)"),
                        (OSError("the network share went away"), "(the network share went away)")):
        def failing(*args, error=error):
            raise error
        monkeypatch.setattr(cv2, "imwrite", failing)
        with pytest.raises(DataError, match=re.escape(f"cannot write the picture there {says}")):
            write_image(tmp_path / "a.png", np.zeros((4, 4, 3), np.uint8))
        assert not list(tmp_path.iterdir())          # no temporary left


def test_full_disk_while_writing_curves_and_out_of_memory_are_one_line(env, capsys, tmp_path, monkeypatch):
    import errno
    from engine.build import ModelWithLoss

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr("matplotlib.figure.Figure.savefig", full)
    args = ["--config", env["preset"], "--out-dir", tmp_path, "--train-h5", env["train_h5"], "--epochs", "1",
            "--set", "train.max_steps_per_epoch=1"]
    capsys.readouterr()
    assert train_cli(args + ["--run-name", "disk"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"cannot write {tmp_path / 'disk' / 'curves.png'}: no space left on device" in line
    assert f"the last good checkpoint {tmp_path / 'disk' / 'last.pth'} is intact" in line
    assert load_checkpoint(tmp_path / "disk" / "last.pth")["epoch"] == 1
    monkeypatch.undo()

    def oom(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr(ModelWithLoss, "forward", oom)
    monkeypatch.setattr("engine.build.use_cuda_graphs", lambda amp, launch: True)   # as on one GPU
    kept = (tmp_path / "disk" / "last.pth").read_bytes()
    assert train_cli(args + ["--run-name", "disk", "--resume", "auto", "--epochs", "2"]) == 2
    line = one_error_line(capsys.readouterr().err)
    for text in ("out of memory on cpu", "lower --batch-size", "--input-size",
                 "or add --cuda-graphs False (the captured graphs hold their own memory)",
                 f"the last good checkpoint {tmp_path / 'disk' / 'last.pth'} is intact"):
        assert text in line, line
    assert (tmp_path / "disk" / "last.pth").read_bytes() == kept


@pytest.mark.slow
@pytest.mark.parametrize("row", TABLE_ROWS["test_output_safety"])
def test_table_row_gets_one_error_line_naming_what_to_fix(table, row):
    check_row(table, row)


@pytest.mark.slow
def test_table_refusals_leave_the_runs_untouched(table):
    runs, before = table["runs"], table["before"]
    assert (runs / "done" / "last.pth").read_bytes() == before["done"]       # another run's directory
    assert (runs / "disk" / "last.pth").read_bytes() == before["disk"]       # full disk while saving
    assert not list((runs / "disk").glob(".*tmp"))


def test_a_lock_file_that_is_a_folder_is_named(tmp_path):
    """It used to say the run folder could not be written, with the lock's '(Is a directory)'."""
    from common.errors import ConfigError
    from config import build_config
    from engine.run_dir import LOCK_FILE, pick_and_claim
    (tmp_path / "run" / LOCK_FILE).mkdir(parents=True)
    cfg = build_config("tiny", {"train": {"out_dir": str(tmp_path), "run_name": "run"}})
    with pytest.raises(ConfigError) as refused:
        pick_and_claim(cfg)
    assert str(refused.value) == f"{tmp_path / 'run' / LOCK_FILE}: the run's lock file is a folder; remove it"
