"""bench/memory.py: the bytes each method allocates above an iteration's start, on a CPU (glibc's mallinfo2)."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch import nn

from gs_lightning import GradientScaler


@pytest.fixture
def memory(bench_module):
    module = bench_module("memory")
    return module, module.DeviceMemory(torch.device("cpu"))


def test_the_peak_counts_what_a_function_frees_before_it_returns(memory) -> None:
    _, device_memory = memory
    start = device_memory.in_use()

    def allocate_and_free() -> None:
        torch.ones(2**20).mul_(2.0)  # 4 MiB, dropped at once, and its product too

    peak = device_memory.peak_of(allocate_and_free)
    assert peak - start >= 4 * 2**20
    assert device_memory.in_use() - start < 2**20


def test_gs_between_updates_holds_the_activations_until_the_step_only_with_the_fp32_recompute(
    memory, bench_module
) -> None:
    bench, device_memory = memory
    overhead = bench_module("overhead")
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))

    def loss() -> torch.Tensor:
        return nn.functional.cross_entropy(model(x), y)

    def gs_method(**recipe_fields: object) -> object:
        scaler = GradientScaler(model, update_interval=10**9, **recipe_fields)
        return bench.Method(scaler.backward, partial(overhead.gradient_scaling_check, scaler), scaler)

    plain = bench.measure(
        device_memory, model, loss, bench.Method(lambda value: value.backward(), lambda: None), replay=False
    )
    kept = bench.measure(device_memory, model, loss, gs_method(recompute_weight_gradients=True), replay=True)
    not_kept = bench.measure(device_memory, model, loss, gs_method(), replay=True)  # the default keeps nothing
    activation = 8 * 32 * 32 * 32 * 4 / 2**20  # one conv's output (or input to the second), MiB
    assert plain["after forward MiB"] >= 2 * activation
    # each conv's saved input and incoming gradient outlive the backward: the second conv's alone are two activations
    assert kept["held after backward MiB"] - plain["held after backward MiB"] >= 2 * activation
    assert kept["peak MiB"] > plain["peak MiB"]
    assert abs(not_kept["held after backward MiB"] - plain["held after backward MiB"]) < activation / 4
