"""The whole flow for every built-in skeleton, on a small stand-in of its dataset as shipped.

    python bench/dataset_flows.py [--only coco zebra ...] [--steps 3] [--keep DIR] [--device cpu]
"""
from __future__ import annotations

import contextlib
import io
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
COCO4 = ROOT / "tests" / "data" / "coco4"

import torch  # noqa: E402
import yaml  # noqa: E402

import demo  # noqa: E402
from bench.helpers import markdown_table  # noqa: E402
import evaluate  # noqa: E402
import train  # noqa: E402
from common.errors import ArgumentParser  # noqa: E402
from data.h5format import KeypointH5  # noqa: E402
from data.make_hdf5 import main as make_hdf5  # noqa: E402
from data.skeleton import METRIC_KEYS, Skeleton, builtin_names  # noqa: E402
from data.synthetic import write_dataset  # noqa: E402
from shipped_layouts import AS_SHIPPED, as_shipped, pictures, shipped, wholebody  # noqa: E402

MADE = {"wholebody133": "COCO-WholeBody", "halpe26": "coco4 as halpe26", "quadruped": "data.synthetic"}


def dataset_of(name: str) -> str:
    """The stand-in's label: the first AS_SHIPPED dataset of built-in `name`, else how it is made."""
    return next((d for d, (known, _) in AS_SHIPPED.items() if known == name), None) or MADE[name]


def stand_in(name: str, folder: Path) -> dict:
    """{split: (JSON, its pictures' folder)} of built-in `name`'s stand-in, written under `folder`."""
    if name == "quadruped":
        drawn = write_dataset(folder, 6, 1, skeleton=name)
        return {split: (ann, folder / split) for split, ann in drawn.items()}
    dataset = dataset_of(name)

    def change(images):
        if name != "wholebody133":
            return as_shipped(dataset if dataset in AS_SHIPPED else name, images)
        return lambda data: (pictures(data, images), wholebody(data))
    return {split: (shipped(COCO4, folder, change(images), f"{split}.json"), COCO4)
            for split, images in (("train", slice(0, 3)), ("val", slice(3, 4)))}


def quietly(step: str, command, argv: list) -> str:
    """`command(argv)`'s standard output; RuntimeError naming `step` and its last error line if it fails."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = command(argv)
        except SystemExit as stop:              # a command line the command refused
            code = stop.code
    if code not in (0, None) and not isinstance(code, dict):
        last = (err.getvalue().strip().splitlines() or ["exit code " + str(code)])[-1]
        raise RuntimeError(f"{step}: {last}")
    return out.getvalue()


def scored(argv: list, scoring) -> dict:
    stats = json.loads(quietly("evaluate", evaluate.main, [*argv, "--no-progress"]).strip().splitlines()[-1])
    return {METRIC_KEYS[m]: stats[METRIC_KEYS[m]] for m in scoring.metrics}


def flow(name: str, folder: Path, steps: int, device: str) -> dict:
    """One built-in's row: each step in turn; the first that fails ends it, said in `failed`."""
    start, row = time.perf_counter(), {"dataset": dataset_of(name), "skeleton": name}
    try:
        splits = stand_in(name, folder)
        h5 = {split: folder / f"{split}.h5" for split in splits}
        dumped = folder / "dumped.yaml"
        for split, given in (("train", "--dump-skeleton"), ("val", "--skeleton")):
            ann, images = splits[split]
            argv = ["--ann", ann, "--images", images, "--split", split, "--out", h5[split], given, dumped]
            quietly(f"convert {split}", make_hdf5, [*map(str, argv), "--quiet"])
        files = {split: KeypointH5(path) for split, path in h5.items()}
        skeleton = files["train"].skeleton
        row.update(keypoints=len(skeleton.dataset_keypoints),
                   pictures=[files["train"].num_images, files["val"].num_images])
        again = Skeleton.from_spec(yaml.safe_load(dumped.read_text()), str(dumped))
        row["dump_same"] = all(s == skeleton and s.scoring == skeleton.scoring
                               for s in (again, files["val"].skeleton))
        quietly("train", train.main, ["--train-h5", str(h5["train"]), "--val-h5", str(h5["val"]), "--config",
                                      "tiny", "--out-dir", str(folder), "--run-name", "run", "--epochs", "1",
                                      "--batch-size", "2", "--ap-every", "0", "--device", device, "--set",
                                      f"train.max_steps_per_epoch={steps}", "--set", "data.workers=0",
                                      "--set", "train.tensorboard=false"])
        losses = [json.loads(line)["loss"] for line in (folder / "run" / "train_steps.jsonl").open()]
        row.update(steps=len(losses), loss=round(losses[-1], 5))
        weights = folder / "run" / "last.pth"
        row["oracle"] = scored(["--oracle", "--h5", str(h5["val"]), "--out", str(folder / "oracle.json")],
                               skeleton.scoring)
        row["network"] = scored(["--weights", str(weights), "--h5", str(h5["val"]), "--device", device,
                                 "--out", str(folder / "network.json")], skeleton.scoring)
        ann, images = splits["val"]
        picture = images / json.loads(ann.read_text())["images"][0]["file_name"]
        quietly("demo", demo.main, ["--weights", str(weights), "--image", str(picture), "--out",
                                    str(folder / "demo.png"), "--device", device])
        row["demo_ok"] = (folder / "demo.png").stat().st_size > 0
    except Exception as error:                  # the row says which step failed and why
        row["failed"] = str(error) if isinstance(error, RuntimeError) else f"{type(error).__name__}: {error}"
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def metrics(values) -> str:
    """`AP 0.512`, `PCK 1.000 AUC 0.950 EPE 0.000`; nothing to score (None: no point found) is n/a."""
    return " ".join(f"{k} n/a" if v is None else f"{k} {v:.3f}" for k, v in (values or {}).items())


def table(rows: list) -> str:
    head = ["dataset", "skeleton", "kp", "train/val pics", "dump same", "loss (steps)", "oracle", "network",
            "demo", "s"]
    cells = [[r["dataset"], r["skeleton"], r.get("keypoints", ""), "/".join(map(str, r.get("pictures", []))),
              r.get("dump_same", ""), f"{r['loss']:.4f} ({r['steps']})" if "loss" in r else "",
              metrics(r.get("oracle")), metrics(r.get("network")), r.get("demo_ok", ""),
              f"{r['seconds']:.0f}"] for r in rows]
    lines = markdown_table(head, cells).splitlines()
    return "\n".join(lines[:2] + [line + (f" FAILED {r['failed']}" if "failed" in r else "")
                                   for line, r in zip(lines[2:], rows)])


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="+", choices=builtin_names(), help="these built-ins (default: all)")
    p.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--keep", help="a new folder to keep each flow's files in (default: a temporary one)")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"argument --steps: {args.steps} is not a number of steps (1 or more)")
    if args.keep and Path(args.keep).exists():
        p.error(f"argument --keep: {args.keep} exists; give a new folder")
    with tempfile.TemporaryDirectory() as temp:
        base = Path(args.keep or temp)
        base.mkdir(parents=True, exist_ok=True)
        rows = []
        for name in args.only or builtin_names():
            (base / name).mkdir()
            rows.append(flow(name, base / name, args.steps, args.device))
            print(f"{name}: {rows[-1].get('failed', 'done')} ({rows[-1]['seconds']} s)", file=sys.stderr)
    print(table(rows))
    print(json.dumps({"torch": torch.__version__, "device": args.device, "steps": args.steps, "rows": rows}))
    return 1 if any("failed" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
