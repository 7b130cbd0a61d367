"""Published keypoint datasets' layouts, made from coco4 (no copy of any dataset): coco4's JSON
changed to look like each dataset's file as its authors ship it. Used by
tests/test_datasets_as_shipped.py and bench/dataset_flows.py (one generator for both).

`shipped(coco4_dir, folder, change, name)` writes coco4's JSON with a change applied; the changes:
`as_shipped(dataset, images)` (a key of AS_SHIPPED, or a built-in skeleton's name: its keypoints
spelled as the built-in spells them), `wholebody` (COCO-WholeBody's fields), `points_of`.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from data.skeleton import builtin

COCO_NAMES = list(builtin("coco").dataset_keypoints)


def shipped(coco4_dir: Path, tmp_path: Path, change, name: str = "shipped.json") -> Path:
    """coco4's JSON with `change(data)` applied, written to tmp_path/name."""
    data = json.loads((coco4_dir / "test_coco.json").read_text())
    change(data)
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def points_of(data, count):
    """coco4's people with `count` keypoints: COCO's 17 first (or cut), the others unlabelled."""
    for ann in data["annotations"]:
        values = ann["keypoints"][:3 * count]
        ann["keypoints"] = values + [0] * (3 * count - len(values))


def pictures(data, images=slice(None)):
    """Keeps the pictures `images` of coco4's (and their people)."""
    data["images"] = data["images"][images]
    kept = {info["id"] for info in data["images"]}
    data["annotations"] = [a for a in data["annotations"] if a["image_id"] in kept]


MHP_AS_SHIPPED = ["Right-ankle", "Right-knee", "Right-hip", "Left-hip", "Left-knee", "Left-ankle", "Pelvis",
                  "Thorax", "Upper-neck", "Head-top", "Right-wrist", "Right-elbow", "Right-shoulder",
                  "Left-shoulder", "Left-elbow", "Left-wrist"]
# The keypoint names as each dataset's JSON spells them (None: the category names none, as Halpe's),
# and the built-in they are. MHP's spelling is the one issue 40 reports of its file; Animal-Pose's
# is mmpose's (data/skeletons/animalpose.yaml); the others spell them as the built-ins do.
AS_SHIPPED = {
    "COCO": ("coco", COCO_NAMES), "OCHuman": ("coco", COCO_NAMES), "MacaquePose": ("coco", COCO_NAMES),
    "Human-Art": ("humanart21", list(builtin("humanart21").dataset_keypoints)),
    "CrowdPose": ("crowdpose", list(builtin("crowdpose").dataset_keypoints)),
    "ExLPose": ("crowdpose", list(builtin("crowdpose").dataset_keypoints)),
    "AIC": ("aic", list(builtin("aic").dataset_keypoints)), "MHP": ("mhp", MHP_AS_SHIPPED),
    "Halpe": ("halpe136", None), "AP-10K": ("ap10k", list(builtin("ap10k").dataset_keypoints)),
    "Animal-Pose": ("animalpose", ["L_Eye", "R_Eye", "L_EarBase", "R_EarBase", "Nose", "Throat", "TailBase",
                                   "Withers", "L_F_Elbow", "R_F_Elbow", "L_B_Elbow", "R_B_Elbow", "L_F_Knee",
                                   "R_F_Knee", "L_B_Knee", "R_B_Knee", "L_F_Paw", "R_F_Paw", "L_B_Paw",
                                   "R_B_Paw"]),
    **{name: (name.lower().replace("-", ""), list(builtin(name.lower().replace("-", "")).dataset_keypoints))
       for name in ("ATRW", "Horse-10", "Zebra", "Locust", "Fly")},
}


def as_shipped(dataset: str, images=slice(None)):
    """A change making coco4's JSON look like `dataset`'s (its pictures `images` of coco4's);
    `dataset` a key of AS_SHIPPED, or a built-in's name (its names as the built-in spells them)."""
    known, names = AS_SHIPPED.get(dataset) or (dataset, list(builtin(dataset).dataset_keypoints))
    count = len(builtin(known).dataset_keypoints)

    def change(data):
        pictures(data, images)
        points_of(data, 17 if dataset == "Human-Art" else count)
        data["categories"][0].pop("skeleton")
        if names is None:
            data["categories"][0].pop("keypoints")
        else:
            data["categories"][0]["keypoints"] = names
        for ann in data["annotations"] if dataset == "Human-Art" else []:
            ann["keypoints_21"] = ann["keypoints"] + ann["keypoints"][27:39]      # wrists and ankles again
    return change


def wholebody(data):
    """coco4 in COCO-WholeBody's layout: 6 foot, 68 face and 2 x 21 hand points per person, in
    their fields (near the ankles, the nose and the wrists), some with a fractional visibility; and
    a crowd region without them."""
    rng = np.random.default_rng(0)
    for ann in data["annotations"]:
        body = np.asarray(ann["keypoints"], float).reshape(17, 3)
        size = max(ann["bbox"][2], ann["bbox"][3])

        def near(k, count):
            xy = body[k, :2] + rng.uniform(-0.06, 0.06, (count, 2)) * size
            v = np.where(body[k, 2] > 0, 2.0, 0.0)
            return np.concatenate([np.where(v > 0, xy.round(1), 0), np.full((count, 1), v)], 1)
        ann["foot_kpts"] = np.concatenate([near(15, 3), near(16, 3)]).reshape(-1).tolist()
        face = near(0, 68)
        face[:5, 2] = np.where(face[:5, 2] > 0, 0.6, 0)                       # "labelled", fractional
        ann["face_kpts"] = face.reshape(-1).tolist()
        ann["lefthand_kpts"], ann["righthand_kpts"] = near(9, 21).reshape(-1).tolist(), \
            near(10, 21).reshape(-1).tolist()
        for part in ("face", "lefthand", "righthand"):
            ann[f"{part}_valid"], ann[f"{part}_box"] = True, [0, 0, 1, 1]
        ann["foot_valid"] = True
    crowd = {k: v for k, v in data["annotations"][0].items() if not k.endswith(("_kpts", "_valid", "_box"))}
    data["annotations"].append(dict(crowd, id=1, iscrowd=1, num_keypoints=0, keypoints=[0] * 51))
