"""Dense and long-chain test skeletons, crowded pictures of their people, and their oracle AP.

Three skeletons shaped like published ones (built here, not read from any dataset):
- `halpe136_like`: Halpe-FullBody's 136 keypoints in its order (26 body, 68 face, 2 x 21 hand),
  its body and hand links as Halpe publishes them (mmpose's halpe.py), its OKS sigmas (body as
  listed there, 0.015 for every face and hand point). Halpe gives no face links, and its hand
  roots are separate keypoints on the body wrists: here each hand root hangs on its body wrist
  (at the same spot, a link of length 0) and the face is chained as a 68-point face layout draws
  it (contour, brows, nose, eyes and lips, each a chain or loop hung on the nose): an
  approximation with the structure of a converted Halpe file, stated as such.
- `exlpose_like`: CrowdPose's 14 keypoints (ExLPose annotates those) with a bare tree of links.
- `mhp_like`: MPII's 16 keypoints (LV-MHP's layout) with MPII's tree of links: long chains
  (ankle-knee-hip-pelvis-thorax-neck-head, wrist-elbow-shoulder-thorax) and no redundant links.

`crowded_people` draws 2-6 overlapping people of 60-330 px on a picture, with unlabelled keypoints
(hidden hands, faces, random points, the picture's border); `oracle_results` draws their
ground-truth maps (data.targets, stride 1) and groups them, and `oracle_ap` scores that with COCO
AP and the skeleton's sigmas, as `evaluate.py --oracle` does.
"""
from __future__ import annotations

import math

import numpy as np

from config.schema import InferenceConfig, TargetConfig
from data.skeleton import Skeleton
from data.synthetic import _place, _pose
from data.targets import render_targets
from inference.coco_eval import coco_keypoint_stats
from inference.grouping import group_people, to_coco_results

COCO17 = ["nose", "left_eye", "right_eye", "left_ear", "right_ear", "left_shoulder", "right_shoulder",
          "left_elbow", "right_elbow", "left_wrist", "right_wrist", "left_hip", "right_hip", "left_knee",
          "right_knee", "left_ankle", "right_ankle"]
HALPE_BODY = COCO17 + ["head", "neck", "hip", "left_big_toe", "right_big_toe", "left_small_toe",
                       "right_small_toe", "left_heel", "right_heel"]
HALPE_BODY_LINKS = [
    ("left_ankle", "left_knee"), ("left_knee", "left_hip"), ("left_hip", "hip"),
    ("right_ankle", "right_knee"), ("right_knee", "right_hip"), ("right_hip", "hip"), ("head", "neck"),
    ("neck", "hip"), ("neck", "left_shoulder"), ("left_shoulder", "left_elbow"),
    ("left_elbow", "left_wrist"), ("neck", "right_shoulder"), ("right_shoulder", "right_elbow"),
    ("right_elbow", "right_wrist"), ("left_eye", "right_eye"), ("nose", "left_eye"), ("nose", "right_eye"),
    ("left_eye", "left_ear"), ("right_eye", "right_ear"), ("left_ear", "left_shoulder"),
    ("right_ear", "right_shoulder"), ("left_ankle", "left_big_toe"), ("left_ankle", "left_small_toe"),
    ("left_ankle", "left_heel"), ("right_ankle", "right_big_toe"), ("right_ankle", "right_small_toe"),
    ("right_ankle", "right_heel")]
HALPE_BODY_SIGMAS = [0.026, 0.025, 0.025, 0.035, 0.035, 0.079, 0.079, 0.072, 0.072, 0.062, 0.062, 0.107,
                     0.107, 0.087, 0.087, 0.089, 0.089, 0.08, 0.08, 0.08, 0.089, 0.089, 0.089, 0.089,
                     0.089, 0.089]
FINGERS = ["thumb", "forefinger", "middle_finger", "ring_finger", "pinky_finger"]
# The 68-point face, 0-based: (first, last, closed loop) of each part.
FACE_PARTS = [(0, 16, False), (17, 21, False), (22, 26, False), (27, 30, False), (31, 35, False),
              (36, 41, True), (42, 47, True), (48, 59, True), (60, 67, True)]
# Which point each part hangs on: nose -> nose bridge top; brows, nostrils, eyes, lips, contour.
FACE_HANGS = {27: "nose", 17: "face_28", 22: "face_28", 31: "face_31", 36: "face_20", 42: "face_25",
              48: "face_34", 60: "face_52", 0: "face_18"}


def _hand(side: str) -> list:
    return [f"{side}_hand_root"] + [f"{side}_{f}{k}" for f in FINGERS for k in range(1, 5)]


def halpe136_like() -> Skeleton:
    face = [f"face_{k}" for k in range(1, 69)]
    names = HALPE_BODY + face + _hand("left") + _hand("right")
    limbs = list(HALPE_BODY_LINKS)
    for first, last, loop in FACE_PARTS:
        limbs.append((FACE_HANGS[first], face[first]))
        limbs += [(face[k], face[k + 1]) for k in range(first, last)]
    for side in ("left", "right"):
        limbs.append((f"{side}_wrist", f"{side}_hand_root"))
        for finger in FINGERS:
            chain = [f"{side}_hand_root"] + [f"{side}_{finger}{k}" for k in range(1, 5)]
            limbs += list(zip(chain[:-1], chain[1:]))
    loops = [(face[last], face[first]) for first, last, loop in FACE_PARTS if loop]
    return Skeleton.from_spec({"name": "halpe136_like", "keypoints": names,
                               "sigmas": HALPE_BODY_SIGMAS + [0.015] * 110,
                               "limbs": [list(l) for l in limbs], "redundant": [list(l) for l in loops]},
                              "halpe136_like")


CROWDPOSE14 = ["left_shoulder", "right_shoulder", "left_elbow", "right_elbow", "left_wrist", "right_wrist",
               "left_hip", "right_hip", "left_knee", "right_knee", "left_ankle", "right_ankle", "head", "neck"]


def exlpose_like() -> Skeleton:
    links = [("head", "neck"), ("neck", "left_shoulder"), ("neck", "right_shoulder"),
             ("left_shoulder", "left_elbow"), ("left_elbow", "left_wrist"), ("right_shoulder", "right_elbow"),
             ("right_elbow", "right_wrist"), ("left_shoulder", "left_hip"), ("right_shoulder", "right_hip"),
             ("left_hip", "left_knee"), ("left_knee", "left_ankle"), ("right_hip", "right_knee"),
             ("right_knee", "right_ankle")]
    return Skeleton.from_spec({"name": "exlpose_like", "keypoints": CROWDPOSE14,
                               "sigmas": [0.079, 0.079, 0.072, 0.072, 0.062, 0.062, 0.107, 0.107, 0.087,
                                          0.087, 0.089, 0.089, 0.079, 0.079],
                               "limbs": [list(l) for l in links]}, "exlpose_like")


MPII16 = ["right_ankle", "right_knee", "right_hip", "left_hip", "left_knee", "left_ankle", "pelvis", "thorax",
          "upper_neck", "head_top", "right_wrist", "right_elbow", "right_shoulder", "left_shoulder",
          "left_elbow", "left_wrist"]


def mhp_like() -> Skeleton:
    links = [("right_ankle", "right_knee"), ("right_knee", "right_hip"), ("right_hip", "pelvis"),
             ("left_hip", "pelvis"), ("left_knee", "left_hip"), ("left_ankle", "left_knee"),
             ("pelvis", "thorax"), ("thorax", "upper_neck"), ("upper_neck", "head_top"),
             ("right_wrist", "right_elbow"), ("right_elbow", "right_shoulder"), ("right_shoulder", "thorax"),
             ("left_shoulder", "thorax"), ("left_elbow", "left_shoulder"), ("left_wrist", "left_elbow")]
    return Skeleton.from_spec({"name": "mhp_like", "keypoints": MPII16, "sigmas": 0.079,
                               "limbs": [list(l) for l in links]}, "mhp_like")


def _face_layout() -> np.ndarray:
    """[68, 2] points of a face in units of its half width, centred on the nose tip, y down."""
    pts = np.zeros((68, 2))
    angle = np.linspace(math.pi, 0, 17)
    pts[0:17] = np.stack([np.cos(angle), 0.2 + 1.05 * np.sin(angle) - 0.2 * (np.sin(angle) < 0.3)], 1)
    pts[17:22] = np.stack([np.linspace(-0.85, -0.2, 5), -0.75 - 0.08 * np.sin(np.linspace(0, math.pi, 5))], 1)
    pts[22:27] = pts[17:22][::-1] * [-1, 1]
    pts[27:31] = np.stack([np.zeros(4), np.linspace(-0.6, -0.05, 4)], 1)
    pts[31:36] = np.stack([np.linspace(-0.25, 0.25, 5), 0.08 + 0.04 * np.abs(np.linspace(-1, 1, 5))], 1)
    ring6 = np.linspace(math.pi, -math.pi, 6, endpoint=False)
    for first, cx in ((36, -0.45), (42, 0.45)):
        pts[first:first + 6] = np.stack([cx + 0.2 * np.cos(ring6), -0.45 + 0.08 * np.sin(ring6)], 1)
    ring12, ring8 = np.linspace(math.pi, -math.pi, 12, endpoint=False), np.linspace(math.pi, -math.pi, 8,
                                                                                     endpoint=False)
    pts[48:60] = np.stack([0.42 * np.cos(ring12), 0.45 + 0.16 * np.sin(ring12)], 1)
    pts[60:68] = np.stack([0.3 * np.cos(ring8), 0.45 + 0.06 * np.sin(ring8)], 1)
    return pts


FACE = _face_layout()


def _halpe_person(coco: np.ndarray, height: float, rng) -> np.ndarray:
    """[136, 2] keypoints of a Halpe-like person from its 17 COCO keypoints (pixels)."""
    kp = np.zeros((136, 2))
    kp[:17] = coco
    up = (coco[5] + coco[6]) / 2 - (coco[11] + coco[12]) / 2
    up /= max(np.linalg.norm(up), 1e-6)
    across = np.array([-up[1], up[0]])
    kp[17] = coco[0] + 0.09 * height * up                      # head top
    kp[18], kp[19] = (coco[5] + coco[6]) / 2, (coco[11] + coco[12]) / 2
    for ankle, side, big, small, heel in ((15, 1, 20, 22, 24), (16, -1, 21, 23, 25)):
        kp[big] = coco[ankle] - 0.03 * height * up + side * 0.035 * height * across
        kp[small] = coco[ankle] - 0.03 * height * up + side * 0.02 * height * across
        kp[heel] = coco[ankle] - 0.015 * height * up - side * 0.01 * height * across
    half = 0.055 * height * rng.uniform(0.9, 1.1)             # the face's half width
    frame = np.stack([across * -1, -up], 1)                   # face x: image right of the face's left
    kp[26:94] = coco[0] + (FACE * half) @ frame.T
    for wrist, elbow, root in ((9, 7, 94), (10, 8, 115)):
        along = coco[wrist] - coco[elbow]
        along /= max(np.linalg.norm(along), 1e-6)
        side = np.array([-along[1], along[0]])
        kp[root] = coco[wrist]
        for f in range(5):
            spread = (f - 2) * 0.012 * height
            base = coco[wrist] + 0.04 * height * along + spread * side
            bend = along + 0.15 * (f - 2) * side
            if f == 0:                                        # thumb: out to the side
                base = coco[wrist] + 0.015 * height * along - 0.025 * height * side
                bend = 0.6 * along - 0.8 * side
            for k in range(4):
                kp[root + 1 + 4 * f + k] = base + k * 0.016 * height * bend
    return kp


def _crowdpose_person(coco: np.ndarray, height: float) -> np.ndarray:
    kp = coco[[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 0, 0]].copy()
    kp[12] = coco[0] - 0.09 * height * np.array([0, 1])       # head top (the figure stands upright-ish)
    kp[13] = (coco[5] + coco[6]) / 2
    return kp


def _mpii_person(coco: np.ndarray, height: float) -> np.ndarray:
    kp = coco[[16, 14, 12, 11, 13, 15, 0, 0, 0, 0, 10, 8, 6, 5, 7, 9]].copy()
    kp[6] = (coco[11] + coco[12]) / 2
    kp[7] = (coco[5] + coco[6]) / 2
    kp[8] = kp[7] + 0.35 * (coco[0] - kp[7])
    kp[9] = coco[0] - 0.09 * height * np.array([0, 1])
    return kp


def crowded_people(skeleton: Skeleton, rng, height: int = 480, width: int = 640,
                   unlabelled: float = 0.04, heights=(60, 330)) -> np.ndarray:
    """[P, K, 3] people (dataset order, v 2 labelled / 0 not) `heights` px tall crowded on a
    height x width picture."""
    count = int(rng.integers(2, 7))
    cx = rng.uniform(0.25, 0.75) * width
    people = []
    for _ in range(count):
        h = rng.uniform(*heights)
        origin = (cx + rng.normal(0, 0.18 * width), rng.uniform(0.45 * h, height - 0.3 * h))
        coco = _place(_pose(rng), h, rng.uniform(-15, 15), origin)
        if skeleton.num_keypoints == 136:
            kp = _halpe_person(coco, h, rng)
        elif skeleton.num_keypoints == 14:
            kp = _crowdpose_person(coco, h)
        else:
            kp = _mpii_person(coco, h)
        vis = np.full(len(kp), 2.0)
        vis[rng.random(len(kp)) < unlabelled] = 0                          # a point nobody labelled
        if skeleton.num_keypoints == 136:
            for first, last in ((94, 114), (115, 135)):
                if rng.random() < 0.3:
                    vis[first:last + 1] = 0                           # a hidden hand
            if rng.random() < 0.15:
                vis[26:94] = 0                                        # a face turned away
        outside = (kp[:, 0] < 0) | (kp[:, 1] < 0) | (kp[:, 0] > width - 1) | (kp[:, 1] > height - 1)
        vis[outside] = 0
        people.append(np.concatenate([np.where(vis[:, None] > 0, kp, 0), vis[:, None]], 1))
    return np.stack(people).astype(np.float32)


def picture_annotations(people: np.ndarray, image_id: int, first_id: int) -> list:
    """COCO annotations of `people` (dataset order) with the box area of their labelled points."""
    anns = []
    for n, person in enumerate(people):
        seen = person[:, 2] > 0
        if seen.sum() < 2:
            continue
        lo, hi = person[seen, :2].min(0), person[seen, :2].max(0)
        w, h = (hi - lo) + 1
        anns.append({"id": first_id + n, "image_id": image_id, "category_id": 1, "iscrowd": 0,
                     "keypoints": np.round(person, 2).reshape(-1).tolist(), "num_keypoints": int(seen.sum()),
                     "area": float(w * h * 0.6), "bbox": [float(lo[0]), float(lo[1]), float(w), float(h)]})
    return anns


def oracle_results(skeleton: Skeleton, pictures: int = 20, seed: int = 0, cfg: InferenceConfig | None = None,
                   height: int = 480, width: int = 640, unlabelled: float = 0.04, hide=None,
                   heights=(60, 330)) -> tuple[dict, list]:
    """(COCO ground truth, results) of the grouping on the ground-truth maps of `pictures` crowded
    pictures; `hide(people, rng)` may unlabel more of their keypoints first (dataset order)."""
    cfg = cfg or InferenceConfig()
    rng = np.random.default_rng(seed)
    images, annotations, results = [], [], []
    for image_id in range(1, pictures + 1):
        people = crowded_people(skeleton, rng, height, width, unlabelled, heights)
        if hide is not None:
            hide(people, rng)
            people[people[..., 2] == 0] = 0
        ours = np.stack([skeleton.from_annotation(p.reshape(-1)) for p in people])
        maps = render_targets(ours, height, width, 1, TargetConfig(), skeleton)
        keypoints, scores = group_people(maps, cfg, skeleton)
        images.append({"id": image_id, "width": width, "height": height, "file_name": f"{image_id}.jpg"})
        annotations += picture_annotations(people, image_id, 100 * image_id)
        results += to_coco_results(image_id, keypoints, scores, skeleton)
    gt = {"images": images, "annotations": annotations,
          "categories": [{"id": 1, "name": "person", "keypoints": list(skeleton.dataset_keypoints)}]}
    return gt, results


def oracle_ap(skeleton: Skeleton, pictures: int = 20, seed: int = 0, cfg: InferenceConfig | None = None,
              height: int = 480, width: int = 640, unlabelled: float = 0.04, heights=(60, 330)) -> float:
    """COCO AP of the grouping on the ground-truth maps of `pictures` crowded pictures."""
    gt, results = oracle_results(skeleton, pictures, seed, cfg, height, width, unlabelled, heights=heights)
    return coco_keypoint_stats(gt, results, sigmas=skeleton.sigmas)["AP"]
