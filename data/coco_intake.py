"""Reading a COCO keypoint JSON as published datasets ship it: which categories to convert, their
keypoint names, the skeleton (given, built-in or inferred), and the images and annotations that pass
`data.coco_checks`. Every decision is one line of the report `load_coco` returns; bad input is a
`DataError` naming the file.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from common.errors import DataError
from data.skeleton import Skeleton
from data.skeleton_infer import fit_to_labels, infer_skeleton, keypoint_names, matching_builtin
from data.coco_checks import Selection, select_valid

SHOWN_CATEGORIES = 6


def _keypoint_categories(data: dict, ann_path: Path, wanted: list | None) -> list:
    """The categories to convert, as one: `wanted` (names or ids, from --categories), else
    `person`, else those that list keypoints when they all list the same ones."""
    categories = [c for c in data["categories"] if isinstance(c, dict)]
    if wanted:
        chosen = []
        for item in wanted:
            found = [c for c in categories if str(c.get("id")) == item or c.get("name") == item]
            if not found:
                known = ", ".join(f"{c.get('name')} ({c.get('id')})" for c in categories[:SHOWN_CATEGORIES])
                raise DataError(f"--categories {item!r}: no category of {ann_path} has this name or id "
                                f"(categories: {known})")
            chosen.extend(c for c in found if c not in chosen)
    else:
        chosen = [c for c in categories if c.get("name") == "person"][:1]
        if not chosen:
            chosen = [c for c in categories if c.get("keypoints")]
        if not chosen:
            raise DataError(f"{ann_path}: no 'person' category among the categories, and none lists "
                            "keypoints (choose with --categories NAME_OR_ID,...)")
    lists = {tuple(c.get("keypoints") or ()) for c in chosen}
    if len(lists) > 1:
        names = ", ".join(f"{c.get('name')} ({len(c.get('keypoints') or ())} keypoints)"
                          for c in chosen[:SHOWN_CATEGORIES])
        raise DataError(f"{ann_path}: the categories {names} list different keypoints; convert one "
                        "kind at a time with --categories NAME_OR_ID,...")
    return chosen



def choose_skeleton(category: dict, names: list, points: np.ndarray, ann_path: Path,
                    skeleton: Skeleton | None) -> tuple[Skeleton, str]:
    """(the skeleton of the file, lines saying where it came from) or `DataError`: `skeleton` as
    given, else the built-in the keypoints name or one inferred, with links added where the
    keypoints `points` label reach each other only through keypoints never labelled."""
    if skeleton is not None:
        if tuple(names) != skeleton.dataset_keypoints:
            raise DataError(f"{ann_path}: the {category.get('name')!r} category's keypoints "
                            f"({', '.join(names[:4])}, ...: {len(names)}) are not those of skeleton "
                            f"{skeleton.name} ({', '.join(skeleton.dataset_keypoints[:4])}, ...: "
                            f"{len(skeleton.dataset_keypoints)}), in the same order")
        return skeleton, f"{skeleton.describe()} (given by --skeleton)"
    known = matching_builtin(names)
    if known is not None:
        chosen = known
        report = [f"the keypoints are {known.name}'s {len(names)}: built-in skeleton {known.name}"]
    else:
        chosen, report = infer_skeleton(category, names, points, str(ann_path))
    fitted, said = fit_to_labels(chosen, points, str(ann_path))      # links the data can use
    return fitted, "\n".join(dict.fromkeys(report + said))


def _read_json(ann_path: Path) -> dict:
    try:
        data = json.loads(Path(ann_path).read_text())
    except FileNotFoundError:
        raise DataError(f"{ann_path}: no such annotation file") from None
    except IsADirectoryError:
        raise DataError(f"{ann_path}: a folder; --ann takes the COCO JSON file") from None
    except OSError as exc:
        raise DataError(f"{ann_path}: cannot be read ({exc.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"{ann_path}: malformed JSON ({exc})") from None
    if not isinstance(data, dict) or not all(k in data for k in ("images", "annotations", "categories")):
        raise DataError(f"{ann_path}: not a COCO annotation file (needs images, annotations, categories)")
    if not isinstance(data["categories"], list):
        raise DataError(f"{ann_path}: 'categories' is a {type(data['categories']).__name__}, not a list")
    return data


def load_coco(ann_path: Path, images_dir: Path, skip_bad: bool = False,
              skeleton: Skeleton | None = None, categories: list | None = None
              ) -> tuple[dict, Selection, Skeleton, str]:
    """(keypoint category, the images and annotations that pass every check of `data.coco_checks`,
    skeleton, what was decided: one line each) or `DataError`; with `skip_bad` the selection lists
    what was left out; `skeleton` None: the built-in the category names, or one inferred from it;
    `categories` (names or ids): the categories to convert as one (default: see
    `_keypoint_categories`)."""
    data = _read_json(ann_path)
    chosen = _keypoint_categories(data, ann_path, categories)
    category = dict(chosen[0])
    ids = {c.get("id") for c in chosen}
    own = [a for a in data["annotations"] if isinstance(a, dict) and a.get("category_id") in ids] \
        if isinstance(data["annotations"], list) else []
    if skeleton is not None and not category.get("keypoints"):
        names, said = list(skeleton.dataset_keypoints), []
    else:
        names, said = keypoint_names(category, own, str(ann_path))
    category["keypoints"] = names
    if len(chosen) > 1:
        said.append(f"{len(chosen)} categories with the same {len(names)} keypoints converted as one "
                    f"({', '.join(str(c.get('name')) for c in chosen[:SHOWN_CATEGORIES])}"
                    f"{', ...' if len(chosen) > SHOWN_CATEGORIES else ''}), as category "
                    f"{category.get('name')!r}")
    selection = select_valid(data, [c.get("id") for c in chosen], images_dir, skip_bad, ann_path,
                             DataError, len(names))
    points = [np.asarray(a["keypoints"], np.float32).reshape(-1, 3)
              for anns in selection.by_image.values() for a in anns if a["num_keypoints"] > 0]
    points = np.stack(points) if points else np.zeros((0, len(names), 3), np.float32)
    skeleton, origin = choose_skeleton(category, names, points, ann_path, skeleton)
    said.extend(f"{reason} ({count} annotations)" for reason, count in sorted(selection.repairs.items()))
    return category, selection, skeleton, "\n".join([origin, *said])
