"""Outputs appear whole or not at all (`common.paths.written_whole`, used by pictures, videos,
HDF5 conversions and ONNX exports): a failed write leaves what the user had, and no temporary file."""
from __future__ import annotations

import pytest

from common.paths import written_whole


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


def test_a_writer_that_wrote_nothing_leaves_nothing(tmp_path):
    out = tmp_path / "clip.mp4"
    with written_whole(out):
        pass                                  # e.g. OpenCV refused the format and wrote no file
    assert not out.exists() and list(tmp_path.iterdir()) == []
