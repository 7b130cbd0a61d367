"""Skeletons in a few words for error messages about two of them (a checkpoint's and the data's, a
validation file's and a training file's): the words of the two sides always differ."""
from __future__ import annotations

from data.skeleton import Skeleton


def skeleton_words(skeleton: Skeleton, other: Skeleton) -> str:
    """`skeleton` in a few words that tell it from `other`: name and sizes, else what differs."""
    words = f"{skeleton.name}, {skeleton.num_keypoints} keypoints, {skeleton.num_channels} channels"
    if words != f"{other.name}, {other.num_keypoints} keypoints, {other.num_channels} channels":
        return words
    names = skeleton.keypoints
    if skeleton.keypoints != other.keypoints:
        k = next(k for k, (a, b) in enumerate(zip(skeleton.keypoints, other.keypoints)) if a != b)
        return f"{words}, keypoint {k} {names[k]!r}"
    if limb_changes(skeleton, other):
        return f"{words}, {limb_changes(skeleton, other)}"
    if skeleton.limbs != other.limbs or skeleton.main_limbs != other.main_limbs:
        return f"{words}, {skeleton.main_limbs} main limbs in another order"
    if skeleton.flip != other.flip:
        pairs = sorted({tuple(sorted((names[k], names[f]))) for k, f in enumerate(skeleton.flip) if f != k})
        return f"{words}, flip pairs {', '.join('/'.join(p) for p in pairs) or 'none'}"
    if skeleton.derived != other.derived:
        made = [f"{names[k]} from {names[a]}+{names[b]}" for k, a, b in skeleton.derived]
        return f"{words}, derived {', '.join(made) or 'none'}"
    if skeleton.sigmas != other.sigmas:
        return f"{words}, OKS sigmas {', '.join(f'{s:g}' for s in skeleton.sigmas)}"
    return f"{words}, keypoints in the annotations {', '.join(skeleton.dataset_keypoints)}"


def limb_changes(skeleton: Skeleton, other: Skeleton) -> str:
    """`with limb a-b` that `other` lacks, else `without limb c-d`; empty when the limbs agree."""
    def limbs(of: Skeleton) -> set:
        return {"-".join(sorted((of.keypoints[a], of.keypoints[b]))) for a, b in of.limbs}
    own, lacks = sorted(limbs(skeleton) - limbs(other)), sorted(limbs(other) - limbs(skeleton))
    return f"with limb {', '.join(own)}" if own else f"without limb {', '.join(lacks)}" if lacks else ""
