"""bench/train_throughput.py on the CPU: the GPU benchmark's table and JSON, fed with synthetic
batches and through the engine's DataLoader over coco4, so a GPU session finds it working.
Timings are not asserted (benchmarks report them); what a user reads off the output is."""
from __future__ import annotations

import json

import pytest

from bench import train_throughput

TINY = ["--preset", "tiny", "--input", "64", "--batch", "2", "--steps", "2", "--warmup", "1",
        "--device", "cpu"]


def last_json(capsys) -> dict:
    out = capsys.readouterr().out
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.slow
def test_synthetic_rows_with_and_without_channels_last(capsys):
    assert train_throughput.main([*TINY, "--configs", "O0 fp32", "--channels-last", "both"]) == 0
    result = last_json(capsys)
    assert [row["config"] for row in result["rows"]] == ["O0 fp32", "O0 fp32 +cl"]
    assert result["data"] == "synthetic" and result["device"] == "cpu" and result["gmac_per_image"] > 0
    for row in result["rows"]:
        assert row["images_per_s"] > 0 and row["skipped_steps"] == 0 and row["first_step_s"] > 0
        assert row["tflops"] == pytest.approx(row["images_per_s"] * 6 * result["gmac_per_image"] / 1e3)
        assert row["share_of_bf16_peak"] is None            # no GPU: no peak to compare with


@pytest.mark.slow          # a DataLoader worker: a process
def test_real_loading_from_coco4_with_an_op_profile(capsys, coco4_dir):
    assert train_throughput.main([*TINY, "--configs", "O0 fp32", "--channels-last", "off", "--h5", "coco4",
                                  "--coco-dir", str(coco4_dir), "--repeat", "2", "--workers", "1",
                                  "--profile", "1"]) == 0
    result = last_json(capsys)
    assert "coco4" in result["data"] and result["workers"] == 1
    row, = result["rows"]
    assert 0 <= row["data_wait_share"] <= 1
    assert ("convolution" in row["time_by_op"]
            and sum(row["time_by_op"].values()) == pytest.approx(1, abs=1e-3))


def test_a_training_step_reads_the_host_once(capsys):
    """Outside logging steps, one host sync per optimiser step (its one read of the norm,
    the loss and the skip flags), whatever the precision."""
    assert train_throughput.main([*TINY, "--configs", "O0 fp32", "O1 bf16", "--channels-last", "off"]) == 0
    rows = last_json(capsys)["rows"]
    assert [row["config"] for row in rows] == ["O0 fp32", "O1 bf16"]
    for row in rows:
        assert row["host_syncs_per_step"] == 1 and row["host_syncs_by_kind"] == {"tolist": 2}
