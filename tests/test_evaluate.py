"""evaluate.py and `evaluate_h5`: the oracle ceiling on real COCO images, checkpoints, user errors,
and exact distributed evaluation over two real gloo processes."""
from __future__ import annotations

import json
import os
import re
import threading

import numpy as np
import pytest
import torch

import evaluate
from common.errors import DataError
from data.skeleton import builtin
from config.loader import build_config, to_dict
from config.views import EvalOptions, PredictSettings
from runtime.checkpoint import save_checkpoint
from child_env import find_free_port
from inference.coco_eval import STAT_NAMES, coco_keypoint_stats
from inference.evaluation import evaluate_h5
from models import build_model
from gloo_ranks import start_forked

COCO = builtin("coco")

COCO4_IDS = [785, 40083, 196141, 197388]   # in file order


@pytest.fixture(scope="module")
def coco4_h5(coco4_dir, tmp_path_factory):
    from data.make_hdf5 import ConvertSettings, convert

    out = tmp_path_factory.mktemp("coco4") / "coco4_val.h5"
    convert(coco4_dir / "test_coco.json", coco4_dir, out, ConvertSettings(split="val", progress=False))
    return out


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, tiny_cfg, tiny_model):
    path = tmp_path_factory.mktemp("weights") / "best.pth"
    save_checkpoint(path, {"model": tiny_model.state_dict(), "config": to_dict(tiny_cfg)})
    return path


def run_cli(argv, capsys):
    """(exit code, the stats of the last stdout line or None, stderr)."""
    code = evaluate.main([str(a) for a in argv])
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    return code, (json.loads(lines[-1]) if lines else None), captured.err


def test_oracle_on_coco4_reaches_the_ceiling(coco4_h5, tmp_path, capsys):
    out = tmp_path / "oracle.json"
    code, stats, err = run_cli(["--oracle", "--h5", coco4_h5, "--out", out, "--no-progress"], capsys)
    assert code == 0
    assert stats["AP"] >= 0.85 and stats["num_images"] == 4
    assert all(0.0 <= stats[name] <= 1.0 for name in STAT_NAMES)
    for name in STAT_NAMES:                      # the readable table on stderr
        assert f"  {name} " in err
    assert "ground-truth maps at each image's size (oracle)" in err and "scales" not in err
    results = json.loads(out.read_text())
    assert {r["image_id"] for r in results} == set(COCO4_IDS)
    assert all(len(r["keypoints"]) == 51 for r in results)


def test_oracle_from_coco_json_and_image_folder(coco4_dir, tmp_path, capsys):
    code, stats, _ = run_cli(["--oracle", "--ann", coco4_dir / "test_coco.json", "--images", coco4_dir,
                              "--max-images", 2, "--out", tmp_path / "r.json", "--no-progress"], capsys)
    assert code == 0 and stats["num_images"] == 2 and stats["AP"] >= 0.85


def test_the_oracle_draws_a_huge_picture_shrunk_and_scores_its_people_in_its_own_pixels(coco4_h5,
                                                                                         monkeypatch):
    """A picture over the largest side the network path runs at gets maps of that side, not of
    its own size (a panorama's maps would not fit in memory), and its people come back in its
    pixels: the same people as at full size, within the shrinking's precision."""
    from data.h5format import KeypointH5
    from inference import evaluation

    h5, settings = KeypointH5(coco4_h5), PredictSettings.of(build_config("tiny"))
    at_full_size = evaluation.decode_images(None, h5, range(4), settings, "cpu", oracle=True, progress=False)
    monkeypatch.setattr(evaluation, "MAX_SIDE", 320)
    maps, factor = evaluation.oracle_maps(h5, 0, settings.targets)
    height, width = h5.image_size(0)
    assert max(maps.shape[1:]) == 320 and factor == pytest.approx(max(height, width) / 320, rel=0.01)
    shrunk = evaluation.decode_images(None, h5, range(4), settings, "cpu", oracle=True, progress=False)
    assert list(shrunk) == list(at_full_size) == COCO4_IDS
    for image_id in COCO4_IDS:
        assert len(shrunk[image_id]) == len(at_full_size[image_id]) > 0
        for small, full in zip(shrunk[image_id], at_full_size[image_id]):
            small_xyv, full_xyv = np.reshape(small["keypoints"], (-1, 3)), np.reshape(full["keypoints"], (-1, 3))
            found = (small_xyv[:, 2] > 0) & (full_xyv[:, 2] > 0)
            assert found.sum() >= 0.8 * (full_xyv[:, 2] > 0).sum()
            assert np.abs(small_xyv[found, :2] - full_xyv[found, :2]).max() <= 3.0 * factor


def test_checkpoint_weights_with_flip_and_scales(coco4_h5, tiny_checkpoint, capsys):
    code, stats, err = run_cli(["--weights", tiny_checkpoint, "--h5", coco4_h5, "--max-images", 1,
                                "--flip", "--scales", 0.5, 1, "--no-progress"], capsys)
    assert code == 0 and stats["num_images"] == 1 and set(STAT_NAMES) <= set(stats)
    assert "scales [0.5, 1.0], flip True" in err
    default_out = tiny_checkpoint.with_name("best_coco4_val_keypoints.json")
    assert stats["results"] == str(default_out) and isinstance(json.loads(default_out.read_text()), list)


def test_grouping_in_threads_gives_the_results_of_grouping_in_line(coco4_h5):
    """Images grouped in a pool while the next is predicted: the same results, in image order."""
    from data.h5format import KeypointH5
    from inference.evaluation import decode_images

    h5 = KeypointH5(coco4_h5)
    found = {}
    for threads in (1, 3):
        cfg = build_config("tiny", sets=[f"inference.decode_threads={threads}"])
        found[threads] = decode_images(None, h5, range(4), PredictSettings.of(cfg), "cpu", oracle=True,
                                        progress=False)
    assert list(found[3]) == list(found[1]) == COCO4_IDS
    assert found[3] == found[1] and sum(len(people) for people in found[1].values()) >= 10


def test_evaluate_h5_restores_the_model_mode(coco4_h5):
    cfg = build_config("tiny")
    model = build_model(cfg.model, COCO).train()
    stats = evaluate_h5(model, coco4_h5, PredictSettings.of(cfg), torch.device("cpu"),
                        EvalOptions(max_images=1, progress=False))
    assert model.training and stats["num_images"] == 1 and set(STAT_NAMES) <= set(stats)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("argv, message", [
    (["--h5", "{h5}"], "option --weights is required"),
    (["--oracle"], "give the data as --h5 FILE"),
    (["--oracle", "--h5", "{missing}"], "{missing}"),
    (["--weights", "{missing}", "--h5", "{h5}"], "{missing}"),
    (["--oracle", "--h5", "{h5}", "--set", "inference.nonsense=1"], "inference.nonsense"),
    (["--oracle", "--h5", "{h5}", "--scales", "0.5", "1", "--no-flip"],
     "options --scales and --flip do not apply to --oracle"),
    (["--oracle", "--h5", "{h5}", "--flip"], "option --flip does not apply to --oracle"),
    (["--oracle", "--weights", "{h5}", "--h5", "{h5}"], "options --oracle and --weights: give one"),
    (["--oracle", "--results", "{h5}", "--h5", "{h5}"], "options --oracle and --results: give one"),
    (["--results", "{h5}", "--h5", "{h5}", "--out", "x.json"],
     "option --out does not apply to --results: the file's results are scored as they are"),
    (["--results", "{missing}", "--h5", "{h5}"], "--results {missing}: cannot read it"),
    (["--weights", "{h5}", "--h5", "{h5}", "--device", "tpu"],
     "--device: 'tpu' is not auto, cpu, cuda, cuda:N or a list of GPU numbers"),
    (["--oracle", "--h5", "{h5}", "--pck-threshold", "0"],
     "option --pck-threshold: 0.0 must be > 0 and <= 1"),
    # issue 47: sense, not only type; the option at fault named; options that do not apply refused
    (["--oracle", "--h5", "{h5}", "--pck-threshold", "inf"],
     "option --pck-threshold: inf is not a finite number"),
    (["--oracle", "--h5", "{h5}", "--pck-threshold", "5"],
     "option --pck-threshold: 5.0 must be > 0 and <= 1"),
    (["--oracle", "--h5", "{h5}", "--metric", "pck", "pck"],
     "option --metric: metric ['pck', 'pck']: give one"),
    (["--oracle", "--h5", "{h5}", "--pck-threshold", "0.3"],
     "option --pck-threshold does not apply here: no PCK is scored (metrics: oks); add --metric pck"),
    (["--oracle", "--h5", "{h5}", "--metric", "oks", "--pck-threshold", "0.3", "--pck-normalize", "bbox"],
     "options --pck-threshold and --pck-normalize do not apply here: no PCK is scored (metrics: oks)"),
    (["--oracle", "--h5", "{h5}", "--pck-normalize", "nose,tail"],
     "option --pck-normalize: pck_normalize ['nose', 'tail']: give bbox, or two of the annotated keypoints"),
])
def test_user_errors_are_one_line_with_exit_code(argv, message, coco4_h5, tmp_path, capsys):
    names = {"h5": coco4_h5, "missing": tmp_path / "missing.file"}
    code, stats, err = run_cli([a.format(**names) for a in argv], capsys)
    assert code == 2 and stats is None
    assert err.startswith("error: ") and err.count("\n") == 1 and message.format(**names) in err
    assert "--preset" not in err       # a missing or unreadable file is not a question of preset


@pytest.mark.parametrize("out, message", [
    ("{tmp}", "--out {tmp}: a folder; give the path of the results JSON"),
    ("{h5}/r.json", "--out {h5}/r.json: cannot write the results there"),
])
def test_unwritable_results_path_fails_before_evaluating(out, message, coco4_h5, tmp_path, capsys,
                                                          monkeypatch):
    import inference.evaluation

    def never(*args, **kwargs):
        raise AssertionError("evaluated although the results cannot be written")

    monkeypatch.setattr(inference.evaluation, "evaluate_h5", never)
    names = {"tmp": tmp_path, "h5": coco4_h5}
    code, stats, err = run_cli(["--oracle", "--h5", coco4_h5, "--out", out.format(**names),
                                "--no-progress"], capsys)
    assert code == 2 and stats is None and err.count("\n") == 1
    assert err.startswith("error: " + message.format(**names)), err


def test_each_metric_as_the_skeleton_says_or_as_asked_and_keypoints_per_picture(coco4_dir, tmp_path,
                                                                                 capsys):
    """A skeleton naming PCK and EPE is scored with them by default; --metric adds OKS, which with
    the stand-in sigma says so; --out NAME.jsonl holds each picture's people and keypoints."""
    from data.make_hdf5 import ConvertSettings, convert
    from data.skeleton import Skeleton

    spec = dict(COCO.to_spec(), name="stand_in", sigmas=0.067, metric=["pck", "epe"])
    h5 = tmp_path / "stand_in.h5"
    convert(coco4_dir / "test_coco.json", coco4_dir, h5,
            ConvertSettings(split="val", progress=False, skeleton=Skeleton.from_spec(spec, "test")))
    code, stats, err = run_cli(["--oracle", "--h5", h5, "--out", tmp_path / "r.json", "--no-progress"], capsys)
    assert code == 0 and "AP" not in stats and "stand-in" not in err
    assert stats["PCK"] >= 0.95 and 0 <= stats["EPE"] < 1.0 and stats["EPE_found"] >= 0.95
    assert "  scored with: PCK within 0.2 x the box's longer side; EPE" in err
    code, stats, err = run_cli(["--oracle", "--h5", h5, "--metric", "oks", "pck", "--pck-normalize",
                                "left_eye,right_eye", "--out", tmp_path / "r.jsonl",
                                "--no-progress"], capsys)
    assert code == 0 and stats["AP"] >= 0.85 and "EPE" not in stats and stats["PCK_unnormalised"] > 0
    assert "OKS uses the stand-in sigma 0.067 for every keypoint of skeleton stand_in" in err
    pictures = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [p["image_id"] for p in pictures] == sorted(COCO4_IDS)
    assert pictures[0]["file_name"] == "000000000785.jpg" and len(pictures[0]["people"]) == 1
    person = pictures[0]["people"][0]
    assert 0 < person["score"] <= 1 and set(person["keypoints"]) <= set(COCO.dataset_keypoints)
    x, y, score = person["keypoints"]["nose"]
    assert 300 < x < 450 and 0 < y < 200 and 0 < score <= 1


def test_an_annotation_id_0_is_said_at_conversion_and_scores_as_any_other(coco4_dir, tmp_path, capsys):
    from data import make_hdf5

    coco = json.loads((coco4_dir / "test_coco.json").read_text())
    coco["annotations"][0]["id"] = 0
    (tmp_path / "id0.json").write_text(json.dumps(coco))
    assert make_hdf5.main(["--ann", str(tmp_path / "id0.json"), "--images", str(coco4_dir), "--out",
                           str(tmp_path / "id0.h5"), "--split", "val", "--quiet"]) == 0
    said = capsys.readouterr()
    assert "annotation id 0, which pycocotools reads as 'no match'" in said.out + said.err
    plain = evaluate_h5(None, tmp_path / "id0.h5", PredictSettings.of(build_config(None)), "cpu",
                        EvalOptions(oracle=True, progress=False))
    assert plain["AP"] >= 0.98 and plain["AR"] >= 0.99


def _distributed_worker(rank: int, port: int, argv: list[str], out_dir: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    stats = evaluate.run(evaluate.build_parser().parse_args(argv))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as file:
        json.dump(stats, file)


@pytest.mark.slow
def test_distributed_evaluation_scores_each_image_exactly_once(coco4_h5, tmp_path, capsys):
    # 3 images on 2 processes: uneven shards, where padding would decode an image twice.
    argv = ["--oracle", "--h5", str(coco4_h5), "--max-images", "3", "--device", "cpu", "--no-progress"]
    code, single, _ = run_cli(argv + ["--out", str(tmp_path / "single.json")], capsys)
    assert code == 0
    start_forked(_distributed_worker, 2,
                 (find_free_port(), argv + ["--out", str(tmp_path / "dist.json")], str(tmp_path)))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1]                          # every rank takes the same decisions
    assert ranks[0]["num_images"] == 3
    assert {k: ranks[0][k] for k in STAT_NAMES} == {k: single[k] for k in STAT_NAMES}
    results = json.loads((tmp_path / "dist.json").read_text())
    assert results == json.loads((tmp_path / "single.json").read_text())
    assert {r["image_id"] for r in results} == set(COCO4_IDS[:3])


# ---- demo.py ---------------------------------------------------------------------------------

def test_demo_writes_the_picture_with_a_maps_panel(coco4_dir, tiny_checkpoint, tmp_path, capsys):
    import cv2

    import demo

    out = tmp_path / "pose.png"
    image = coco4_dir / "000000040083.jpg"
    code = demo.main(["--weights", str(tiny_checkpoint), "--image", str(image), "--out", str(out),
                      "--heatmaps", "--device", "cpu"])
    assert code == 0 and f"written to {out}" in capsys.readouterr().out
    height, width = cv2.imread(str(image)).shape[:2]
    assert cv2.imread(str(out)).shape == (height, 2 * width, 3)
    code = demo.main(["--weights", str(tiny_checkpoint), "--image", str(tmp_path / "none.jpg")])
    assert capsys.readouterr().err == f"error: --image {tmp_path / 'none.jpg'}: no such file or folder\n"
    assert code == 2
    code = demo.main(["--weights", str(tiny_checkpoint), "--image", str(image),
                      "--out", str(tmp_path / "pose.txt")])
    assert code == 2 and ".txt is not a picture format" in capsys.readouterr().err


def test_demo_on_a_folder_draws_every_picture(coco4_dir, tiny_checkpoint, tmp_path, capsys):
    import cv2

    import demo

    folder = tmp_path / "photos"
    folder.mkdir()
    for name in ("000000000785.jpg", "000000040083.jpg", "NOTICE.md"):   # a note is not a picture
        (folder / name).write_bytes((coco4_dir / name).read_bytes())
    code = demo.main(["--weights", str(tiny_checkpoint), "--image", str(folder), "--device", "cpu",
                      "--scales", "0.5"])
    assert code == 0
    written = sorted(p.name for p in (tmp_path / "photos_pose").iterdir())
    assert written == ["000000000785_pose.png", "000000040083_pose.png"]
    shape = cv2.imread(str(tmp_path / "photos_pose" / "000000040083_pose.png")).shape
    assert shape == cv2.imread(str(folder / "000000040083.jpg")).shape
    assert capsys.readouterr().out.count("people found in") == 2
    (tmp_path / "empty").mkdir()
    assert demo.main(["--weights", str(tiny_checkpoint), "--image", str(tmp_path / "empty")]) == 2
    assert "a folder with no pictures" in capsys.readouterr().err


def test_people_are_drawn_in_their_own_colours():
    import numpy as np

    from inference.draw import draw_people, person_colours

    people = np.zeros((2, 18, 3), np.float32)
    people[0, 2], people[0, 3] = (20, 20, 1), (20, 60, 1)      # r_shoulder - r_elbow, person 0
    people[1, 2], people[1, 3] = (80, 20, 1), (80, 60, 1)      # person 1
    picture = draw_people(np.zeros((100, 100, 3), np.uint8), people, COCO)
    first, second = person_colours(2)
    assert first != second
    assert tuple(picture[40, 20]) == first and tuple(picture[40, 80]) == second   # mid-limb
    assert picture[:, 40:60].max() == 0                                           # nothing between


def test_pictures_are_read_ahead_in_order_while_the_consumer_works_and_errors_reach_it():
    from inference.evaluation import read_ahead

    second_made = threading.Event()

    def pictures():
        yield 0
        second_made.set()
        yield 1
        yield 2
        raise DataError("picture 3 cannot be decoded")

    stream = read_ahead(pictures(), 1)
    assert next(stream) == 0
    assert second_made.wait(30)          # made while the consumer still holds picture 0
    assert [next(stream), next(stream)] == [1, 2]
    with pytest.raises(DataError, match="picture 3"):
        next(stream)
    before = threading.active_count()
    endless = read_ahead(iter(int, 1), 2)
    assert [next(endless) for _ in range(3)] == [0, 0, 0]
    endless.close()                      # the consumer stops early: the thread ends
    assert threading.active_count() == before


def test_evaluate_h5_without_a_model_or_oracle_is_refused_before_reading_the_file(tmp_path):
    from inference.evaluation import evaluate_h5

    with pytest.raises(ValueError, match="evaluate_h5 needs a model unless oracle=True"):
        evaluate_h5(None, tmp_path / "absent.h5", None, "cpu")


def test_a_results_file_scores_as_the_network_results_it_holds(coco4_h5, tmp_path, capsys):
    """The oracle's results written as COCO JSON and as JSON lines, scored with --results, give the
    oracle's stats; the settings are said in one line; a stat with nothing to score is n/a / null."""
    code, oracle, _ = run_cli(["--oracle", "--h5", coco4_h5, "--out", tmp_path / "r.jsonl", "--no-progress",
                               "--max-images", "1"], capsys)
    assert code == 0 and oracle["APm"] is None                  # image 785: one large person
    run_cli(["--oracle", "--h5", coco4_h5, "--out", tmp_path / "r.json", "--no-progress"], capsys)
    shifted = json.loads((tmp_path / "r.json").read_text())
    for result in shifted:
        result["keypoints"][0::3] = [x + 4 for x in result["keypoints"][0::3]]
    (tmp_path / "shifted.json").write_text(json.dumps(shifted))
    for name, images in (("r.jsonl", "1"), ("r.json", "0"), ("shifted.json", "0")):
        code, stats, err = run_cli(["--results", tmp_path / name, "--h5", coco4_h5, "--max-images", images],
                                   capsys)
        assert code == 0 and "  scored with: OKS AP (annotation area)" in err, err
        if name == "r.jsonl":
            assert {k: v for k, v in stats.items() if k not in ("seconds", "results")} == {
                k: v for k, v in oracle.items() if k not in ("seconds", "results", "keypoint_recall")}
            assert "APm       n/a" in err and stats["APm"] is None          # JSON's null
    expected = coco_keypoint_stats(coco4_h5_truth(coco4_h5), shifted, sigmas=COCO.sigmas)
    assert {k: stats[k] for k in expected} == expected and stats["AP"] < 1.0


def coco4_h5_truth(path) -> dict:
    import contextlib

    from data.h5format import KeypointH5

    with contextlib.closing(KeypointH5(path)) as h5:
        return h5.coco_ground_truth()


@pytest.mark.parametrize("edit, message", [
    (lambda r: r[1].update(image_id=999), "result 2: image_id 999 is not an image of the split"),
    (lambda r: r[0].update(keypoints=r[0]["keypoints"][:-3]),
     "result 1: image_id 785: keypoints has 48 values, not 51 finite numbers"),
    (lambda r: r[2]["keypoints"].__setitem__(4, float("nan")), "result 3: image_id"),
    (lambda r: r[0].update(score="high"), "result 1: image_id 785: a person without a finite score"),
    (lambda r: r[0].update(score=10 ** 400), "result 1: image_id 785: a person without a finite score"),
])
def test_a_bad_results_file_is_one_error_line_naming_the_record(edit, message, coco4_h5, tmp_path, capsys):
    run_cli(["--oracle", "--h5", coco4_h5, "--out", tmp_path / "r.json", "--no-progress"], capsys)
    results = json.loads((tmp_path / "r.json").read_text())
    edit(results)
    (tmp_path / "bad.json").write_text(json.dumps(results))
    code, stats, err = run_cli(["--results", tmp_path / "bad.json", "--h5", coco4_h5], capsys)
    assert code == 2 and stats is None and err.count("\n") == 1
    assert err.startswith(f"error: --results {tmp_path / 'bad.json'}: {message}"), err


def test_a_bad_json_lines_file_names_its_line(coco4_h5, tmp_path, capsys):
    run_cli(["--oracle", "--h5", coco4_h5, "--out", tmp_path / "r.jsonl", "--no-progress"], capsys)
    lines = (tmp_path / "r.jsonl").read_text().splitlines()
    picture = json.loads(lines[1])
    picture["people"][0]["keypoints"]["tail"] = [1, 2, 0.5]
    (tmp_path / "bad.jsonl").write_text("\n".join([lines[0], json.dumps(picture)] + lines[2:]) + "\n")
    code, stats, err = run_cli(["--results", tmp_path / "bad.jsonl", "--h5", coco4_h5], capsys)
    assert code == 2 and err.count("\n") == 1
    assert f"--results {tmp_path / 'bad.jsonl'}: line 2: image_id 40083: keypoint 'tail' is not one" in err


def test_crowd_index_and_species_are_kept_by_the_conversion_and_scored(coco4_dir, tmp_path, capsys):
    """A file whose pictures carry crowdIndex and whose people carry two categories, converted with
    a skeleton stating oks_area box, per_category and oks_stats crowd: evaluate.py reports the
    crowd statistics and scores each category on its own."""
    from data.make_hdf5 import ConvertSettings, convert
    from data.skeleton import Skeleton

    data = json.loads((coco4_dir / "test_coco.json").read_text())
    for k, image in enumerate(data["images"]):
        image["crowdIndex"] = [0.05, 0.3, 0.9, 0.5][k]
    data["categories"].append(dict(data["categories"][0], id=2, name="other"))
    for ann in data["annotations"]:
        ann["category_id"] = 2 if ann["image_id"] == 40083 else 1
    (tmp_path / "two.json").write_text(json.dumps(data))
    spec = dict(COCO.to_spec(), name="mine", oks_area="box", per_category=True, oks_stats="crowd")
    convert(tmp_path / "two.json", coco4_dir, tmp_path / "two.h5", ConvertSettings(
        split="val", progress=False, skeleton=Skeleton.from_spec(spec, "test"), categories=["1", "2"]))
    truth = coco4_h5_truth(tmp_path / "two.h5")
    assert [img.get("crowdIndex") for img in truth["images"]] == [0.05, 0.3, 0.9, 0.5]
    assert {a.get("source_category_id") for a in truth["annotations"] if a["image_id"] == 40083} == {2}
    code, stats, err = run_cli(["--oracle", "--h5", tmp_path / "two.h5", "--out", tmp_path / "r.json",
                                "--no-progress"], capsys)
    assert code == 0 and "scored with: OKS AP (0.53 x box w x h, per category, averaged, crowd stats)" in err
    assert [stats[k] for k in ("AP_easy", "AP_medium", "AP_hard", "AR75")] == pytest.approx([1.0] * 4)


@pytest.mark.parametrize("command, argv", [
    ("evaluate", ["--oracle", "--h5", "d.h5", "--out", ""]), ("evaluate", ["--h5=", "--oracle"]),
    ("data.make_hdf5", ["--ann", "a.json", "--images", "", "--out", "o.h5"]),
    ("data.make_hdf5", ["--ann", "a.json", "--images", "i", "--out", "o.h5", "--categories", ""]),
    ("export", ["--weights", "w.pth", "--out", ""]), ("demo", ["--weights", "", "--image", "p.jpg"]),
    ("train", ["--train-h5", ""]), ("train", ["--set", ""])])
def test_an_empty_value_is_refused_for_every_option_of_every_command(command, argv, capsys):
    """An empty path or list was taken as the current folder or as absent (issue 47)."""
    import importlib
    module = importlib.import_module(command)
    parser = module.build_parser(*(["train"] if command == "train" else []))
    with pytest.raises(SystemExit) as ended:
        parser.parse_args(argv)
    err = capsys.readouterr().err
    assert ended.value.code == 2 and err.count("\n") == 1
    assert re.match(r"error: argument --[a-z0-9-]+: an empty value; give one or leave the option out",
                    err), err
