"""bench/inference_emulation.py at tiny size: both contexts timed, the same detections, the table and the JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def test_tiny_ssd_times_both_contexts_with_identical_detections(
    bench_module, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    inference = bench_module("inference_emulation")
    timing = inference.measure(size=300, width_mult=0.03125, batch_size=1, rounds=1)
    assert timing.identical
    assert timing.no_grad_s > 0 and timing.inference_mode_s > 0
    assert timing.ratio == timing.inference_mode_s / timing.no_grad_s
    with pytest.raises(ValueError, match="rounds and batch_size must be at least 1"):
        inference.measure(rounds=0)

    out = tmp_path / "row.json"
    inference.main(["--width-mult", "0.03125", "--batch-size", "1", "--rounds", "1", "--json", str(out)])
    assert "| no_grad s | inference_mode s | inference_mode / no_grad | same detections |" in capsys.readouterr().out
    (row,) = json.loads(out.read_text())["rows"]
    assert row["size"] == 300 and row["identical"] is True
