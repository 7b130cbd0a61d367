"""Keypoint files as their authors ship them: each test makes a small COCO-format file from the four
coco4 images with one quirk of a published dataset (no copy of any dataset) and checks that the
converter takes it, says in one line what it did, and that evaluation and training work on it."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

import demo
import evaluate
import train
from data.skeleton import Skeleton, builtin, mirror_names, name_flips, unpaired_sided
from data.h5format import KeypointH5
from data.make_hdf5 import main as make_hdf5
from inference.coco_eval import coco_keypoint_stats, keypoint_recall
from shipped_layouts import AS_SHIPPED, COCO_NAMES, as_shipped, points_of, shipped, wholebody

COCO = builtin("coco")
QUICK = ["--set", "data.workers=0", "--set", "train.tensorboard=false", "--epochs", "1",
         "--set", "train.max_steps_per_epoch=3", "--batch-size", "2"]


def glued(name: str) -> str:
    """COCO's `left_eye` in the `eyeL` style (zebra, locust and fly files)."""
    for side, mark in (("left_", "L"), ("right_", "R")):
        if name.startswith(side):
            return name[len(side):] + mark
    return name


def convert(ann: Path, images: Path, out: Path, capsys, *extra) -> tuple[int, str, str]:
    code = make_hdf5(["--ann", str(ann), "--images", str(images), "--out", str(out), "--split", "val",
                      "--quiet", *map(str, extra)])
    said = capsys.readouterr()
    return code, said.out, said.err


def oracle(h5: Path, tmp_path: Path, capsys) -> dict:
    assert evaluate.main(["--oracle", "--h5", str(h5), "--out", str(tmp_path / "oracle.json"),
                          "--overwrite", "--no-progress"]) == 0
    said = capsys.readouterr()
    return dict(json.loads(said.out.strip().splitlines()[-1]), err=said.err)


def renamed(names, links=None):
    """A change giving the category other keypoint names (and links, None: none)."""
    def change(data):
        data["categories"][0]["keypoints"] = list(names)
        data["categories"][0].pop("skeleton")
        if links is not None:
            data["categories"][0]["skeleton"] = links
    return change


# -- fields published files leave out or get wrong ------------------------------------------------
def test_num_keypoints_that_disagree_are_recounted(coco4_dir, tmp_path, capsys):
    def change(data):
        for ann in data["annotations"][:3]:
            ann["num_keypoints"] += 2
    code, out, _ = convert(shipped(coco4_dir, tmp_path, change), coco4_dir, tmp_path / "o.h5", capsys)
    assert code == 0
    assert "num_keypoints disagreed with the labelled keypoints: recounted (3 annotations)" in out
    stored = [a for i in range(4) for a in KeypointH5(tmp_path / "o.h5").annotations(i)]
    assert all(a["num_keypoints"] == sum(v > 0 for v in a["keypoints"][2::3]) for a in stored)


def test_a_file_without_iscrowd_and_area_converts_and_scores(coco4_dir, tmp_path, capsys):
    """AI Challenger's layout: no iscrowd, no area, no segmentation. pycocotools needs iscrowd."""
    def change(data):
        for ann in data["annotations"]:
            for key in ("iscrowd", "area", "segmentation"):
                ann.pop(key)
    code, out, _ = convert(shipped(coco4_dir, tmp_path, change), coco4_dir, tmp_path / "o.h5", capsys)
    assert code == 0
    for line in ("no iscrowd: 0 (not a crowd) (14 annotations)",
                 "no area: the segment's area (else the box's) (14 annotations)",
                 "no segmentation: the box is the person's region (14 annotations)"):
        assert line in out.splitlines()
    stats = oracle(tmp_path / "o.h5", tmp_path, capsys)
    assert stats["AP"] >= 0.85


def test_people_without_a_labelled_keypoint_are_counted_and_masked(coco4_dir, tmp_path, capsys):
    code, out, _ = convert(coco4_dir / "test_coco.json", coco4_dir, tmp_path / "o.h5", capsys)
    assert code == 0 and "2 people without a labelled keypoint: masked out of the loss like crowds" in out
    h5 = KeypointH5(tmp_path / "o.h5")
    ignore = sum(int(h5.masks(i)[0].sum()) for i in range(h5.num_images))
    assert ignore > 0


def test_several_categories_with_the_same_keypoints_are_merged_or_chosen(coco4_dir, tmp_path, capsys):
    """AP-10K's layout: one category per species, all with the same keypoints, no 'person'."""
    def change(data):
        first = dict(data["categories"][0], name="zebra", id=3)
        data["categories"] = [first, dict(first, name="horse", id=7)]
        for k, ann in enumerate(data["annotations"]):
            ann["category_id"] = 3 if k % 2 else 7
    ann = shipped(coco4_dir, tmp_path, change)
    code, out, _ = convert(ann, coco4_dir, tmp_path / "all.h5", capsys)
    assert code == 0
    assert "2 categories with the same 17 keypoints converted as one (zebra, horse), as category " \
           "'zebra'" in out
    everyone = [a for i in range(4) for a in KeypointH5(tmp_path / "all.h5").annotations(i)]
    assert len(everyone) == 14 and {a["category_id"] for a in everyone} == {3}
    assert oracle(tmp_path / "all.h5", tmp_path, capsys)["AP"] >= 0.85
    code, out, _ = convert(ann, coco4_dir, tmp_path / "horse.h5", capsys, "--categories", "horse")
    horses = [a for i in range(KeypointH5(tmp_path / "horse.h5").num_images)
              for a in KeypointH5(tmp_path / "horse.h5").annotations(i)]
    assert code == 0 and len(horses) == 7 and {a["category_id"] for a in horses} == {7}
    code, _, err = convert(ann, coco4_dir, tmp_path / "x.h5", capsys, "--categories", "cat")
    assert code == 2 and err.strip().splitlines() == [
        "error: --categories 'cat': no category of " + str(ann) + " has this name or id "
        "(categories: zebra (3), horse (7))"]


def test_a_category_without_keypoint_names_left_out_of_a_merge_is_a_line(coco4_dir, tmp_path, capsys):
    def change(data):
        first = dict(data["categories"][0], name="zebra", id=3)
        data["categories"] = [first, {"id": 9, "name": "background"}, dict(first, name="horse", id=7)]
        for k, ann in enumerate(data["annotations"]):
            ann["category_id"] = 3 if k % 2 else 7
    code, out, _ = convert(shipped(coco4_dir, tmp_path, change), coco4_dir, tmp_path / "o.h5", capsys)
    assert code == 0 and "left out 1 categories that name no keypoints: background (9) " \
        "(--categories NAME_OR_ID,... converts them)" in out.splitlines()


def test_keypoint_arrays_of_another_length_are_one_line_naming_both_counts(coco4_dir, tmp_path, capsys):
    """Human-Art's layout: 21 names in the category, 17 points in the annotations."""
    def change(data):
        data["categories"][0]["keypoints"] += [f"extra_{k}" for k in range(4)]
    code, _, err = convert(shipped(coco4_dir, tmp_path, change), coco4_dir, tmp_path / "o.h5", capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1
    assert "keypoints has 51 values (17 keypoints) but the category lists 21 keypoints (63 values)" \
        in lines[0] and "[" not in lines[0]


@pytest.mark.parametrize("skeleton, field", [("humanart21", "keypoints_21"),
                                             ("wholebody133", "foot_kpts")])
def test_a_short_field_of_another_layout_is_named_not_keypoints(skeleton, field, coco4_dir, tmp_path,
                                                                capsys):
    """A short keypoints_21 (Human-Art) or foot_kpts (COCO-WholeBody) was blamed on `keypoints`."""
    def change(data):
        (as_shipped("Human-Art") if field == "keypoints_21" else wholebody)(data)
        last = [a for a in data["annotations"] if isinstance(a.get(field), list)][-1]     # not the first,
        last[field] = last[field][:-3]                                          # which sets the layout
    code, _, err = convert(shipped(coco4_dir, tmp_path, change), coco4_dir, tmp_path / "o.h5", capsys,
                           "--skeleton", skeleton)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f": {field} has " in err and "as in the other annotations" in err, err


# -- skeletons the JSON does not fully give ------------------------------------------------------
def test_no_links_are_completed_dumped_and_given_back(coco4_dir, tmp_path, capsys):
    """Horse-10's layout: no skeleton links. The converter links every keypoint, says which links
    it added, writes the skeleton with --dump-skeleton, and takes the edited file back."""
    ann = shipped(coco4_dir, tmp_path, renamed([glued(n) for n in COCO_NAMES]))
    dumped = tmp_path / "mine.yaml"
    code, out, _ = convert(ann, coco4_dir, tmp_path / "o.h5", capsys, "--dump-skeleton", dumped)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("skeleton person: 17 keypoints, 16 main + ") and "no links in the JSON" in lines[0]
    assert any(line.startswith("links added to reach every keypoint (nearest in the data): ") for line in lines)
    assert "flip pairs: eyeL/eyeR, earL/earR, shoulderL/shoulderR, elbowL/elbowR, wristL/wristR, " \
           "hipL/hipR, kneeL/kneeR, ankleL/ankleR" in lines
    skeleton = KeypointH5(tmp_path / "o.h5").skeleton
    assert all(f != k for k, f in enumerate(skeleton.flip) if skeleton.keypoints[k] != "nose")
    assert oracle(tmp_path / "o.h5", tmp_path, capsys)["AP"] >= 0.6
    # the written file is the skeleton used; edited (a sigma), it is taken back as it is
    import yaml
    spec = yaml.safe_load(dumped.read_text())
    assert Skeleton.from_spec(spec, "dumped") == skeleton
    spec["sigmas"] = [0.05] * 17
    dumped.write_text(yaml.safe_dump(spec))
    code, out, _ = convert(ann, coco4_dir, tmp_path / "again.h5", capsys, "--skeleton", dumped)
    assert code == 0 and "(given by --skeleton)" in out
    assert KeypointH5(tmp_path / "again.h5").skeleton.sigmas == (0.05,) * 17


def test_dump_skeleton_alone_converts_nothing(coco4_dir, tmp_path, capsys):
    code = make_hdf5(["--ann", str(coco4_dir / "test_coco.json"), "--images", str(coco4_dir),
                      "--dump-skeleton", str(tmp_path / "coco.yaml")])
    out = capsys.readouterr().out
    assert code == 0 and "built-in skeleton coco" in out and "nothing converted" in out
    assert list(tmp_path.iterdir()) == [tmp_path / "coco.yaml"]
    assert Skeleton.from_spec(__import__("yaml").safe_load((tmp_path / "coco.yaml").read_text()), "x") == COCO


def test_links_that_leave_keypoints_unreachable_are_completed(coco4_dir, tmp_path, capsys):
    """Locust and fly files: links among the body, none to the antennae."""
    names = [glued(n) for n in COCO_NAMES]
    links = [[6, 7], [6, 8], [8, 10], [7, 9], [9, 11], [6, 12], [7, 13], [12, 13]]   # 1-based
    code, out, _ = convert(shipped(coco4_dir, tmp_path, renamed(names, links)), coco4_dir,
                           tmp_path / "o.h5", capsys)
    assert code == 0 and "8 links from the JSON" in out
    skeleton = KeypointH5(tmp_path / "o.h5").skeleton
    joined = {frozenset((skeleton.keypoints[a], skeleton.keypoints[b])) for a, b in skeleton.limbs}
    assert {frozenset(("elbowL", "wristL")), frozenset(("hipL", "hipR"))} <= joined      # the file's
    assert len(skeleton.limbs) >= 16                       # and enough to reach all 17 keypoints


def test_zero_based_links_are_recognised(coco4_dir, tmp_path, capsys):
    """ATRW's layout: links counted from 0."""
    names = [glued(n) for n in COCO_NAMES]
    links = [[a - 1, b - 1] for a, b in json.loads((coco4_dir / "test_coco.json").read_text())
             ["categories"][0]["skeleton"]]
    code, out, _ = convert(shipped(coco4_dir, tmp_path, renamed(names, links)), coco4_dir,
                           tmp_path / "o.h5", capsys)
    assert code == 0 and "skeleton links (categories[].skeleton) counted from 0 (a link uses keypoint 0); " \
        "--links-from 1 reads them the other way" in out
    skeleton = KeypointH5(tmp_path / "o.h5").skeleton
    index = skeleton.keypoints.index
    limbs = {frozenset(limb) for limb in skeleton.limbs}
    assert frozenset((index("ankleL"), index("kneeL"))) in limbs          # COCO's [16, 14], 1-based
    assert "links added to reach" not in out


def test_links_that_use_neither_keypoint_0_nor_the_last_say_how_they_were_counted(coco4_dir, tmp_path,
                                                                                  capsys):
    """Links counted from 0 that never use keypoint 0 (nor 17) are read by COCO's rule, from 1,
    with a line saying so; --links-from 0 reads them as meant."""
    names = [glued(n) for n in COCO_NAMES]
    links = [[a - 1, b - 1] for a, b in json.loads((coco4_dir / "test_coco.json").read_text())
             ["categories"][0]["skeleton"] if 1 not in (a, b) and 17 not in (a, b)]
    ann = shipped(coco4_dir, tmp_path, renamed(names, links))
    code, out, _ = convert(ann, coco4_dir, tmp_path / "o.h5", capsys)
    guess = "skeleton links (categories[].skeleton) counted from 1 (COCO's rule; no link uses keypoint " \
        "0 or 17, so either could be meant); "
    assert code == 0 and guess + "--links-from 0 reads them the other way" in out.splitlines()
    # evaluate.py --ann converts the JSON too: the guess used to go unsaid there (issue 47, point 7)
    assert evaluate.main(["--oracle", "--ann", str(ann), "--images", str(coco4_dir), "--max-images", "1",
                          "--out", str(tmp_path / "r.json"), "--no-progress"]) == 0
    assert f"--ann {ann}: {guess}python -m data.make_hdf5 --links-from 0 reads them the other way" \
        in capsys.readouterr().err.splitlines()
    code, out, _ = convert(ann, coco4_dir, tmp_path / "zero.h5", capsys, "--links-from", "0")
    assert code == 0 and "skeleton links (categories[].skeleton) counted from 0 (as --links-from says); " \
        "--links-from 1 reads them the other way" in out.splitlines()
    skeleton = KeypointH5(tmp_path / "zero.h5").skeleton
    limbs = {frozenset(skeleton.keypoints[k] for k in limb) for limb in skeleton.limbs}
    assert frozenset(("ankleL", "kneeL")) in limbs                  # [15, 13] counted from 0


def test_a_category_without_keypoint_names_is_numbered(coco4_dir, tmp_path, capsys):
    """Halpe's layout: the category has no keypoint names, only the annotations' arrays."""
    def change(data):
        data["categories"][0].pop("keypoints")
        data["categories"][0].pop("skeleton")
        for ann in data["annotations"]:             # 11 keypoints: no built-in has as many
            ann["keypoints"] = ann["keypoints"][:33]
    code, out, _ = convert(shipped(coco4_dir, tmp_path, change), coco4_dir, tmp_path / "o.h5", capsys)
    assert code == 0
    assert "the category names no keypoints; its annotations have 11: named keypoint_1 to keypoint_11" in out
    assert KeypointH5(tmp_path / "o.h5").skeleton.dataset_keypoints[10] == "keypoint_11"


@pytest.mark.parametrize("left, right", [
    ("left_eye", "right_eye"), ("l_eye", "r_eye"), ("L_eye", "R_eye"), ("eye_l", "eye_r"),
    ("eyeL", "eyeR"), ("forelegL1", "forelegR1"), ("LeftEye", "RightEye"), ("leftEye", "rightEye"),
    ("eye-left", "eye-right"), ("LEye", "REye"), ("eyeLeft", "eyeRight"), ("leftear", "rightear"),
    ("FL_paw", "FR_paw"), ("L_Shoulder", "R_Shoulder"), ("left-ear", "right-ear"), ("LeftEar", "RightEar"),
    ("l_ear", "r_ear"), ("ear_l", "ear_r"), ("ear.L", "ear.R"),
])
def test_sided_names_of_each_style_pair(left, right):
    assert right in mirror_names(left) and left in mirror_names(right)
    assert unpaired_sided([left, right, "nose"]) == []


def test_names_that_name_no_side_have_no_mirror():
    assert all(mirror_names(n) == [] for n in ("nose", "Lip", "tailbase", "Rump", "thorax", "neck"))


def test_a_capital_side_glued_to_a_word_pairs_only_with_its_partner():
    """`Lear`/`Rear` pair up; `Lip` and `Rump` alone name no side (no pair, no warning)."""
    names = ["Lear", "Rear", "Lip", "Rump", "nose"]
    assert [names[k] for k in name_flips(names)] == ["Rear", "Lear", "Lip", "Rump", "nose"]
    assert unpaired_sided(names) == []


def test_sided_names_left_unpaired_are_a_warning_line(coco4_dir, tmp_path, capsys):
    names = [glued(n) for n in COCO_NAMES]
    names[names.index("earR")] = "ear_right_tip"
    code, out, _ = convert(shipped(coco4_dir, tmp_path, renamed(names)), coco4_dir, tmp_path / "o.h5",
                           capsys)
    warning = [line for line in out.splitlines() if line.startswith("warning:")]
    assert code == 0 and len(warning) == 1 and "earL, ear_right_tip" in warning[0]


# -- --skip-bad lists what it skips ----------------------------------------------------------------
def test_skip_bad_lists_every_skipped_item_and_writes_them(coco4_dir, tmp_path, capsys):
    def change(data):
        data["annotations"][0]["bbox"] = [1, 1, 0, 5]
        data["annotations"].append(dict(data["annotations"][1], id=99, image_id=12345))
    ann = shipped(coco4_dir, tmp_path, change)
    listed = tmp_path / "skipped.json"
    code, out, err = convert(ann, coco4_dir, tmp_path / "o.h5", capsys, "--skip-bad", "--skipped", listed)
    assert code == 0 and "skipped 1 images: image with a bad annotation" in out
    lines = err.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("skipped: annotation ") for line in lines)
    assert "has no positive width and height; its image is skipped" in lines[0]
    assert "refers to unknown image 12345" in lines[1]
    items = json.loads(listed.read_text())
    assert [i["kind"] for i in items] == ["image with a bad annotation", "bad annotation"]
    assert items[0]["image_id"] == data_image(coco4_dir, 0)


def data_image(coco4_dir, k):
    return json.loads((coco4_dir / "test_coco.json").read_text())["annotations"][k]["image_id"]


def test_skip_bad_that_keeps_nothing_still_lists_why(coco4_dir, tmp_path, capsys):
    def change(data):
        for ann in data["annotations"]:
            ann["keypoints"] = ann["keypoints"][:-3]
    code, _, err = convert(shipped(coco4_dir, tmp_path, change), coco4_dir, tmp_path / "o.h5", capsys,
                           "--skip-bad")
    lines = err.strip().splitlines()
    assert code == 2 and lines[-1].startswith("error: ") and "no image was kept" in lines[-1]
    assert sum(line.startswith("skipped: annotation") for line in lines) == 4       # one per image
    assert not (tmp_path / "o.h5").exists()


# -- a self-made keypoint, links in a loop, a picture listed twice -------------------------------
def test_a_derived_keypoint_made_from_itself_is_refused(coco4_dir, tmp_path, capsys):
    spec = COCO.to_spec()
    spec["derived"] = {"neck": ["neck", "left_shoulder"]}
    path = tmp_path / "self.yaml"
    path.write_text(json.dumps(spec))
    code, _, err = convert(coco4_dir / "test_coco.json", coco4_dir, tmp_path / "o.h5", capsys,
                           "--skeleton", path)
    assert code == 2 and err.strip().splitlines() == [
        f"error: --skeleton {path}: derived neck: ['neck', 'left_shoulder'] uses 'neck', which is not "
        "a keypoint of the annotations (a derived keypoint is the middle of two annotated ones)"]
    assert not (tmp_path / "o.h5").exists()


def test_a_loop_of_links_among_the_images_is_one_line_or_skipped(coco4_dir, tmp_path, capsys):
    images = tmp_path / "images"
    images.mkdir()
    for p in coco4_dir.glob("*.jpg"):
        os.symlink(p, images / p.name)                 # linked images are read where they lead
    loop = images / "000000000785.jpg"
    loop.unlink()
    os.symlink(images / "other.jpg", loop)
    os.symlink(loop, images / "other.jpg")
    ann = coco4_dir / "test_coco.json"
    code, _, err = convert(ann, images, tmp_path / "o.h5", capsys)
    assert code == 2 and err.strip().splitlines() == [
        f"error: {ann}: image 785: file_name '000000000785.jpg' is a loop of symbolic links under "
        f"--images {images}"]
    code, out, err = convert(ann, images, tmp_path / "o.h5", capsys, "--skip-bad")
    assert code == 0 and "3 images" in out and "is a loop of symbolic links" in err
    assert KeypointH5(tmp_path / "o.h5").num_images == 3


def test_a_picture_listed_twice_is_refused(coco4_dir, tmp_path, capsys):
    def change(data):
        twin = dict(data["images"][1], id=777)
        twin["file_name"] = "./" + twin["file_name"]
        data["images"].append(twin)
        data["annotations"][-1]["image_id"] = 777
    ann = shipped(coco4_dir, tmp_path, change)
    code, _, err = convert(ann, coco4_dir, tmp_path / "o.h5", capsys)
    first = json.loads((coco4_dir / "test_coco.json").read_text())["images"][1]
    assert code == 2 and err.strip().splitlines() == [
        f"error: {ann}: image 777: file_name './{first['file_name']}' is also image {first['id']} "
        "(one picture listed twice: its people would be split between them)"]


# -- evaluation: each keypoint's recall ------------------------------------------------------------
def test_keypoint_recall_counts_keypoints_found_at_the_right_place():
    person = [10, 10, 2, 50, 10, 2, 90, 90, 0]
    gt = {"images": [{"id": 1}], "annotations": [
        {"image_id": 1, "iscrowd": 0, "area": 1000.0, "keypoints": person}]}
    right = {"image_id": 1, "keypoints": [10, 10, 1, 50, 11, 1, 0, 0, 1], "score": 1}
    far = {"image_id": 1, "keypoints": [10, 10, 1, 80, 40, 1, 0, 0, 1], "score": 1}
    assert keypoint_recall(gt, [right], [0.05] * 3) == [(1, 1), (1, 1), (0, 0)]
    assert keypoint_recall(gt, [far], [0.05] * 3) == [(1, 1), (1, 0), (0, 0)]
    assert keypoint_recall(gt, [], [0.05] * 3) == [(1, 0), (1, 0), (0, 0)]


def test_ground_truth_without_iscrowd_or_area_scores_instead_of_a_keyerror():
    """A file converted before these fields were completed holds annotations without them."""
    person = [10.0, 10.0, 2, 50.0, 10.0, 2, 90.0, 90.0, 2]
    gt = {"images": [{"id": 1, "width": 100, "height": 100}], "categories": [{"id": 1}],
          "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [5, 5, 90, 90],
                           "keypoints": person}]}
    found = [{"image_id": 1, "category_id": 1, "keypoints": person, "score": 1.0}]
    assert coco_keypoint_stats(gt, found, sigmas=[0.05] * 3)["AP"] == pytest.approx(1.0)


def test_the_oracle_prints_each_keypoints_recall(coco4_dir, tmp_path, capsys):
    convert(coco4_dir / "test_coco.json", coco4_dir, tmp_path / "o.h5", capsys)
    stats = oracle(tmp_path / "o.h5", tmp_path, capsys)
    recall = stats["keypoint_recall"]
    assert list(recall) == COCO_NAMES and all(0.8 <= v <= 1.0 for v in recall.values())
    assert "recall per keypoint" in stats["err"]
    lines = stats["err"].split("lowest first:\n")[1].splitlines()[:17]
    shares = [float(line.split()[-1].rstrip("%")) for line in lines]
    assert shares == sorted(shares) and {line.split()[0] for line in lines} == set(COCO_NAMES)


# -- end to end: an inferred skeleton through training, curves.png and demo.py --------------------
@pytest.mark.slow
def test_an_inferred_skeleton_trains_and_the_demo_draws_it(coco4_dir, tmp_path, capsys):
    def change(data):
        renamed([glued(n) for n in COCO_NAMES])(data)
        for ann in data["annotations"]:
            for key in ("iscrowd", "area"):
                ann.pop(key)
            ann["num_keypoints"] = 1
    ann = shipped(coco4_dir, tmp_path, change)
    for split in ("train", "val"):
        assert make_hdf5(["--ann", str(ann), "--images", str(coco4_dir), "--out", str(tmp_path / f"{split}.h5"),
                          "--split", split, "--quiet"]) == 0
    done = train.main(["--train-h5", str(tmp_path / "train.h5"), "--val-h5", str(tmp_path / "val.h5"),
                       "--out-dir", str(tmp_path), "--run-name", "mine", "--ap-every", "1",
                       "--set", "train.ap_max_images=2", "--set", "train.log_every=100",
                       "--set", "train.val_pictures=1", *QUICK])
    run = tmp_path / "mine"
    out = capsys.readouterr().out
    assert done["step"] == 3 and 0.0 <= done["AP"] <= 1.0
    assert f"; pictures: {run / 'val_pictures'}/" in out
    steps = [json.loads(line) for line in (run / "train_steps.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps] == [1, 2, 3] and all(np.isfinite(r["loss"]) for r in steps)
    assert (run / "curves.png").stat().st_size > 0
    picture = tmp_path / "drawn.png"
    assert demo.main(["--weights", str(run / "last.pth"), "--image", str(coco4_dir / "000000000785.jpg"),
                      "--out", str(picture), "--device", "cpu"]) == 0
    assert picture.stat().st_size > 0


# -- built-in skeletons of published datasets ------------------------------------------------------
PUBLISHED = {"aic": 14, "ap10k": 17, "animalpose": 20, "horse10": 22, "zebra": 9, "locust": 35,
             "fly": 32, "atrw": 15, "halpe26": 26, "halpe136": 136, "humanart21": 21, "mhp": 16,
             "wholebody133": 133}


def test_list_skeletons_prints_the_built_ins(capsys):
    assert make_hdf5(["--list-skeletons"]) == 0
    listed = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    for name, count in PUBLISHED.items():
        assert name in listed and f"skeleton {name}: " in listed[name]
        assert len(builtin(name).dataset_keypoints) == count
    assert {"coco", "crowdpose", "quadruped"} <= set(listed)


def test_published_sigmas_and_flips_are_the_datasets():
    aic = builtin("aic")
    assert aic.sigmas[0] == pytest.approx(0.01388152) and aic.sigmas[13] == pytest.approx(0.01236173)
    assert builtin("halpe136").sigmas[26:] == (0.015,) * 110                # face and hands
    # Halpe's 26 body and foot points score as the authors' 26-point OKS does: the first 26 of 136
    # (COCO's 17, then 0.08 for head, neck and hip and 0.089 for the feet)
    halpe26, halpe136 = builtin("halpe26"), builtin("halpe136")
    assert halpe26.dataset_keypoints == halpe136.dataset_keypoints[:26]
    assert halpe26.sigmas == halpe136.sigmas[:26] and halpe26.sigmas[:17] == COCO.sigmas[:17]
    assert halpe26.sigmas[17:] == (0.08,) * 3 + (0.089,) * 6
    index = builtin("halpe136").keypoints.index
    assert builtin("halpe136").flip[index("face-0")] == index("face-16")
    assert builtin("zebra").sigmas == (0.067,) * 9                      # none published: the default
    locust = builtin("locust")
    assert locust.flip[locust.keypoints.index("forelegL1")] == locust.keypoints.index("forelegR1")
    assert builtin("horse10").flip == tuple(range(22))                  # near/off: not mirrored


def test_a_nameless_halpe_file_is_recognised_by_its_136_keypoints(coco4_dir, tmp_path, capsys):
    def change(data):
        points_of(data, 136)
        data["categories"][0].pop("keypoints")
        data["categories"][0].pop("skeleton")
    code, out, _ = convert(shipped(coco4_dir, tmp_path, change), coco4_dir, tmp_path / "o.h5", capsys)
    assert code == 0 and "its annotations have 136: those of built-in skeleton halpe136" in out
    assert KeypointH5(tmp_path / "o.h5").skeleton.keypoints == builtin("halpe136").keypoints


def test_links_through_keypoints_the_file_never_labels_are_replaced(coco4_dir, tmp_path, capsys):
    """Halpe's test file labels head and hip but never neck, through which alone halpe136 links
    head (and the shoulders to the hips): links the data can use are added, and say so, and the
    ground truth's heads are found (none were)."""
    names = builtin("halpe136").dataset_keypoints

    def change(data):
        data["categories"][0].update(keypoints=list(names), skeleton=[])
        for ann in data["annotations"]:
            coco = np.array(ann["keypoints"], float).reshape(17, 3)
            halpe = np.zeros((136, 3))
            halpe[:17] = coco
            if coco[0, 2] > 0:
                halpe[names.index("head")] = coco[0] - [0, 25, 0]
            if coco[11, 2] > 0 and coco[12, 2] > 0:
                halpe[names.index("hip")] = (coco[11] + coco[12]) / 2
            ann["keypoints"] = halpe.reshape(-1).tolist()
    code, out, _ = convert(shipped(coco4_dir, tmp_path, change), coco4_dir, tmp_path / "o.h5", capsys)
    line = next(line for line in out.splitlines() if line.startswith("halpe136's links"))
    assert code == 0 and "only through keypoints it never labels (neck, " in line
    assert "head" in line.split("added ")[1] and "--skeleton halpe136 keeps the built-in as it is" in line
    skeleton = KeypointH5(tmp_path / "o.h5").skeleton
    index = skeleton.keypoints.index
    assert builtin("halpe136").limbs == skeleton.limbs[:len(builtin("halpe136").limbs)]
    assert any(index("head") in limb and index("neck") not in limb for limb in skeleton.limbs)
    recall = oracle(tmp_path / "o.h5", tmp_path, capsys)["keypoint_recall"]
    assert recall["head"] > 0.5 and recall["left_hip"] > 0.5


@pytest.mark.parametrize("spelling", [
    ["L_Eye", "R_Eye", "Nose", "Neck", "Root of tail", "L_Shoulder", "L_Elbow", "L_F_Paw", "R_Shoulder",
     "R_Elbow", "R_F_Paw", "L_Hip", "L_Knee", "L_B_Paw", "R_Hip", "R_Knee", "R_B_Paw"],
    list(builtin("ap10k").dataset_keypoints)])
def test_a_published_layout_is_recognised_by_its_names(spelling, coco4_dir, tmp_path, capsys):
    code, out, _ = convert(shipped(coco4_dir, tmp_path, renamed(spelling)), coco4_dir, tmp_path / "o.h5", capsys)
    assert code == 0 and out.splitlines()[0] == "the keypoints are ap10k's 17: built-in skeleton ap10k"


def test_an_output_that_is_a_loop_of_links_is_one_line(coco4_dir, tmp_path, capsys):
    os.symlink(tmp_path / "b.h5", tmp_path / "a.h5")
    os.symlink(tmp_path / "a.h5", tmp_path / "b.h5")
    code, _, err = convert(coco4_dir / "test_coco.json", coco4_dir, tmp_path / "a.h5", capsys)
    assert code == 2 and err.strip().splitlines() == [
        f"error: --out {tmp_path / 'a.h5'}: a loop of symbolic links; give another path"]


# -- the 16 datasets as shipped: their skeletons dumped and given back ------------------------------
@pytest.mark.parametrize("dataset", list(AS_SHIPPED))
def test_the_dumped_skeleton_converts_both_splits_back_unchanged(dataset, coco4_dir, tmp_path, capsys):
    train = shipped(coco4_dir, tmp_path, as_shipped(dataset, slice(0, 3)), "train.json")
    val = shipped(coco4_dir, tmp_path, as_shipped(dataset, slice(3, 4)), "val.json")
    dumped = tmp_path / "mine.yaml"
    assert make_hdf5(["--ann", str(train), "--images", str(coco4_dir), "--dump-skeleton", str(dumped)]) == 0
    capsys.readouterr()
    skeleton = Skeleton.from_spec(__import__("yaml").safe_load(dumped.read_text()), "dumped")
    # the built-in's keypoints; its links too, but where the data never labels a keypoint that
    # joins others (Halpe's neck) the converter adds links the data can use
    assert skeleton.dataset_keypoints == builtin(AS_SHIPPED[dataset][0]).dataset_keypoints
    for split, ann in (("train", train), ("val", val)):
        code, out, err = convert(ann, coco4_dir, tmp_path / f"{split}.h5", capsys, "--skeleton", dumped)
        assert code == 0, err
        assert KeypointH5(tmp_path / f"{split}.h5").skeleton == skeleton


def test_a_builtin_by_name_takes_the_jsons_spelling_with_a_line(coco4_dir, tmp_path, capsys):
    code, out, _ = convert(shipped(coco4_dir, tmp_path, as_shipped("MHP")), coco4_dir, tmp_path / "o.h5",
                           capsys, "--skeleton", "mhp")
    assert code == 0 and KeypointH5(tmp_path / "o.h5").skeleton == builtin("mhp")
    assert "16 keypoint names spelled otherwise in the JSON, matched: 'Right-ankle' is 'right_ankle', " \
           "'Right-knee' is 'right_knee', 'Right-hip' is 'right_hip', ... (16 in all)" in out.splitlines()


def test_an_edited_name_or_a_dropped_link_converts_with_a_line(coco4_dir, tmp_path, capsys):
    ann = shipped(coco4_dir, tmp_path, as_shipped("MHP"))
    dumped = tmp_path / "mine.yaml"
    assert make_hdf5(["--ann", str(ann), "--images", str(coco4_dir), "--dump-skeleton", str(dumped)]) == 0
    dumped.write_text(dumped.read_text().replace("head_top", "crown"))
    code, out, _ = convert(ann, coco4_dir, tmp_path / "o.h5", capsys, "--skeleton", dumped)
    assert code == 0 and "keypoints renamed by --skeleton, taken by position: 'Head-top' is 'crown'" \
        in out.splitlines()
    assert KeypointH5(tmp_path / "o.h5").skeleton.dataset_keypoints[9] == "crown"
    spec = COCO.to_spec()
    spec["redundant"].remove(["right_hip", "left_hip"])
    fewer = tmp_path / "fewer.yaml"
    fewer.write_text(json.dumps(spec))
    code, out, _ = convert(coco4_dir / "test_coco.json", coco4_dir, tmp_path / "f.h5", capsys,
                           "--skeleton", fewer)
    assert code == 0 and "--skeleton differs from built-in coco: without limb left_hip-right_hip" \
        in out.splitlines()


def test_names_in_a_skeleton_error_are_shown_as_written(coco4_dir, tmp_path, capsys):
    ann = shipped(coco4_dir, tmp_path, as_shipped("AP-10K"))
    code, _, err = convert(ann, coco4_dir, tmp_path / "o.h5", capsys, "--skeleton", "coco")
    assert code == 2 and err.strip().splitlines() == [
        f"error: {ann}: the 'person' category's keypoints are not those of skeleton coco in the same "
        "order (15 of 17 differ: keypoint 0 is 'left_eye' there, 'nose' in the skeleton; keypoint 1 is "
        "'right_eye' there, 'left_eye' in the skeleton; keypoint 2 is 'nose' there, 'right_eye' in the "
        "skeleton)"]


# -- fields other than keypoints: Human-Art's keypoints_21, COCO-WholeBody's parts ------------------
def test_human_art_converts_as_shipped_in_both_versions(coco4_dir, tmp_path, capsys):
    """Human-Art: 17 points in `keypoints`, 21 in `keypoints_21`, 21 names; its file_names start
    with `HumanArt/images/`, which the folder it ships lacks."""
    images = tmp_path / "images" / "real_human"
    images.mkdir(parents=True)
    for p in coco4_dir.glob("*.jpg"):
        os.symlink(p, images / p.name)

    def change(data):
        as_shipped("Human-Art")(data)
        for info in data["images"]:
            info["file_name"] = "HumanArt/images/real_human/" + info["file_name"]
    ann = shipped(coco4_dir, tmp_path, change)
    code, out, _ = convert(ann, tmp_path / "images", tmp_path / "21.h5", capsys)
    lines = out.splitlines()
    assert code == 0 and KeypointH5(tmp_path / "21.h5").skeleton == builtin("humanart21")
    assert "keypoints read from keypoints_21: 21 per person; not read: keypoints (17: --skeleton coco " \
           "reads them)" in lines
    assert f"file names start with 'HumanArt/images/', which --images {tmp_path / 'images'} lacks: read " \
           "without it" in lines
    assert len(KeypointH5(tmp_path / "21.h5").annotations(0)[0]["keypoints"]) == 63
    assert oracle(tmp_path / "21.h5", tmp_path, capsys)["AP"] >= 0.85
    code, out, _ = convert(ann, tmp_path / "images", tmp_path / "17.h5", capsys, "--skeleton", "coco")
    assert code == 0 and KeypointH5(tmp_path / "17.h5").skeleton == COCO
    assert "keypoints read from keypoints: 17 per person; not read: keypoints_21 (21: --skeleton " \
           "humanart21 reads them)" in out.splitlines()


@pytest.mark.slow
def test_coco_wholebody_converts_whole_or_the_body_alone_and_says_which(coco4_dir, tmp_path, capsys):
    ann = shipped(coco4_dir, tmp_path, wholebody)
    code, out, _ = convert(ann, coco4_dir, tmp_path / "all.h5", capsys)
    lines = out.splitlines()
    assert code == 0 and lines[0] == "the keypoints are wholebody133's 133: built-in skeleton wholebody133"
    faces = sum(sum(v > 0 for v in a["face_kpts"][2:15:3])
                for a in json.loads(ann.read_text())["annotations"] if not a["iscrowd"])
    assert "keypoints read from keypoints + foot_kpts + face_kpts + lefthand_kpts + righthand_kpts: " \
           f"133 per person; {faces} fractional visibilities (labelled, in COCO-WholeBody) read as 1; " \
           "keypoints alone (17: --skeleton coco reads them)" in lines       # it said "not read: keypoints"
    assert not any("not read" in line for line in lines)
    h5 = KeypointH5(tmp_path / "all.h5")
    assert h5.skeleton == builtin("wholebody133") and len(h5.annotations(0)[0]["keypoints"]) == 399
    assert h5.people(0).shape[1:] == (134, 3)
    assert oracle(tmp_path / "all.h5", tmp_path, capsys)["AP"] >= 0.85          # scored with 133 sigmas
    code, out, _ = convert(ann, coco4_dir, tmp_path / "body.h5", capsys, "--skeleton", "coco")
    assert code == 0 and KeypointH5(tmp_path / "body.h5").skeleton == COCO
    assert "keypoints read from keypoints: 17 per person; not read: keypoints+foot_kpts+face_kpts+" \
           "lefthand_kpts+righthand_kpts (133: --skeleton wholebody133 reads them)" in out.splitlines()
    code, _, err = convert(ann, coco4_dir, tmp_path / "x.h5", capsys, "--skeleton", "halpe136")
    assert code == 2 and err.strip().splitlines() == [
        f"error: {ann}: skeleton halpe136 has 136 keypoints, but no field of the annotations holds as many "
        "(keypoints 17, keypoints+foot_kpts+face_kpts+lefthand_kpts+righthand_kpts 133)"]


def test_wholebody133_has_the_published_sigmas():
    sigmas = builtin("wholebody133").sigmas
    assert sigmas[:17] == COCO.sigmas and sigmas[17:23] == (0.068, 0.066, 0.066, 0.092, 0.094, 0.094)
    assert sigmas[23] == 0.042 and sigmas[91:112] == sigmas[112:] and sigmas[91] == 0.029


# -- where missing pictures come from ----------------------------------------------------------------
def test_a_missing_pictures_error_says_where_the_json_says_it_comes_from(coco4_dir, tmp_path, capsys):
    """Halpe's validation pictures are COCO val2017's; its JSON's coco_url says so."""
    empty = tmp_path / "images"
    empty.mkdir()
    ann = coco4_dir / "test_coco.json"
    code, _, err = convert(ann, empty, tmp_path / "o.h5", capsys)
    assert code == 2 and err.strip().splitlines() == [
        f"error: {empty / '000000000785.jpg'}: image 785 listed in {ann} is missing; the JSON's coco_url "
        "is http://images.cocodataset.org/val2017/000000000785.jpg: --images the folder of COCO's val2017 "
        "pictures"]

    def change(data):
        for info in data["images"]:
            info["file_name"] = "HumanArt/images/" + info.pop("file_name")
            info.pop("coco_url")
    ann = shipped(coco4_dir, tmp_path, change)
    code, _, err = convert(ann, empty, tmp_path / "o.h5", capsys)
    assert code == 2 and err.strip().splitlines() == [
        f"error: {empty / 'HumanArt/images/000000000785.jpg'}: image 785 listed in {ann} is missing; its "
        f"file_name starts with 'HumanArt/', which --images {empty} lacks: give the folder that holds "
        "HumanArt/; the JSON's flickr_url is http://farm8.staticflickr.com/7015/6795644157_f019453ae7_z.jpg"]


# -- which pictures the training split keeps -----------------------------------------------------------
def test_the_train_split_says_what_it_keeps_and_keep_all_keeps_every_labelled_picture(coco4_dir, tmp_path,
                                                                                      capsys):
    def change(data):                       # one picture's people get 4 labelled keypoints each
        first = data["images"][0]["id"]
        for ann in data["annotations"]:
            if ann["image_id"] == first:
                ann["keypoints"] = ann["keypoints"][:12] + [0] * 39
    ann = shipped(coco4_dir, tmp_path, change)
    code = make_hdf5(["--ann", str(ann), "--images", str(coco4_dir), "--out", str(tmp_path / "t.h5"),
                      "--quiet"])
    out = capsys.readouterr().out.splitlines()
    assert code == 0 and KeypointH5(tmp_path / "t.h5").num_images == 3
    assert "train split: 3 of 4 pictures kept, those with a main person (SPEC's rule: 5+ labelled " \
           "keypoints, an area of 32x32 px or more, its centre not within 0.3 box sides of an earlier " \
           "one's); " \
           "--keep-all keeps every picture with a labelled person" in out
    code = make_hdf5(["--ann", str(ann), "--images", str(coco4_dir), "--out", str(tmp_path / "all.h5"),
                      "--quiet", "--keep-all"])
    out = capsys.readouterr().out.splitlines()
    assert code == 0 and KeypointH5(tmp_path / "all.h5").num_images == 4
    assert "train split: 4 of 4 pictures kept, every picture with a labelled person (--keep-all: any " \
           "person with a labelled keypoint may be a main person)" in out
