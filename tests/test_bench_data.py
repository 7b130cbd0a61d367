"""bench/data_pipeline.py on coco4: the worker's share and the CPU path, every pass of each in its
JSON line. Timings are not asserted (benchmarks report them); what a user reads off the output is."""
from __future__ import annotations

import json

from bench import data_pipeline


def test_every_pass_and_every_stage_of_the_worker_share_and_the_cpu_path_are_reported(capsys, coco4_dir):
    assert data_pipeline.main(["--input-size", "128", "--samples", "10", "--repeats", "2",
                               "--batch", "4", "--coco-dir", str(coco4_dir)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    assert len(result["total_passes_per_s"]) == len(result["cpu_path_passes_per_s"]) == 2
    assert result["total_per_s"] == max(result["total_passes_per_s"])
    assert result["cpu_path_per_s"] == max(result["cpu_path_passes_per_s"]) > 0
    assert any(line.startswith("CPU path") for line in lines) and "coco4" in lines[0]
    # where a worker's time goes: each stage split into its parts, and the picture alone
    parts = [line.split()[0] for line in lines if line.startswith("  ")]
    assert parts == ["people", "picture", "masks", "picture", "colour", "masks"]
    # the printed rates are the JSON line's (which is faster is a measurement, never asserted here)
    text = "\n".join(lines)
    assert f"{result['picture_read_decode_warp_per_s']:.1f} samples/s, the most any worker" in text
    assert "CPU path " + " ".join(f"{r:.1f}" for r in result["cpu_path_passes_per_s"]) in text
    assert all(result[key] > 0 for key in ("read_per_s", "augment_per_s", "total_per_s",
                                           "picture_read_decode_warp_per_s"))
