"""bench/gpu_estimate.py: the counts its GPU estimate stands on, and the estimate's arithmetic."""

from __future__ import annotations

import pytest
import torch


def test_a_matrix_product_counts_its_flops_and_the_bytes_it_reads_and_writes(bench_module) -> None:
    estimate = bench_module("gpu_estimate")
    a, b = torch.randn(64, 32), torch.randn(32, 16)
    counts = estimate.count(lambda: a @ b)
    assert counts.operations == 1
    assert counts.flops == [2 * 64 * 32 * 16]
    assert counts.bytes == [4 * (64 * 32 + 32 * 16 + 64 * 16)]
    gpu = estimate.GPU(tflops=1.0, bandwidth_gbs=1.0)
    assert counts.device_floor_ms(gpu) == pytest.approx(max(counts.flops[0] / 1e12, counts.bytes[0] / 1e9) * 1e3)
    assert counts.estimate_ms(gpu, host_us=1e6) == 1e3  # a host slower than the device: the host's time
    assert estimate.count(lambda: a.t()).bytes == [0.0]  # a view moves nothing


def test_a_run_mixes_replays_and_one_update_against_gradscalers_iterations(bench_module) -> None:
    estimate = bench_module("gpu_estimate")
    result = estimate.main(["--arch", "resnet18", "--batch-size", "2", "--image-size", "32", "--no-autocast"])
    ops = {row["section"]: row["aten ops"] for row in result["counts"]}
    assert ops["GS update iteration"] > ops["GS between updates"] > ops["GradScaler"] > ops["plain backward"]
    assert [row["GPU"] for row in result["estimates"]] == list(estimate.GPUS)
    for row in result["estimates"]:
        forward, replay, update = row["forward ms"], row["GS between updates ms"], row["GS update iteration ms"]
        assert row["GS ÷ GradScaler, an update every 100"] == pytest.approx(
            (forward + (99 * replay + update) / 100) / (forward + row["GradScaler ms"])
        )
