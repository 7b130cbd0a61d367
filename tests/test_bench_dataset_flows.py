"""bench/dataset_flows.py for one dataset: its table row and JSON say what each step of the flow
gave (convert, dump and give back the skeleton, train, score, demo), and a step that fails is said
in its row, not left out."""
from __future__ import annotations

import json
import shutil

import pytest

from bench import dataset_flows


def run(capsys, *argv) -> tuple[int, list, dict]:
    code = dataset_flows.main(list(argv))
    lines = capsys.readouterr().out.strip().splitlines()
    return code, lines[:-1], json.loads(lines[-1])


@pytest.mark.slow
def test_zebras_flow_is_one_row_scored_with_pck(capsys):
    code, table, result = run(capsys, "--only", "zebra", "--steps", "1")
    assert code == 0 and len(table) == 3 and result["steps"] == 1
    row, = result["rows"]
    assert {k: row[k] for k in ("dataset", "skeleton", "keypoints", "pictures", "dump_same", "steps",
                                "demo_ok")} == {"dataset": "Zebra", "skeleton": "zebra", "keypoints": 9,
                                                "pictures": [3, 1], "dump_same": True, "steps": 1,
                                                "demo_ok": True}
    assert row["loss"] > 0 and "failed" not in row
    assert row["oracle"]["PCK"] == 1.0 and row["oracle"]["EPE"] == 0.0
    assert list(row["network"]) == ["PCK", "AUC", "EPE"] and 0 <= row["network"]["PCK"] <= 1
    assert table[2].startswith("| Zebra | zebra | 9 | 3/1 | True | ") and " (1) | PCK 1.000 AUC " in table[2]


def test_a_step_that_fails_is_said_in_its_row(capsys, coco4_dir, tmp_path, monkeypatch):
    shutil.copy(coco4_dir / "test_coco.json", tmp_path)            # the JSON without its pictures
    monkeypatch.setattr(dataset_flows, "COCO4", tmp_path)
    code, table, result = run(capsys, "--only", "mhp")
    row, = result["rows"]
    assert code == 1 and "loss" not in row
    assert row["failed"].startswith("convert train: error: ") and "is missing" in row["failed"]
    assert table[2].startswith("| MHP | mhp |  |") and "FAILED convert train: error: " in table[2]


def test_a_keep_folder_that_exists_is_refused(capsys, tmp_path):
    with pytest.raises(SystemExit) as stop:
        dataset_flows.main(["--keep", str(tmp_path)])
    said = capsys.readouterr().err
    assert stop.value.code == 2 and said.startswith(f"error: argument --keep: {tmp_path} exists")
