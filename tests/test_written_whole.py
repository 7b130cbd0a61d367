"""Outputs appear whole or not at all (`common.paths.written_whole`, used by pictures, videos,
HDF5 conversions and ONNX exports): a failed write leaves what the user had, and no temporary file."""
from __future__ import annotations

import contextlib
import os
import signal
import stat
import threading
import time

import pytest

from common.errors import ConfigError, run_cli
from common.paths import refuse_existing, write_text, written_whole


def test_a_finished_write_replaces_the_file_and_leaves_no_twin(tmp_path):
    out = tmp_path / "out.png"
    out.write_bytes(b"old")
    with written_whole(out) as temp:
        assert temp.parent == tmp_path and temp.suffix == ".png" and temp.name.startswith(".")
        temp.write_bytes(b"new")
    assert out.read_bytes() == b"new" and sorted(tmp_path.iterdir()) == [out]


def test_a_failed_write_keeps_the_users_file_and_removes_the_twin(tmp_path):
    out = tmp_path / "out.h5"
    out.write_bytes(b"the user's file")
    with pytest.raises(RuntimeError, match="disk full"):
        with written_whole(out) as temp:
            temp.write_bytes(b"half")
            raise RuntimeError("disk full")
    assert out.read_bytes() == b"the user's file" and sorted(tmp_path.iterdir()) == [out]


class _Finalized:
    """An object whose finalizer runs `then`; what is raised there is printed and dropped, as in the
    finalizers and callbacks of C libraries (h5py, OpenCV) that a conversion runs through."""

    def __init__(self, then):
        self.then = then

    def __del__(self):
        self.then()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")   # the swallowed raise
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_whose_raise_a_finalizer_swallowed_still_keeps_the_users_file(tmp_path, sig):
    out, went_on = tmp_path / "out.h5", []
    out.write_bytes(b"the user's file")

    def conversion(argv):
        with written_whole(out) as temp:
            _Finalized(lambda: signal.raise_signal(sig))     # the signal's handler raises in there
            went_on.append(True)
            temp.write_bytes(b"whole")

    assert run_cli(conversion, [], kept="an existing --out is as it was") == (130 if sig == signal.SIGINT else 143)
    assert went_on == [True]                  # the raise was swallowed: only the commit's check stopped it
    assert out.read_bytes() == b"the user's file" and sorted(tmp_path.iterdir()) == [out]


def test_a_writer_that_wrote_nothing_leaves_nothing(tmp_path):
    out = tmp_path / "clip.mp4"
    with written_whole(out):
        pass                                  # e.g. OpenCV refused the format and wrote no file
    assert not out.exists() and list(tmp_path.iterdir()) == []


# -- outputs that are not plain files: a device or FIFO is written into, a link followed ------------
def null_device(tmp_path):
    """A character device node of /dev/null's numbers, made here (the real one is never touched)."""
    node = tmp_path / "null"
    os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    return node


@pytest.mark.parametrize("overwrite", [True, False])
def test_a_character_device_is_written_into_and_stays_a_device(tmp_path, overwrite):
    node = null_device(tmp_path)
    write_text("--out", node, "results\n", overwrite=overwrite)      # no --overwrite needed either
    with written_whole(node, overwrite, "--dump-skeleton") as temp:
        temp.write_bytes(b"x" * 100_000)
    assert stat.S_ISCHR(node.stat().st_mode) and sorted(tmp_path.iterdir()) == [node]


def test_a_fifo_is_written_into_while_read_and_refused_without_a_reader(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match=r"^--out .*pipe: a FIFO no process reads; start its reader"):
        write_text("--out", fifo, "lost", overwrite=True)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    while not got and reader.is_alive():
        try:
            write_text("--out", fifo, "a" * 200_000)      # more than a pipe holds: written in parts
            break
        except ConfigError:                               # the reader has not opened it yet
            time.sleep(0.01)
    reader.join(10)
    assert got == [b"a" * 200_000] and stat.S_ISFIFO(fifo.stat().st_mode)


def test_a_block_device_is_refused_before_anything_is_written(tmp_path):
    disk = tmp_path / "disk"
    os.mknod(disk, 0o600 | stat.S_IFBLK, os.makedev(7, 0))
    for call in (lambda: refuse_existing("--out", disk, True), lambda: write_text("--out", disk, "x")):
        with pytest.raises(ConfigError, match=r"is a block device \(a disk\): writing there would destroy"):
            call()
    assert stat.S_ISBLK(disk.stat().st_mode)


@pytest.mark.parametrize("target_exists", [True, False])
def test_a_link_is_followed_its_target_written_and_the_link_kept(tmp_path, target_exists):
    (tmp_path / "real").mkdir()
    target, link = tmp_path / "real" / "out.json", tmp_path / "link.json"
    if target_exists:
        target.write_text("old")
    link.symlink_to(target)
    with pytest.raises(ConfigError, match="already exists") if target_exists else contextlib.nullcontext():
        write_text("--out", link, "new", overwrite=False)
    write_text("--out", link, "new", overwrite=True)
    assert link.is_symlink() and os.readlink(link) == str(target) and target.read_text() == "new"
    assert sorted(p.name for p in (tmp_path / "real").iterdir()) == ["out.json"]


def test_an_output_under_a_file_names_that_file(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError) as raised:
        write_text("--dump-skeleton", tmp_path / "notes.txt" / "sub" / "s.yaml", "x")
    assert str(raised.value) == (f"--dump-skeleton {tmp_path}/notes.txt/sub/s.yaml: {tmp_path}/notes.txt "
                                 "is a file, not a folder; choose another --dump-skeleton")
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_the_converter_writes_its_skeleton_into_a_device_with_overwrite(tmp_path, capsys, coco4_dir):
    from data.make_hdf5 import main as make_hdf5
    node = null_device(tmp_path)
    assert make_hdf5(["--ann", str(coco4_dir / "test_coco.json"), "--images", str(coco4_dir),
                      "--dump-skeleton", str(node), "--overwrite"]) == 0, capsys.readouterr()
    assert stat.S_ISCHR(node.stat().st_mode) and sorted(tmp_path.iterdir()) == [node]
