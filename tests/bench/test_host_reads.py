"""bench/host_reads.py: GradientScaler reads nothing back to the host in a replay's backward, and once in a step."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def host_reads(bench_module):
    return bench_module("host_reads")


def test_the_counter_sees_every_kind_of_host_read(host_reads) -> None:
    t = torch.ones(3)
    with host_reads.counting_host_reads() as counts:
        t.sum().item(), t.tolist(), bool(t[0]), float(t[0]), int(t[0]), t.cpu(), t.numpy(), torch.nonzero(t)
    assert counts == {name: 1 for name in (*host_reads._TENSOR_READS, "nonzero")}
    assert t.sum().item() == 3.0  # restored
    with host_reads.counting_host_reads() as counts:
        t[torch.tensor(1)]  # indexing by a 0-dim tensor reads it, inside torch
    assert counts == {"scalar read": 1}


@pytest.mark.parametrize("model", ["resnet18", "transformer_encoder"])
def test_no_backward_reads_and_one_in_the_step(host_reads, model: str) -> None:
    """As GradScaler: 0 reads in the backward, 1 in the step (its finiteness flags and the drift statistic
    together), on a replay and on an update iteration too (its decisions are read with the step's)."""
    module, loss_of = host_reads._models(2, "cpu")[model]
    gradscaler = host_reads.measure(model, module, loss_of, "cpu", "GradScaler")
    update, replay = host_reads.measure(model, module, loss_of, "cpu", "GS")
    assert [(r.backward_reads, r.step_reads) for r in gradscaler] == [(0, 1), (0, 1)]
    assert (replay.backward_reads, replay.step_reads) == (0, 1)
    assert (update.backward_reads, update.step_reads) == (0, 1)
