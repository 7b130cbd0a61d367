"""Reading a COCO keypoint JSON as published datasets ship it: the categories, keypoint names and
skeleton to convert, and what passes `data.coco_checks`; each decision is a line of the report."""
from __future__ import annotations

import json
import re
from pathlib import Path, PurePosixPath

import numpy as np

from common.errors import DataError, os_reason, refuse_inapplicable
from data.skeleton import Skeleton, limb_changes
from data.skeleton_infer import (fit_to_labels, infer_skeleton, keypoint_names, listed, matching_builtin,
                                 plain_name)
from data.coco_checks import Selection, select_valid

SHOWN_CATEGORIES = 6
WHOLEBODY_PARTS = ("foot_kpts", "face_kpts", "lefthand_kpts", "righthand_kpts")   # in its order


def _keypoint_categories(data: dict, ann_path: Path, wanted: list | None, said: list) -> list:
    """The categories to convert as one: `wanted`, else `person`, else those listing keypoints."""
    categories = [c for c in data["categories"] if isinstance(c, dict)]
    if wanted:
        chosen = []
        for item in wanted:
            if not (found := [c for c in categories if str(c.get("id")) == item or c.get("name") == item]):
                known = ", ".join(f"{c.get('name')} ({c.get('id')})" for c in categories[:SHOWN_CATEGORIES])
                raise DataError(f"--categories {item!r}: no category of {ann_path} has this name or id "
                                f"(categories: {known})")
            chosen.extend(c for c in found if c not in chosen)
    else:
        chosen = [c for c in categories if c.get("name") == "person"][:1]
        if not chosen:
            chosen = [c for c in categories if c.get("keypoints")]
            left = [f"{c.get('name')} ({c.get('id')})" for c in categories if not c.get("keypoints")]
            if chosen and left:
                said.append(f"left out {len(left)} categories that name no keypoints: "
                            f"{listed(left, SHOWN_CATEGORIES)} (--categories NAME_OR_ID,... converts them)")
        if not chosen:
            raise DataError(f"{ann_path}: no 'person' category among the categories, and none lists "
                            "keypoints (choose with --categories NAME_OR_ID,...)")
    if len({tuple(c.get("keypoints") or ()) for c in chosen}) > 1:
        names = ", ".join(f"{c.get('name')} ({len(c.get('keypoints') or ())} keypoints)"
                          for c in chosen[:SHOWN_CATEGORIES])
        raise DataError(f"{ann_path}: the categories {names} list different keypoints; convert one "
                        "kind at a time with --categories NAME_OR_ID,...")
    return chosen


def _name_lines(names: list, skeleton: Skeleton, category: dict, ann_path: Path) -> list:
    """Lines for the JSON's keypoint names that `skeleton` names otherwise; or `DataError`."""
    given, common = skeleton.dataset_keypoints, min(len(names), len(skeleton.dataset_keypoints))
    plain = [plain_name(n) for n in names]
    differ = [k for k in range(common) if names[k] != given[k]]
    renamed = [k for k in differ if plain[k] != plain_name(given[k])]
    if (moved := [k for k in renamed if plain_name(given[k]) in plain]) or 2 * len(renamed) > common:
        shown = "; ".join(f"keypoint {k} is {names[k]!r} there, {given[k]!r} in the skeleton"
                          for k in (moved or renamed)[:3])
        raise DataError(f"{ann_path}: the {category.get('name')!r} category's keypoints are not those "
                        f"of skeleton {skeleton.name} in the same order ({len(renamed)} of {common} "
                        f"differ: {shown})")
    spelled = [k for k in differ if k not in renamed]
    lines = ["keypoints renamed by --skeleton, taken by position: ", f"{len(spelled)} keypoint names "
             "spelled otherwise in the JSON, matched: "]
    return [line + listed((f"{names[k]!r} is {given[k]!r}" for k in ks), 3)
            for line, ks in zip(lines, (renamed, spelled)) if ks]


def choose_skeleton(category: dict, names: list, points: np.ndarray, ann_path: Path,
                    skeleton: Skeleton | None, links_from: int | None = None) -> tuple[Skeleton, str]:
    """(the file's skeleton, lines saying where it came from): `skeleton`, else the built-in the
    keypoints name, else one inferred; fitted to the labels (`fit_to_labels`)."""
    known = matching_builtin(names) if skeleton is None else None
    fixed = skeleton if skeleton is not None else known
    if fixed is not None or not category.get("skeleton"):
        refuse_inapplicable({"--links-from": links_from}, "here", "the JSON's category lists no links "
                            "(categories[].skeleton)" if fixed is None else f"the skeleton is "
                            f"{'--skeleton' if skeleton is not None else 'built-in'} {fixed.name}, so the "
                            "JSON's links (categories[].skeleton) are not read")
    if skeleton is not None:
        lines = _name_lines(names, skeleton, category, ann_path)
        if (known := matching_builtin(skeleton.dataset_keypoints)) is not None and known != skeleton:
            lines.append(f"--skeleton differs from built-in {known.name}: "
                         f"{limb_changes(skeleton, known) or 'in flips, sigmas or channel order'}")
        return skeleton, "\n".join([f"{skeleton.describe()} (given by --skeleton)", *lines])
    if known is not None:
        chosen, report = known, [f"the keypoints are {known.name}'s {len(names)}: built-in skeleton "
                                 f"{known.name}", *_name_lines(names, known, category, ann_path)]
    else:
        chosen, report = infer_skeleton(category, names, points, str(ann_path), links_from)
    fitted, said = fit_to_labels(chosen, points, str(ann_path))      # links the data can use
    return fitted, "\n".join(dict.fromkeys(report + said))


def _layouts(ann: dict) -> dict:
    """{fields: keypoints they hold} of the ways an annotation gives its keypoints."""
    def size(field) -> int:
        value = ann.get(field)
        return len(value) // 3 if isinstance(value, list) else 0
    out = {("keypoints",): size("keypoints")}
    if parts := tuple(p for p in WHOLEBODY_PARTS if p in ann):
        out[("keypoints", *parts)] = sum(size(f) for f in ("keypoints", *parts))
    out.update({(key,): size(key) for key in ann if re.fullmatch(r"keypoints_\d+", key)})
    return out


def _read_keypoints(own: list, names: list, skeleton: Skeleton | None, ann_path: Path) -> tuple[int, list]:
    """Read each annotation's keypoints from the fields that hold `skeleton`'s count (None: the
    most), into `keypoints`; (how many, a line on a choice), or `DataError`."""
    wanted = skeleton and len(skeleton.dataset_keypoints)
    sample = next((a for a in own if not a.get("iscrowd") and isinstance(a.get("keypoints"), list)), None)
    layouts = _layouts(sample) if sample else {("keypoints",): wanted or len(names)}
    fields = (max(layouts, key=layouts.get) if wanted is None
              else next((f for f, n in layouts.items() if n == wanted), None))
    if fields is None:
        held = ", ".join(f"{'+'.join(f)} {n}" for f, n in layouts.items())
        raise DataError(f"{ann_path}: skeleton {skeleton.name} has {wanted} keypoints, but no field of "
                        f"the annotations holds as many ({held})")
    fractional, sizes = 0, {f: len(sample[f]) for f in fields} if sample else {}
    for ann in own if fields != ("keypoints",) else []:
        if all(isinstance(ann.get(f), list) for f in fields):
            short = next((f for f in fields if len(ann[f]) != sizes[f]), None)
            if short:         # what the length check of its keypoints says (coco_checks)
                ann["field_problem"] = (f"{short} has {len(ann[short])} values, not {sizes[short]} "
                                        f"({sizes[short] // 3} keypoints as in the other annotations)")
            values = [v for f in fields for v in ann[f]]
            for i in range(2, len(values), 3):       # COCO-WholeBody: a v > 0 that is not 1 or 2
                if isinstance(values[i], float) and values[i] > 0 and values[i] not in (1, 2):
                    values[i], fractional = 1, fractional + 1
            ann["keypoints"] = values
            ann["num_keypoints"] = sum(1 for v in values[2::3] if isinstance(v, (int, float)) and v > 0)
        elif ann.get("iscrowd"):      # a crowd region without them: none
            ann.pop("keypoints", None)
    count = layouts[fields] if wanted else max(layouts[fields], len(names))
    others = {f: f"{'+'.join(f)} ({n}: {_reader(names, n)})" for f, n in layouts.items() if f != fields and n}
    if not others and fields == ("keypoints",):
        return count, []
    line = f"keypoints read from {' + '.join(fields)}: {layouts[fields]} per person"
    if fractional:
        line += f"; {fractional} fractional visibilities (labelled, in COCO-WholeBody) read as 1"
    within = [said for f, said in others.items() if set(f) < set(fields)]     # read, as part of `fields`
    unread = [said for f, said in others.items() if not set(f) < set(fields)]
    return count, [line + "".join(f"; {said.replace(' (', ' alone (', 1)}" for said in within)
                   + (f"; not read: {', '.join(unread)}" if unread else "")]


def _reader(names: list, count: int) -> str:
    known = matching_builtin(names[:count], count)
    return f"--skeleton {known.name} reads them" if known else f"a --skeleton of {count} keypoints reads them"


def _strip_prefix(images: list, images_dir: Path) -> list:
    """Drop leading folders of every file_name that `images_dir` lacks; a line saying so."""
    if not images or (images_dir / images[0]["file_name"]).exists():
        return []
    parts = PurePosixPath(images[0]["file_name"].replace("\\", "/")).parts
    for k in range(1, len(parts)):
        if (images_dir / PurePosixPath(*parts[k:])).is_file():
            cut = [PurePosixPath(i["file_name"].replace("\\", "/")).parts for i in images]
            if any(p[:k] != parts[:k] or len(p) <= k for p in cut):
                return []
            for info, p in zip(images, cut):
                info["file_name"] = str(PurePosixPath(*p[k:]))
            return [f"file names start with '{PurePosixPath(*parts[:k])}/', which --images {images_dir} "
                    "lacks: read without it"]
    return []


def _read_json(ann_path: Path) -> dict:
    try:
        data = json.loads(Path(ann_path).read_text())
    except FileNotFoundError:
        raise DataError(f"{ann_path}: no such annotation file") from None
    except IsADirectoryError:
        raise DataError(f"{ann_path}: a folder; --ann takes the COCO JSON file") from None
    except OSError as exc:
        raise DataError(f"{ann_path}: cannot be read ({os_reason(exc)})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"{ann_path}: malformed JSON ({exc})") from None
    if not isinstance(data, dict) or not all(k in data for k in ("images", "annotations", "categories")):
        raise DataError(f"{ann_path}: not a COCO annotation file (needs images, annotations, categories)")
    for key in ("categories", "images", "annotations"):
        if not isinstance(data[key], list):
            raise DataError(f"{ann_path}: '{key}' is a {type(data[key]).__name__}, not a list")
    return data


def load_coco(ann_path: Path, images_dir: Path, skip_bad: bool = False,
              skeleton: Skeleton | None = None, categories: list | None = None,
              links_from: int | None = None) -> tuple[dict, Selection, Skeleton, str]:
    """(keypoint category, the images and annotations that pass `data.coco_checks`, skeleton, what
    was decided) or `DataError`; `skeleton` None: `choose_skeleton` decides."""
    data = _read_json(ann_path)
    said: list = []
    chosen = _keypoint_categories(data, ann_path, categories, said)
    category = dict(chosen[0])
    ids = {c.get("id") for c in chosen}
    own = [a for a in data["annotations"] if isinstance(a, dict) and a.get("category_id") in ids]
    if skeleton is not None and not category.get("keypoints"):
        names = list(skeleton.dataset_keypoints)
    else:
        names, lines = keypoint_names(category, own, str(ann_path))
        said.extend(lines)
    count, lines = _read_keypoints(own, names, skeleton, ann_path)
    said.extend(lines)
    if skeleton is None and count > len(names):      # COCO-WholeBody: names for its parts
        known = matching_builtin(names, count)
        names += (list(known.dataset_keypoints[len(names):]) if known
                  else [f"keypoint_{k + 1}" for k in range(len(names), count)])
    if len(chosen) > 1:
        said.append(f"{len(chosen)} categories with the same {len(names)} keypoints converted as one "
                    f"({listed((c.get('name') for c in chosen), SHOWN_CATEGORIES)}), as category "
                    f"{category.get('name')!r}")
    selection = select_valid(data, [c.get("id") for c in chosen], images_dir, skip_bad, ann_path, count)
    said.extend(_strip_prefix(selection.images, images_dir))
    points = np.array([a["keypoints"] for anns in selection.by_image.values() for a in anns
                       if a["num_keypoints"] > 0], np.float32).reshape(-1, count, 3)
    skeleton, origin = choose_skeleton(category, names, points, ann_path, skeleton, links_from)
    category["keypoints"] = list(skeleton.dataset_keypoints)
    said.extend(f"{reason} ({times} annotations)" for reason, times in sorted(selection.repairs.items()))
    return category, selection, skeleton, "\n".join([origin, *said])
