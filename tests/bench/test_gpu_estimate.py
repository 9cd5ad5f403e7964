"""bench/gpu_estimate.py: the counts its GPU estimate stands on, and the estimate's arithmetic."""

from __future__ import annotations

import pytest
import torch


def test_a_matrix_product_counts_its_flops_and_the_bytes_it_reads_and_writes(bench_module) -> None:
    estimate = bench_module("gpu_estimate")
    a, b = torch.randn(64, 32), torch.randn(32, 16)
    counts = estimate.count(lambda: a @ b, tflops=1.0, bandwidth_gbs=1.0)
    assert counts.operations == 1
    assert counts.flops == 2 * 64 * 32 * 16
    assert counts.bytes == 4 * (64 * 32 + 32 * 16 + 64 * 16)
    assert counts.device_floor_ms == pytest.approx(max(counts.flops / 1e12, counts.bytes / 1e9) * 1e3)
    assert estimate.count(lambda: a.t(), 1.0, 1.0).bytes == 0  # a view moves nothing


def test_the_estimate_is_the_longer_of_host_and_device_and_a_run_mixes_updates_and_replays(bench_module) -> None:
    estimate = bench_module("gpu_estimate")
    result = estimate.main(["--arch", "resnet18", "--batch-size", "2", "--image-size", "32", "--no-autocast"])
    rows = {row["method"]: row for row in result["rows"]}
    ops = {name: row["aten ops"] for name, row in rows.items()}
    assert ops["GS update iteration"] > ops["GS between updates"] > ops["GradScaler"] > ops["plain backward"]
    for row in rows.values():
        host = row["aten ops"] * 8e-3
        assert row["host ms (estimate)"] == pytest.approx(host)
        assert row["estimate ms (estimate)"] == max(host, row["device ms (estimate)"])
    ms = {name: row["estimate ms (estimate)"] for name, row in rows.items()}
    forward = ms["forward (every method's)"]
    every_100 = result["runs"][0]
    assert every_100["iteration ms (estimate)"] == pytest.approx(
        forward + (99 * ms["GS between updates"] + ms["GS update iteration"]) / 100
    )
    assert every_100["÷ GradScaler (estimate)"] == pytest.approx(
        every_100["iteration ms (estimate)"] / (forward + ms["GradScaler"])
    )
