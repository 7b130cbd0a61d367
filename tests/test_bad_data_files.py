"""Bad data files: COCO JSON, images and HDF5 datasets that are malformed, missing, damaged or of
another kind get one `error:` line naming the file and the item, and nothing is written; the rows
of the table in docs/bad-input.md about them. (tests/bad_inputs.py says what each case asserts.)
"""
from __future__ import annotations

import json
import re
import shutil
import struct
from pathlib import Path

import cv2
import h5py
import numpy as np
import pytest

from data import make_hdf5
from data.h5format import KeypointH5
from conftest import COCO4_DIR
from bad_inputs import TABLE_ROWS, check_row, first_ann, one_error_line, refused, train_cli


# -- COCO JSON, field by field ------------------------------------------------------------------------
def _edit(change):
    def apply(coco):
        change(coco)
        return coco
    return apply


COCO_CASES = {
    "NaN keypoint": (_edit(lambda c: first_ann(c)["keypoints"].__setitem__(0, float("nan"))),
                     ["annotation", "keypoints holds nan, not a finite number"]),
    "visibility 3": (_edit(lambda c: first_ann(c)["keypoints"].__setitem__(
        next(i for i in range(2, 51, 3) if first_ann(c)["keypoints"][i]), 3)),
        ["visibility 3, not 0, 1 or 2"]),
    "zero box": (_edit(lambda c: first_ann(c).__setitem__("bbox", [1, 1, 0, 5])), ["has no positive width"]),
    "negative box": (_edit(lambda c: first_ann(c).__setitem__("bbox", [1, 1, -4, 5])),
                     ["no positive width"]),
    # boxes whose numbers cannot be [x, y, w, h] of that picture (issue 47): converted without a word
    "box as [x1, y1, x2, y2] past the picture": (
        _edit(lambda c: first_ann(c).__setitem__("bbox", [400, 300, 1100, 900])),
        ["annotation", "bbox [400, 300, 1100, 900] cannot be [x, y, width, height] of the",
         "lies far outside"]),
    "box far left of the picture": (_edit(lambda c: first_ann(c).__setitem__("bbox", [-5000, 10, 20, 20])),
                                    ["bbox [-5000, 10, 20, 20] cannot be [x, y, width, height]"]),
    "keypoint far outside": (_edit(lambda c: first_ann(c)["keypoints"].__setitem__(
        next(i - 2 for i in range(2, 51, 3) if first_ann(c)["keypoints"][i]), 1e6)), ["lies far outside"]),
    "absolute file_name": (_edit(lambda c: c["images"][0].__setitem__(
        "file_name", str(COCO4_DIR / c["images"][0]["file_name"]))), ["must be a path inside --images"]),
    "file_name with ..": (_edit(lambda c: c["images"][0].__setitem__(
        "file_name", "../images/" + c["images"][0]["file_name"])), ["must be a path inside --images"]),
    "duplicate image id": (_edit(lambda c: c["images"].append(dict(c["images"][0], file_name="b.jpg"))),
                           ["appears twice in images", "'000000000785.jpg' and 'b.jpg'"]),
    "category matching nothing": (_edit(lambda c: [a.__setitem__("category_id", 7)
                                                   for a in c["annotations"]]),
                                  ["no annotation has the person category's id 1", "category ids 7"]),
    "negative area": (_edit(lambda c: first_ann(c).__setitem__("area", -5)),
                      ["area -5 is not a finite number >= 0"]),
    "missing bbox": (_edit(lambda c: first_ann(c).pop("bbox")), ["bbox None is not a list of 4 numbers"]),
    "missing file_name": (_edit(lambda c: c["images"][0].pop("file_name")), ["file_name None"]),
    "float height": (_edit(lambda c: c["images"][0].__setitem__("height", 425.5)), ["height 425.5"]),
    "string id": (_edit(lambda c: c["images"][0].__setitem__("id", "785")), ["image id '785'"]),
    "huge id": (_edit(lambda c: c["images"][0].__setitem__("id", 2 ** 70)), ["from 0 to 2^63-1"]),
    "crowdIndex beyond float": (_edit(lambda c: c["images"][0].__setitem__("crowdIndex", 10 ** 400)),
                                ["crowdIndex 1000", "is not a number"]),
    "images not a list": (_edit(lambda c: c.__setitem__("images", {"a": 1})),
                          ["'images' is a dict, not a list"]),
    "bad RLE": (_edit(lambda c: first_ann(c).__setitem__("segmentation", {"size": [1, 1], "counts": [1]})),
                ["segmentation size [1, 1] is not the image's"]),
    "bad compressed RLE": (_edit(lambda c: first_ann(c).__setitem__(
        "segmentation", {"size": [c["images"][0]["height"], c["images"][0]["width"]], "counts": "!!!!"})),
        ["not a valid compressed RLE"]),
}


@pytest.mark.parametrize("case", sorted(COCO_CASES))
def test_a_bad_coco_field_names_the_item_and_writes_nothing(env, capsys, tmp_path, case):
    change, says = COCO_CASES[case]
    coco = change(json.loads(json.dumps(env["coco"])))
    ann = tmp_path / "bad.json"
    ann.write_text(json.dumps(coco))
    refused(capsys, make_hdf5.main, ["--ann", ann, "--images", env["images"], "--out", tmp_path / "out.h5",
                                     "--quiet"], [str(ann)] + says, tmp_path)
    assert not (tmp_path / "out.h5").exists()


def test_skip_bad_skips_and_lists_bad_images_and_bad_annotations(env, capsys, tmp_path):
    coco = json.loads(json.dumps(env["coco"]))
    bad_ann = first_ann(coco)
    bad_ann["keypoints"][2] = 7
    broken = coco["images"][-1]["file_name"]
    images = tmp_path / "images"
    shutil.copytree(env["images"], images)
    (images / broken).write_bytes(b"")                               # the most common broken download
    (tmp_path / "a.json").write_text(json.dumps(coco))
    out = tmp_path / "out.h5"
    assert make_hdf5.main([str(a) for a in ("--ann", tmp_path / "a.json", "--images", images, "--out", out,
                                            "--split", "val", "--skip-bad", "--quiet")]) == 0
    listed = capsys.readouterr().err                                 # --skip-bad lists on stderr
    assert f"annotation {bad_ann['id']} (image {bad_ann['image_id']}): keypoint 0 has visibility 7" in listed
    assert f"{images / broken}: image" in listed and "is an empty file (0 bytes)" in listed
    kept = KeypointH5(out)
    assert kept.num_images == len(coco["images"]) - 2
    assert bad_ann["image_id"] not in [kept.image_info(i)["id"] for i in range(kept.num_images)]
    one = dict(coco, images=[coco["images"][-1]], annotations=[])     # only the empty image
    (tmp_path / "b.json").write_text(json.dumps(one))
    refused(capsys, make_hdf5.main, ["--ann", tmp_path / "b.json", "--images", images, "--out",
                                     tmp_path / "none.h5", "--skip-bad", "--quiet"],
            ["no image was kept (1 bad image)", "nothing written"], tmp_path,
            skipped=[f"skipped: {images / broken}: image {one['images'][0]['id']} is an empty file (0 bytes)"])


def exif_jpeg(pixels: np.ndarray, orientation: int) -> bytes:
    """A JPEG of `pixels` with an EXIF orientation tag, the APP1 segment crafted by hand: TIFF
    header (big-endian), one IFD entry 0x0112 SHORT = orientation."""
    jpeg = cv2.imencode(".jpg", pixels, [cv2.IMWRITE_JPEG_QUALITY, 100])[1].tobytes()
    tiff = b"MM\x00\x2a" + struct.pack(">I", 8) + struct.pack(">H", 1)
    tiff += struct.pack(">HHIHH", 0x0112, 3, 1, orientation, 0) + struct.pack(">I", 0)
    body = b"Exif\x00\x00" + tiff
    return jpeg[:2] + b"\xff\xe1" + struct.pack(">H", len(body) + 2) + body + jpeg[2:]


@pytest.mark.parametrize("orientation", [3, 6])
def test_exif_orientation_is_ignored_everywhere(tmp_path, orientation):
    """COCO's labels are on the stored pixels: the converter and every decoder ignore the tag."""
    pixels = np.zeros((40, 64, 3), np.uint8)
    pixels[:10, :20] = 255                                           # a white corner, top left
    data = exif_jpeg(pixels, orientation)
    shown = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)    # the tag applied
    assert shown.shape[:2] == (64, 40) if orientation == 6 else shown[2, 2, 0] < 50
    (tmp_path / "a.jpg").write_bytes(data)
    coco = {"images": [{"id": 1, "file_name": "a.jpg", "width": 64, "height": 40}],
            "annotations": [], "categories": [dict(COCO_CATEGORY)]}
    (tmp_path / "a.json").write_text(json.dumps(coco))
    make_hdf5.convert(tmp_path / "a.json", tmp_path, tmp_path / "a.h5",
                      make_hdf5.ConvertSettings(split="val", progress=False))
    image = KeypointH5(tmp_path / "a.h5").decode_image(0)
    assert image.shape[:2] == (40, 64) and image[2, 2, 0] > 200 and image[-2, -2, 0] < 50


COCO_CATEGORY = json.loads((COCO4_DIR / "test_coco.json").read_text())["categories"][0]


# -- our own files: nothing stored is trusted -----------------------------------------------------------
def _damaged_h5(env, tmp_path, change) -> Path:
    path = tmp_path / "damaged.h5"
    shutil.copy(env["train_h5"], path)
    with h5py.File(path, "r+") as f:
        change(f)
    return path


def _set(name, value):
    def change(f):
        del f[name]
        f[name] = value
    return change


H5_CASES = {
    "split test": (lambda f: f.attrs.__setitem__("split", "test"), "split 'test' is not train or val"),
    "string version": (lambda f: f.attrs.__setitem__("version", "one"),
                       "format version 'one' is not a number"),
    "bad categories JSON": (lambda f: f.attrs.__setitem__("categories", "{oops"), "damaged keypoint dataset"),
    "sample out of range": (lambda f: _set("samples", np.array([[10 ** 6, 0]]))(f), "samples refer to"),
    "no images": (lambda f: [f[name].resize((0,) + f[name].shape[1:]) for name in (
        "images/encoded", "images/file_name", "images/annotations", "images/masks")] and [
        _set(name, np.zeros((0,) + f[name].shape[1:], f[name].dtype))(f) for name in (
            "images/id", "images/size", "images/people", "samples")], "it holds no images"),
    "huge stored size": (lambda f: _set("images/size", np.full(f["images/size"].shape, 10 ** 9, np.int32))(f),
                         "an image size is outside 1..65535"),
}


@pytest.mark.parametrize("case", sorted(H5_CASES))
def test_damaged_hdf5_metadata_is_one_line_naming_the_file(env, capsys, tmp_path, case):
    change, says = H5_CASES[case]
    path = _damaged_h5(env, tmp_path, change)
    refused(capsys, train_cli, ["--config", env["preset"], "--out-dir", tmp_path / "runs",
                                "--train-h5", path],
            [str(path), says], tmp_path)


def test_damaged_masks_and_image_bytes_name_the_file(env, tmp_path):
    from common.errors import DataError
    path = _damaged_h5(env, tmp_path, lambda f: None)
    with h5py.File(path, "r+") as f:
        f["images/masks"][0] = np.zeros(7, np.uint8)                 # not (length, value) triples
        f["images/encoded"][1] = np.zeros(0, np.uint8)
    h5 = KeypointH5(path)
    with pytest.raises(DataError, match=f"{path}: image 0: damaged masks"):
        h5.masks(0)
    with pytest.raises(DataError, match=f"{path}: image 1 .* cannot be decoded"):
        h5.decode_image(1)


def damaged_pictures(env, tmp_path) -> Path:
    """A copy of the synthetic training file whose every stored picture is 5 zero bytes."""
    def change(f):
        for img in range(len(f["images/encoded"])):
            f["images/encoded"][img] = np.zeros(5, np.uint8)
    return _damaged_h5(env, tmp_path, change)


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])   # workers: processes
def test_a_damaged_picture_is_one_line_naming_it_with_or_without_dataloader_workers(env, capsys, tmp_path,
                                                                                     workers):
    path = damaged_pictures(env, tmp_path)
    capsys.readouterr()
    assert train_cli(["--config", env["preset"], "--out-dir", tmp_path / "runs", "--train-h5", path,
                      "--device", "cpu", "--workers", workers]) == 2
    line = one_error_line(capsys.readouterr().err)
    said = rf"error: {re.escape(str(path))}: image \d+ \(\S+\.jpg\) cannot be decoded"
    assert re.fullmatch(said, line), line


@pytest.mark.slow
@pytest.mark.parametrize("row", TABLE_ROWS["test_bad_data_files"])
def test_table_row_gets_one_error_line_naming_what_to_fix(table, row):
    check_row(table, row)


@pytest.mark.slow
def test_refused_data_files_leave_no_half_written_dataset(table):
    assert not (table["root"] / "out.h5").exists()
    assert not list(table["root"].glob(".out.h5.*"))
