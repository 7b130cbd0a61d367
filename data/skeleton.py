"""The skeleton of a dataset: its keypoints, the limbs the network learns, flips, OKS sigmas, channels
(limbs, keypoints, person mask, keypoint max). Stored in the HDF5 file and every checkpoint (fields:
docs/data.md); built-ins in data/skeletons/NAME.yaml; every problem is a `ConfigError` naming its source."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cache, cached_property
from pathlib import Path

import numpy as np

from common.errors import ConfigError
from config.loader import out_of_bounds, read_yaml
from config.schema import FILE_FIELDS

BUILTIN_DIR = Path(__file__).resolve().parent / "skeletons"
DEFAULT_SIGMA = 0.067      # the mean of COCO's 17 OKS sigmas, for keypoints nobody gave one
METRIC_KEYS = {"oks": "AP", "pck": "PCK", "auc": "AUC", "epe": "EPE"}   # a metric -> its stat's name
LOWER_IS_BETTER = {"EPE", "loss"}
SCORING_CHOICES = {"oks_area": ("area", "box"), "per_category": (False, True), "oks_stats": ("coco", "crowd")}
_SIDES = {"left": "right", "right": "left", "l": "r", "r": "l", "Left": "Right", "Right": "Left",
          "L": "R", "R": "L", "LEFT": "RIGHT", "RIGHT": "LEFT"}
_GLUED = (re.compile(r"^(left|right|Left|Right|LEFT|RIGHT|L|R|l|r)(?=[A-Z0-9])"),   # LeftEye, LEye
          re.compile(r"^(left|right)(?=[a-z])"),                                    # leftear
          re.compile(r"(?<=[a-z0-9])(Left|Right|L|R)(?=\d*$)"))                     # eyeL, legL1
_LOOSE = re.compile(r"^(L|R)(?=[a-z])")        # Lear/Rear, but Lip and Rump name no side
_TOKEN = re.compile(r"(?<=^[FBHfbh])[LRlr]$|^[LRlr](?=[FBHfbh]?$)")     # FL (front left), LB, l; not FLB


def mirror_names(name: str, loose: bool = False) -> list:
    """The names `name` may have on the other side, most likely first (`left_eye`, `paw_l`, `LEye`,
    `eyeLeft`, ...; with `loose` also `Lear`, a side only when `Rear` is there too); empty: none."""
    parts = re.split(r"([_\-\s.]+)", name)            # the separators kept: joined, the parts are `name`
    out = ["".join(_SIDES.get(p) or _TOKEN.sub(lambda m: _SIDES[m[0]], p) for p in parts)]
    for pattern in _GLUED + ((_LOOSE,) if loose else ()):
        if match := pattern.search(name):
            out.append(name[:match.start()] + _SIDES[match[1]] + name[match.end():])
    return [n for n in dict.fromkeys(out) if n != name]


def unpaired_sided(names) -> list:
    """The names that name a side but whose other side is not among `names`."""
    known = set(names)
    return [n for n in names if mirror_names(n) and not any(m in known for m in mirror_names(n))]


def name_flips(names) -> list:
    """flip[k]: the keypoint names[k] becomes when mirrored (`mirror_names`); k itself when none."""
    index = {n: k for k, n in enumerate(names)}
    flip = [next((index[m] for m in mirror_names(n, loose=True) if m in index), k)
            for k, n in enumerate(names)]
    return [f if flip[f] == k else k for k, f in enumerate(flip)]


@dataclass(frozen=True)
class Scoring:
    """How a skeleton's data is scored (docs/data.md, docs/evaluation.md)."""

    metrics: tuple = ("oks",)              # the first keeps best.pth
    pck_threshold: float = 0.2             # PCK: within this x pck_normalize
    pck_normalize: str | tuple = "bbox"    # "bbox": the box's longer side; or two keypoints' distance
    oks_area: str = "area"                 # the annotation's (COCO's); "box": 0.53 x w x h, for OKS, APm, APl
    per_category: bool = False             # each category its own AP, averaged
    oks_stats: str = "coco"                # "crowd": CrowdPose's AR50, AR75 and AP easy / medium / hard too

    @property
    def key(self) -> str:
        """The name of the stat training keeps best.pth by ("AP", "PCK", ...)."""
        return METRIC_KEYS[self.metrics[0]]

    def written(self) -> dict:
        """Its fields as a skeleton file writes them."""
        normalize = self.pck_normalize if isinstance(self.pck_normalize, str) else list(self.pck_normalize)
        return {"metric": list(self.metrics), "pck_threshold": self.pck_threshold, "pck_normalize": normalize,
                "oks_area": self.oks_area, "per_category": self.per_category, "oks_stats": self.oks_stats}

    def describe(self) -> str:
        """The settings in one line, as evaluate.py prints them."""
        pck = ("the box's longer side" if self.pck_normalize == "bbox"
               else "the {}-{} distance".format(*self.pck_normalize))
        words = {"oks": f"OKS AP ({'0.53 x box w x h' if self.oks_area == 'box' else 'annotation area'}"
                        f"{', per category, averaged' if self.per_category else ''}"
                        f"{', crowd stats' if self.oks_stats == 'crowd' else ''})",
                 "pck": f"PCK within {self.pck_threshold:g} x {pck}", "auc": "AUC", "epe": "EPE"}
        return "scored with: " + "; ".join(words[m] for m in self.metrics)


def parse_scoring(spec: dict, keypoints, source: str, base: Scoring = Scoring()) -> Scoring:
    """`base` with the scoring fields `spec` gives, checked; a `ConfigError` naming `source`."""
    metrics = spec.get("metric", base.metrics)
    metrics = [metrics] if isinstance(metrics, str) else metrics
    if (not isinstance(metrics, (list, tuple)) or not metrics
            or any(m not in METRIC_KEYS for m in metrics) or len(set(metrics)) != len(metrics)):
        _fail(source, f"metric {metrics!r}: give one or more of {', '.join(METRIC_KEYS)}, each once")
    threshold = spec.get("pck_threshold", base.pck_threshold)
    if problem := out_of_bounds(threshold, FILE_FIELDS["skeleton.pck_threshold"]):
        _fail(source, f"pck_threshold {threshold!r} {problem}")
    normalize = spec.get("pck_normalize", base.pck_normalize)
    if normalize != "bbox":
        pair = list(normalize) if isinstance(normalize, (list, tuple)) else []
        if len(pair) != 2 or pair[0] == pair[1] or any(n not in keypoints for n in pair):
            _fail(source, f"pck_normalize {normalize!r}: give bbox, or two of the annotated keypoints "
                  f"({', '.join(keypoints)})")
        normalize = tuple(pair)
    choices = {}
    for name, allowed in SCORING_CHOICES.items():
        choices[name] = value = spec.get(name, getattr(base, name))
        if not any(value == a and type(value) is type(a) for a in allowed):
            _fail(source, f"{name} {value!r}: give one of {', '.join(str(a).lower() for a in allowed)}")
    return Scoring(tuple(metrics), float(threshold), normalize, **choices)


@dataclass(frozen=True)
class Skeleton:
    """A checked skeleton; build it with `Skeleton.from_spec`, `builtin` or `load_skeleton`."""

    name: str
    keypoints: tuple           # network order (keypoint channels)
    limbs: tuple               # (a, b) indices into `keypoints`: main links, then redundant
    main_limbs: int            # how many of `limbs` are main links
    flip: tuple                # flip[k]: the keypoint k becomes in a mirrored image
    dataset_keypoints: tuple   # the annotations' keypoints, in their order
    sigmas: tuple              # OKS sigma per dataset keypoint
    derived: tuple             # (k, a, b): keypoint k is the midpoint of a and b
    scoring: Scoring = field(default=Scoring(), compare=False)   # how it is scored, not what it is

    @property
    def stand_in_sigmas(self) -> bool:
        """Whether the OKS sigmas are all the default, nobody's measurement."""
        return all(s == DEFAULT_SIGMA for s in self.sigmas)

    # -- channel layout -------------------------------------------------------------------------
    @property
    def num_keypoints(self) -> int:
        return len(self.keypoints)

    @property
    def num_limbs(self) -> int:
        return len(self.limbs)

    @property
    def limb_channels(self) -> slice:
        return slice(0, self.num_limbs)

    @property
    def keypoint_channels(self) -> slice:
        return slice(self.num_limbs, self.num_limbs + self.num_keypoints)

    @property
    def person_mask_channel(self) -> int:
        return self.num_limbs + self.num_keypoints

    @property
    def keypoint_max_channel(self) -> int:
        return self.person_mask_channel + 1

    @property
    def num_channels(self) -> int:
        return self.keypoint_max_channel + 1

    @cached_property
    def dataset_index(self) -> tuple:
        """dataset_index[c] = index in `keypoints` of the annotations' keypoint c."""
        return tuple(self.keypoints.index(n) for n in self.dataset_keypoints)

    @cached_property
    def channel_flip(self) -> tuple:
        """Permutation of the output channels for a mirrored image: out_flipped[c] = out[flip[c]]."""
        index = {limb: i for i, limb in enumerate(self.limbs)}
        index.update({(b, a): i for i, (a, b) in enumerate(self.limbs)})
        return (tuple(index[(self.flip[a], self.flip[b])] for a, b in self.limbs)     # the limb each becomes
                + tuple(self.num_limbs + k for k in self.flip)
                + (self.person_mask_channel, self.keypoint_max_channel))

    def describe(self) -> str:
        return (f"skeleton {self.name}: {self.num_keypoints} keypoints, {self.main_limbs} main + "
                f"{self.num_limbs - self.main_limbs} redundant limbs, {self.num_channels} channels")

    # -- annotations ----------------------------------------------------------------------------
    def from_annotation(self, values) -> np.ndarray:
        """Annotations' (x, y, v) -> float32 [K, 3] (or [N, K, 3]) in network order, derived added."""
        given = np.asarray(values, np.float32)
        count = len(self.dataset_keypoints)
        lead = given.shape[:-2] if given.shape[-2:] == (count, 3) else given.shape[:-1]
        ours = np.zeros((*lead, self.num_keypoints, 3), np.float32)
        ours[..., list(self.dataset_index), :] = given.reshape(*lead, count, 3)
        for k, a, b in self.derived:
            both = (ours[..., a, 2] > 0) & (ours[..., b, 2] > 0)
            ours[..., k, :2] = np.where(both[..., None], (ours[..., a, :2] + ours[..., b, :2]) / 2, 0)
            ours[..., k, 2] = np.where(both, np.minimum(ours[..., a, 2], ours[..., b, 2]), 0)
        return ours

    def to_dataset_order(self, keypoints: np.ndarray) -> np.ndarray:
        """[..., K, 3] in network order -> [..., dataset keypoints, 3] (derived ones dropped)."""
        return keypoints[..., list(self.dataset_index), :]

    # -- the written form -----------------------------------------------------------------------
    def to_spec(self) -> dict:
        names = self.keypoints
        pairs = sorted({tuple(sorted((k, f))) for k, f in enumerate(self.flip) if f != k})
        default = Scoring().written()      # scoring fields only where not the default: COCO's as before
        return {
            "name": self.name, "keypoints": list(self.dataset_keypoints),
            "sigmas": [float(s) for s in self.sigmas],
            "derived": {names[k]: [names[a], names[b]] for k, a, b in self.derived},
            "channels": list(names),
            "limbs": [[names[a], names[b]] for a, b in self.limbs[:self.main_limbs]],
            "redundant": [[names[a], names[b]] for a, b in self.limbs[self.main_limbs:]],
            "flip": [[names[a], names[b]] for a, b in pairs],
            **{k: v for k, v in self.scoring.written().items() if v != default[k]},
        }

    @classmethod
    def from_spec(cls, spec, source: str) -> "Skeleton":
        """A checked skeleton from its mapping; `ConfigError` naming `source` when it is wrong."""
        if not isinstance(spec, dict):
            _fail(source, "a skeleton must be a mapping with keypoints and limbs")
        unknown = set(spec) - {"name", "keypoints", "sigmas", "derived", "channels", "limbs", "redundant",
                               "flip", *Scoring().written()}
        if unknown:
            _fail(source, f"unknown skeleton field {sorted(unknown)[0]!r}")
        dataset = _names(spec.get("keypoints") or [], "keypoints", source)
        if not dataset:
            _fail(source, "the skeleton has no keypoints")
        derived_spec = spec.get("derived") or {}
        if not isinstance(derived_spec, dict):
            _fail(source, "derived must map a new keypoint to the [keypoint, keypoint] it is the middle of")
        extra = [n for n in derived_spec if n not in dataset]
        if len(extra) != len(derived_spec):
            _fail(source, f"derived keypoint {next(n for n in derived_spec if n in dataset)!r} is "
                  "already a keypoint of the annotations")
        names = _names(spec.get("channels") or dataset + extra, "channels", source)
        if sorted(names) != sorted(dataset + extra):
            _fail(source, "channels must list every keypoint and derived keypoint once "
                  f"({', '.join(map(repr, dataset + extra))})")
        index = {name: k for k, name in enumerate(names)}
        for n in extra:
            parts = derived_spec[n] if isinstance(derived_spec[n], (list, tuple)) else []
            if (outside := next((p for p in parts if p in index and p not in dataset), None)) is not None:
                _fail(source, f"derived {n}: {list(parts)} uses {outside!r}, which is not a keypoint of the "
                      "annotations (a derived keypoint is the middle of two annotated ones)")
        derived = tuple((index[n], *_pairs([derived_spec[n]], f"derived {n}", index, source)[0])
                        for n in extra)
        main = _pairs(spec.get("limbs"), "limbs", index, source)
        limbs = main + _pairs(spec.get("redundant"), "redundant", index, source)
        if not main:
            _fail(source, "the skeleton has no limbs (give limbs: [[keypoint, keypoint], ...])")
        if twice := next((p for k, p in enumerate(limbs) if either_way_in(p, limbs[:k])), None):
            _fail(source, f"limb {[names[i] for i in twice]} is listed twice")
        reached = {0} | {b for _, b in limb_walk(len(names), limbs)}
        if lost := [name for k, name in enumerate(names) if k not in reached]:
            _fail(source, f"keypoint {lost[0]!r} is unreachable: no chain of limbs joins it to "
                  f"{names[0]!r}, so the grouping could never put it in a person (add a limb)")
        flip = name_flips(names) if spec.get("flip") is None else list(range(len(names)))  # none: the names
        for a, b in _pairs(spec.get("flip"), "flip", index, source):
            for k, other in ((a, b), (b, a)):
                if flip[k] not in (k, other):
                    _fail(source, f"flip pairs are not symmetric: {names[k]!r} pairs with both "
                          f"{names[flip[k]]!r} and {names[other]!r}")
                flip[k] = other
        for a, b in limbs:
            if (flip[a], flip[b]) not in limbs and (flip[b], flip[a]) not in limbs:
                _fail(source, f"limb {[names[a], names[b]]} has no mirror limb "
                      f"{[names[flip[a]], names[flip[b]]]} (add it, or fix the flip pairs)")
        sigmas = spec.get("sigmas", DEFAULT_SIGMA)
        sigmas = [sigmas] * len(dataset) if isinstance(sigmas, (int, float)) else sigmas
        if not isinstance(sigmas, (list, tuple)) or len(sigmas) != len(dataset):
            _fail(source, f"sigmas must be one number or {len(dataset)} of them (one per keypoint)")
        for name, sigma in zip(dataset, sigmas):       # COCO's: 0.025 to 0.107
            if problem := out_of_bounds(sigma, FILE_FIELDS["skeleton.sigmas"]):
                _fail(source, f"sigmas: {name}'s {sigma!r} {problem}")
        return cls(name=str(spec.get("name") or "custom"), keypoints=tuple(names), limbs=tuple(limbs),
                   main_limbs=len(main), flip=tuple(flip), dataset_keypoints=tuple(dataset),
                   sigmas=tuple(float(s) for s in sigmas), derived=derived,
                   scoring=parse_scoring(spec, dataset, source))


def skeleton_words(skeleton: Skeleton, other: Skeleton) -> str:
    """`skeleton` in a few words that tell it from `other` (errors naming two: a checkpoint's, the data's)."""
    words = f"{skeleton.name}, {skeleton.num_keypoints} keypoints, {skeleton.num_channels} channels"
    if words != f"{other.name}, {other.num_keypoints} keypoints, {other.num_channels} channels":
        return words
    names = skeleton.keypoints
    if skeleton.keypoints != other.keypoints:
        k = next(k for k, (a, b) in enumerate(zip(skeleton.keypoints, other.keypoints)) if a != b)
        return f"{words}, keypoint {k} {names[k]!r}"
    if changes := limb_changes(skeleton, other):
        return f"{words}, {changes}"
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


def _fail(source: str, problem: str):
    raise ConfigError(f"{source}: {problem}")


def _names(value, what: str, source: str) -> list:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        _fail(source, f"{what} must be a list of keypoint names")
    if (twice := next((name for k, name in enumerate(value) if name in value[:k]), None)) is not None:
        _fail(source, f"keypoint {twice!r} is listed twice in {what}")
    return list(value)


def _pairs(value, what: str, index: dict, source: str) -> list:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        _fail(source, f"{what} must be a list of [keypoint, keypoint] pairs")
    out = []
    for pair in value:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            _fail(source, f"{what}: {pair!r} is not a [keypoint, keypoint] pair")
        if any(isinstance(name, int) for name in pair):     # no base (0 or 1) is guessed: names only
            _fail(source, f"{what}: {list(pair)} gives keypoint numbers; a skeleton file names the "
                  f"keypoints, e.g. {list(index)[:2]}")
        if (name := next((n for n in pair if n not in index), None)) is not None:
            _fail(source, f"{what}: {list(pair)} names {name!r}, which is not a keypoint "
                  f"(keypoints: {', '.join(map(repr, index))})")
        if pair[0] == pair[1]:
            _fail(source, f"{what}: {list(pair)} joins {pair[0]!r} to itself")
        out.append((index[pair[0]], index[pair[1]]))
    return out


def either_way_in(pair, pairs) -> bool:          # the limb a-b is the limb b-a
    return pair in pairs or pair[::-1] in pairs


def limb_walk(count: int, limbs, start: int = 0) -> list:
    """(from, to) of each limb a breadth-first walk over `count` keypoints takes from `start`."""
    ends: dict = {k: [] for k in range(count)}
    for a, b in limbs:
        ends[a].append(b)
        ends[b].append(a)
    walked, reached, order = [], {start}, [start]
    for here in order:                   # breadth first: `order` grows while it is walked
        for other in ends[here]:
            if other not in reached:
                reached.add(other)
                order.append(other)
                walked.append((here, other))
    return walked


# -- where skeletons come from ---------------------------------------------------------------------
def builtin_names() -> list:
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.yaml"))


@cache
def builtin(name: str) -> Skeleton:
    """The built-in skeleton `name` (data/skeletons/NAME.yaml), read once."""
    path = BUILTIN_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"unknown skeleton {name!r}: choose one of "
                          f"{', '.join(builtin_names())} or give a path to a YAML file")
    return Skeleton.from_spec(read_yaml(path, str(path)), str(path))


def load_skeleton(name_or_path: str, option: str = "--skeleton") -> Skeleton:
    """A built-in by name, or a skeleton YAML file."""
    path = Path(name_or_path)
    if not name_or_path.endswith((".yaml", ".yml")) and "/" not in name_or_path:
        return builtin(name_or_path)
    if not path.is_file():
        raise ConfigError(f"{option} {path}: no such skeleton file")
    return Skeleton.from_spec(read_yaml(path, f"{option} {path}"), f"{option} {path}")


def from_checkpoint(state) -> Skeleton:
    """The skeleton a checkpoint (or its loaded dict) was trained on; COCO when it names none."""
    spec = state.get("skeleton") if isinstance(state, dict) else None
    return Skeleton.from_spec(spec, "the checkpoint's skeleton") if spec else builtin("coco")
