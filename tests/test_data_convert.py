"""COCO -> HDF5: stored content of real COCO images, main-person rule, masks, AP from the file,
clear errors for each kind of bad input, and the checks made when a file is opened."""
from __future__ import annotations

import json
import pickle
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import cv2
import h5py
import numpy as np
import pytest
from PIL import Image
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

from common.errors import DataError
from data.skeleton import builtin
from data.h5format import KeypointH5, check_split
from data.make_hdf5 import ConvertSettings, convert, main, main_people

COCO_SKELETON = builtin("coco")
COCO_TO_OURS = COCO_SKELETON.dataset_index
NECK = COCO_SKELETON.keypoints.index("neck")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def coco4_h5(coco4_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("coco4") / "val.h5"
    summary = convert(coco4_dir / "test_coco.json", coco4_dir, out,
                      ConvertSettings(split="val", progress=False))
    return out, summary


def test_summary_counts_and_original_bytes(coco4_h5, coco4_dir):
    path, summary = coco4_h5
    assert (summary["images"], summary["people"], summary["people_without_keypoints"],
            summary["crowd_regions"]) == (4, 12, 2, 0)
    h5 = KeypointH5(path)
    assert h5.split == "val" and h5.num_images == 4 and h5.num_samples == summary["samples"]
    for img in range(h5.num_images):
        info = h5.image_info(img)
        assert h5.encoded_image(img).tobytes() == (coco4_dir / info["file_name"]).read_bytes()
        assert h5.decode_image(img).shape == (info["height"], info["width"], 3)
    raw = sum(5 * h5.image_size(i)[0] * h5.image_size(i)[1] for i in range(4))
    assert path.stat().st_size <= raw / 5        # <= 1/5 of raw pixels plus uncompressed masks


def test_people_match_the_json_with_neck_rule(coco4_h5, coco4_dir):
    h5 = KeypointH5(coco4_h5[0])
    coco = json.loads((coco4_dir / "test_coco.json").read_text())
    for img in range(h5.num_images):
        image_id = h5.image_info(img)["id"]
        anns = [a for a in coco["annotations"] if a["image_id"] == image_id and a["num_keypoints"] > 0]
        people = h5.people(img)
        assert people.shape == (len(anns), 18, 3)
        for person, ann in zip(people, anns):
            kp = np.array(ann["keypoints"], np.float32).reshape(17, 3)
            np.testing.assert_array_equal(person[list(COCO_TO_OURS)], kp)
            right, left = kp[6], kp[5]                        # COCO right / left shoulder
            if right[2] > 0 and left[2] > 0:
                np.testing.assert_allclose(person[NECK, :2], (right[:2] + left[:2]) / 2)
                assert person[NECK, 2] == min(right[2], left[2])
            else:
                assert person[NECK, 2] == 0


def test_main_person_rule():
    def ann(x, y, w, h, n=10):
        return {"bbox": [x, y, w, h], "area": w * h, "num_keypoints": n}
    anns = [ann(0, 0, 100, 200), ann(10, 10, 100, 200),       # 2nd: centre 14 px from 1st (< 60)
            ann(300, 0, 100, 200, n=4),                          # too few keypoints
            ann(500, 0, 20, 40),                                 # too small (800 px^2)
            ann(200, 0, 100, 200)]                               # far enough
    assert main_people(anns) == [0, 4]


def test_ignore_and_person_masks(coco4_h5, coco4_dir):
    h5 = KeypointH5(coco4_h5[0])
    coco = COCO(str(coco4_dir / "test_coco.json"))
    for img in range(h5.num_images):
        image_id = h5.image_info(img)["id"]
        anns = coco.loadAnns(coco.getAnnIds(imgIds=image_id))
        ignore, person = h5.masks(img)
        expected_ignore = np.zeros_like(ignore)
        for a in anns:
            if a["num_keypoints"] == 0:
                expected_ignore |= coco.annToMask(a)
            assert (person[coco.annToMask(a) > 0] == 1).all()
        np.testing.assert_array_equal(ignore, expected_ignore)
    assert sum(KeypointH5(coco4_h5[0]).masks(i)[0].sum() for i in range(4)) > 0


def test_ap_from_the_file_alone(coco4_h5):
    gt = COCO()
    gt.dataset = KeypointH5(coco4_h5[0]).coco_ground_truth()
    gt.createIndex()
    results = [{"image_id": a["image_id"], "category_id": 1, "keypoints": a["keypoints"], "score": 1.0}
               for a in gt.dataset["annotations"] if a["num_keypoints"] > 0]
    evaluator = COCOeval(gt, gt.loadRes(results), "keypoints")
    evaluator.evaluate()
    evaluator.accumulate()
    evaluator.summarize()
    assert evaluator.stats[0] == pytest.approx(1.0)


def test_handle_is_not_pickled_and_reopens(coco4_h5):
    h5 = KeypointH5(coco4_h5[0]).open()
    clone = pickle.loads(pickle.dumps(h5))
    assert clone._handle is None and clone._meta is None
    np.testing.assert_array_equal(clone.people(1), h5.people(1))


def test_check_split_refuses_a_val_file_for_training(coco4_h5):
    h5 = KeypointH5(coco4_h5[0])
    check_split(h5, "val")
    with pytest.raises(DataError, match="'val' split"):
        check_split(h5, "train")


def test_train_split_keeps_only_images_with_a_main_person(coco4_dir, tmp_path):
    summary = convert(coco4_dir / "test_coco.json", coco4_dir, tmp_path / "t.h5",
                      ConvertSettings(progress=False))
    assert summary["images"] + summary["skipped"].get("no main person", 0) == 4
    assert KeypointH5(tmp_path / "t.h5").split == "train"
    assert not list(tmp_path.glob("*.tmp"))


def test_max_images_converts_the_first_images_of_the_json(coco4_dir, tmp_path, capsys):
    coco = json.loads((coco4_dir / "test_coco.json").read_text())
    out = tmp_path / "two.h5"
    assert main(["--ann", str(coco4_dir / "test_coco.json"), "--images", str(coco4_dir),
                 "--out", str(out), "--split", "val", "--max-images", "2", "--quiet"]) == 0
    h5 = KeypointH5(out)
    assert h5.num_images == 2
    assert [h5.image_info(i)["file_name"] for i in range(2)] == [im["file_name"] for im in coco["images"][:2]]
    assert main(["--ann", str(coco4_dir / "test_coco.json"), "--images", str(coco4_dir),
                 "--out", str(out), "--max-images", "-1"]) == 2
    assert capsys.readouterr().err.startswith("error: option --max-images: -1")


# -- bad input ---------------------------------------------------------------------------------
@pytest.fixture
def coco_copy(coco4_dir, tmp_path):
    """A writable copy of coco4: (json path, image dir, loaded json)."""
    images = tmp_path / "images"
    shutil.copytree(coco4_dir, images)
    for p in images.iterdir():
        p.chmod(0o644)
    return images / "test_coco.json", images, json.loads((coco4_dir / "test_coco.json").read_text())


def run_cli(args, capsys):
    code = main(args)
    err = capsys.readouterr().err.strip()
    return code, err


@pytest.mark.parametrize("damage,expected", [
    (lambda ann, d, images: ann.write_text("{\"images\": [1,"), "malformed JSON"),
    (lambda ann, d, images: ann.write_text(json.dumps(dict(d, categories=[{"id": 1, "name": "cat"}]))),
     "no 'person' category"),
    (lambda ann, d, images: ann.write_text(json.dumps(dict(d, annotations=[
        dict(d["annotations"][0], keypoints=[0] * 48)] + d["annotations"][1:]))), "annotation 442619"),
    (lambda ann, d, images: (images / "000000040083.jpg").unlink(),
     "000000040083.jpg: image 40083 .* missing"),
    (lambda ann, d, images: (images / "000000040083.jpg").write_bytes(b"not a jpeg"),
     "000000040083.jpg: image 40083 is not a readable image"),
    (lambda ann, d, images: cv2.imwrite(str(images / "000000040083.jpg"),
                                        np.zeros((10, 20, 3), np.uint8)),
     "000000040083.jpg: image 40083 is 20x10 pixels but .* says 500x333"),
])
def test_bad_input_one_line_error(coco_copy, tmp_path, capsys, damage, expected):
    ann, images, data = coco_copy
    damage(ann, data, images)
    code, err = run_cli(["--ann", str(ann), "--images", str(images), "--out", str(tmp_path / "o.h5"),
                         "--quiet"], capsys)
    assert code == 2
    assert err.startswith("error: ") and len(err.splitlines()) == 1
    assert re.search(expected, err), err
    assert not (tmp_path / "o.h5").exists()


def test_a_picture_past_pillows_bomb_limit_has_its_size_read_without_a_warning(coco_copy, tmp_path, capsys):
    """The size comes from the picture's header (Pillow): 90 Mpx is a size, no warning line."""
    ann, images, _ = coco_copy
    cv2.imwrite(str(images / "000000040083.jpg"), np.zeros((9500, 9500), np.uint8))
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        code, err = run_cli(["--ann", str(ann), "--images", str(images), "--out", str(tmp_path / "o.h5"),
                             "--quiet"], capsys)
    assert (code, err) == (2, f"error: {images / '000000040083.jpg'}: image 40083 is 9500x9500 pixels but "
                              f"{ann} says 500x333")


def test_skip_bad_lists_skipped_images(coco_copy, tmp_path, capsys):
    ann, images, _ = coco_copy
    (images / "000000040083.jpg").unlink()
    code = main(["--ann", str(ann), "--images", str(images), "--out", str(tmp_path / "o.h5"),
                 "--skip-bad", "--quiet", "--split", "val"])
    said = capsys.readouterr()
    out = said.out
    assert code == 0 and "3 images" in out and "skipped 1 images: bad image" in out
    assert [line for line in said.err.splitlines() if "000000040083.jpg" in line] == [
        f"skipped: {images / '000000040083.jpg'}: image 40083 listed in {ann} is missing; the JSON's "
        "coco_url is http://images.cocodataset.org/val2017/000000040083.jpg: --images the folder of "
        "COCO's val2017 pictures"]
    assert KeypointH5(tmp_path / "o.h5").num_images == 3



@pytest.mark.parametrize("mistake, expected", [
    ("ann is a folder", "{images}: a folder; --ann takes the COCO JSON file"),
    ("images is a file", "{ann}: not a folder; --images takes the folder of the images"),
    ("out is a folder", "--out {tmp}: a folder; give the path of the HDF5 file to write"),
    ("out below a file", "--out {ann}/o.h5: cannot write the file there"),
])
def test_path_mistakes_are_one_line_errors(coco_copy, tmp_path, capsys, mistake, expected):
    ann, images, _ = coco_copy
    args = {"--ann": str(ann), "--images": str(images), "--out": str(tmp_path / "o.h5")}
    key, value = {"ann is a folder": ("--ann", images), "images is a file": ("--images", ann),
                  "out is a folder": ("--out", tmp_path),
                  "out below a file": ("--out", ann / "o.h5")}[mistake]
    args[key] = str(value)
    code, err = run_cli([a for pair in args.items() for a in pair] + ["--quiet"], capsys)
    assert code == 2 and err.startswith("error: ") and len(err.splitlines()) == 1, err
    assert expected.format(images=images, ann=ann, tmp=tmp_path) in err
    assert not list(tmp_path.glob(".*.tmp")) and not list(images.glob(".*.tmp"))

@pytest.mark.slow
def test_cli_error_has_no_traceback(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("[")
    proc = subprocess.run([sys.executable, "-m", "data.make_hdf5", "--ann", str(bad), "--images",
                           str(tmp_path), "--out", str(tmp_path / "o.h5")], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"error: {bad}: malformed JSON") and "Traceback" not in proc.stderr


# -- opening checks ----------------------------------------------------------------------------
def test_opening_bad_files_names_the_problem(coco4_h5, tmp_path):
    good = coco4_h5[0]
    with pytest.raises(DataError, match="no such dataset file"):
        KeypointH5(tmp_path / "missing.h5").open()
    (tmp_path / "text.h5").write_text("hello")
    with pytest.raises(DataError, match="text.h5: not an HDF5 file"):
        KeypointH5(tmp_path / "text.h5").open()
    data = good.read_bytes()
    (tmp_path / "cut.h5").write_bytes(data[:len(data) // 2])
    with pytest.raises(DataError, match="cut.h5: truncated or damaged"):
        KeypointH5(tmp_path / "cut.h5").open()
    with h5py.File(tmp_path / "foreign.h5", "w") as f:
        f["x"] = np.zeros(3)
    with pytest.raises(DataError, match="foreign.h5: an HDF5 file but not a keypoint dataset"):
        KeypointH5(tmp_path / "foreign.h5").open()
    shutil.copy(good, tmp_path / "old.h5")
    with h5py.File(tmp_path / "old.h5", "a") as f:
        f.attrs["version"] = 0
    with pytest.raises(DataError, match="old.h5: written in an older format version"):
        KeypointH5(tmp_path / "old.h5").open()
