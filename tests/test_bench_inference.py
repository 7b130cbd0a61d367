"""bench/inference.py on the CPU: its tables and JSON line, grouping on ground-truth maps that hold
the coco4 people, and the split of a picture's time by stage. Timings are not asserted (benchmarks report them)."""
from __future__ import annotations

import json

import pytest

from bench import inference as bench_inference


@pytest.mark.slow
def test_rows_per_batch_size_with_shares(capsys):
    assert bench_inference.main(["--preset", "tiny", "--repeat", "1", "--batch-sizes", "1", "4",
                                 "--scales", "0.5", "--device", "cpu", "--threads", "1", "2",
                                 "--rounds", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    assert [row["batch_size"] for row in result["rows"]] == [1, 4] and result["pictures"] == 4
    assert result["grouping_maps"] == "truth" and result["scales"] == [0.5]
    for row in result["rows"]:
        assert row["people_found"] >= 10            # the ground truth's people, found by grouping
        assert 0 < row["network_share"] < 1
        assert min(row["network_pictures_per_s"], row["grouping_pictures_per_s"], row["pictures_per_s"]) > 0
    assert sum(line.startswith("| 1 |") or line.startswith("| 4 |") for line in lines) == 2
    assert [row["threads"] for row in result["evaluation"]] == [1, 2]
    assert all(min(row["serial_pictures_per_s"], row["read_ahead_pictures_per_s"]) > 0
               for row in result["evaluation"])
    split = result["split_ms"]           # ms a picture per stage of a serial pass, then the rest
    assert list(split) == ["decode", "resize", "host_to_device", "network", "maps_back", "peaks", "grouping",
                           "scoring", "other"]
    assert min(split.values()) >= 0 and min(split["decode"], split["network"], split["peaks"]) > 0
    assert sum(line.startswith(("| network |", "| total |")) for line in lines) == 2
