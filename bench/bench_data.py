"""The benchmarks' training file: coco4 (`--coco-dir`, `$SIMPLEPOSE_COCO4`, else tests/data/coco4),
each image listed `repeat` times so that a loader has whole batches and epochs; without coco4,
640x640 synthetic images (faster to decode: the rate is then an upper bound).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from data.make_hdf5 import convert

ROOT = Path(__file__).resolve().parents[1]
COCO4_ANN = "test_coco.json"


def find_coco4(coco_dir: str | None = None) -> Path | None:
    for candidate in (coco_dir, os.environ.get("SIMPLEPOSE_COCO4"),
                      ROOT / "tests" / "data" / "coco4"):
        if candidate and (Path(candidate) / COCO4_ANN).is_file():
            return Path(candidate)
    return None


def repeat_annotations(ann_path: Path, repeat: int, out_path: Path, images_dir: Path) -> Path:
    """A copy of a COCO annotation file with each image (and its people) listed `repeat` times,
    each copy a picture file of its own in `images_dir` (a link to the original): the converter
    refuses one file listed under two ids."""
    coco = json.loads(Path(ann_path).read_text())
    images_dir.mkdir(parents=True, exist_ok=True)
    images, annotations = [], []
    for copy in range(repeat):
        offset = copy * 10 ** 9
        for image in coco["images"]:
            name = f"copy{copy}_{image['file_name']}"
            (images_dir / name).symlink_to((Path(ann_path).parent / image["file_name"]).resolve())
            images.append({**image, "id": image["id"] + offset, "file_name": name})
        annotations += [{**ann, "id": ann["id"] + offset, "image_id": ann["image_id"] + offset}
                        for ann in coco["annotations"]]
    out_path.write_text(json.dumps({**coco, "images": images, "annotations": annotations}))
    return out_path


def make_bench_h5(work: Path, repeat: int = 1, coco_dir: str | None = None) -> tuple[Path, str]:
    """(HDF5 path, a name for what it holds) of a training file under `work`."""
    out = work / "bench.h5"
    coco4 = find_coco4(coco_dir)
    if coco4 is not None:
        ann = repeat_annotations(coco4 / COCO4_ANN, repeat, work / "bench.json", work / "bench_images")
        convert(ann, work / "bench_images", out, split="train", progress=False)
        return out, f"coco4 x{repeat}"
    from data.synthetic import write_split
    ann = write_split(work, "train", 8 * repeat, 640, seed=0)
    convert(ann, work / "train", out, split="train", progress=False)
    return out, f"synthetic 640 px x{8 * repeat}"
