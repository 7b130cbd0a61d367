"""The skeleton of the method: 18 keypoints, 30 limbs, the 50 output channels and flip maps.

Everything here is a fact of the method (see ../shared/SPEC.md, "Skeleton and output channels").
Other modules take indices from here and never hard-code them.
"""
from __future__ import annotations

KEYPOINTS = (
    "nose", "neck", "r_shoulder", "r_elbow", "r_wrist", "l_shoulder", "l_elbow", "l_wrist",
    "r_hip", "r_knee", "r_ankle", "l_hip", "l_knee", "l_ankle", "r_eye", "l_eye", "r_ear", "l_ear",
)
NUM_KEYPOINTS = len(KEYPOINTS)  # 18
NECK = 1

# (from, to) keypoint indices; the last 9 are the redundant links.
LIMBS = (
    (1, 0), (1, 14), (1, 15), (1, 16), (1, 17), (0, 14), (0, 15), (14, 16), (15, 17),
    (1, 2), (2, 3), (3, 4), (1, 5), (5, 6), (6, 7), (1, 8), (8, 9), (9, 10), (1, 11), (11, 12),
    (12, 13),
    (0, 2), (0, 5), (2, 8), (8, 12), (5, 11), (11, 9), (16, 2), (17, 5), (8, 11),
)
NUM_LIMBS = len(LIMBS)  # 30

# Output channel layout: limbs, keypoints, person mask, max over keypoints.
LIMB_CHANNELS = slice(0, NUM_LIMBS)                                  # 0-29
KEYPOINT_CHANNELS = slice(NUM_LIMBS, NUM_LIMBS + NUM_KEYPOINTS)      # 30-47
PERSON_MASK_CHANNEL = NUM_LIMBS + NUM_KEYPOINTS                      # 48
KEYPOINT_MAX_CHANNEL = PERSON_MASK_CHANNEL + 1                       # 49
NUM_CHANNELS = KEYPOINT_MAX_CHANNEL + 1                              # 50

# COCO's 17 keypoints, in COCO order, as indices into KEYPOINTS (the neck is ours).
COCO_KEYPOINTS = (
    "nose", "left_eye", "right_eye", "left_ear", "right_ear", "left_shoulder", "right_shoulder",
    "left_elbow", "right_elbow", "left_wrist", "right_wrist", "left_hip", "right_hip",
    "left_knee", "right_knee", "left_ankle", "right_ankle",
)
COCO_TO_OURS = (0, 15, 14, 17, 16, 5, 2, 6, 3, 7, 4, 11, 8, 12, 9, 13, 10)
"""COCO_TO_OURS[c] = index in KEYPOINTS of COCO keypoint c."""
SHOULDERS = (2, 5)


def _mirror_name(name: str) -> str:
    if name.startswith("r_"):
        return "l_" + name[2:]
    if name.startswith("l_"):
        return "r_" + name[2:]
    return name


KEYPOINT_FLIP = tuple(KEYPOINTS.index(_mirror_name(k)) for k in KEYPOINTS)
"""KEYPOINT_FLIP[k] = the keypoint that k becomes in a mirrored image."""


def _limb_flip() -> tuple[int, ...]:
    index = {limb: i for i, limb in enumerate(LIMBS)}
    out = []
    for a, b in LIMBS:
        fa, fb = KEYPOINT_FLIP[a], KEYPOINT_FLIP[b]
        out.append(index[(fa, fb)] if (fa, fb) in index else index[(fb, fa)])
    return tuple(out)


LIMB_FLIP = _limb_flip()
"""LIMB_FLIP[l] = the limb that l becomes in a mirrored image."""

CHANNEL_FLIP = (
    tuple(LIMB_FLIP)
    + tuple(NUM_LIMBS + k for k in KEYPOINT_FLIP)
    + (PERSON_MASK_CHANNEL, KEYPOINT_MAX_CHANNEL)
)
"""Permutation of the 50 output channels for a mirrored image: out_flipped[c] = out[CHANNEL_FLIP[c]]."""
