"""The step's one read: producers put tensors under keys, one synchronisation hands their values back by key."""

from __future__ import annotations

import pytest
import torch

from gs_lightning.scaling.gradient_stats import DeviceRead, first_non_finite


def test_each_producer_gets_its_own_values_back_whatever_was_put_before_it() -> None:
    first, second = DeviceRead(), DeviceRead()
    counts = [torch.tensor(3, dtype=torch.int64), torch.tensor(2**40 + 1, dtype=torch.int64)]
    maxima = torch.tensor([0.5, float("inf")], dtype=torch.float16)
    first.put("counts", counts)
    first.put("maxima", [maxima])
    second.put("maxima", [maxima])  # another order, and a producer fewer
    assert first.read() == {"counts": [3.0, float(2**40 + 1)], "maxima": [0.5, float("inf")]}  # fp64: counts exact
    assert second.read() == {"maxima": [0.5, float("inf")]}


def test_empty_keys_and_an_empty_read() -> None:
    read = DeviceRead()
    read.put("nothing", [])
    assert read.read() == {"nothing": []}
    assert DeviceRead().read() == {}


def test_a_key_put_twice_is_an_error_naming_it() -> None:
    read = DeviceRead()
    read.put(("graph", "scales"), [torch.zeros(())])
    with pytest.raises(KeyError, match="'graph', 'scales'"):
        read.put(("graph", "scales"), [torch.ones(())])


def test_one_synchronisation_for_every_key(monkeypatch: pytest.MonkeyPatch) -> None:
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(self.shape) or tolist(self))
    read = DeviceRead()
    for k in range(5):
        read.put(k, [torch.full((), float(k)), torch.arange(k, dtype=torch.float32)])
    values = read.read()
    assert len(reads) == 1 and values[4] == [4.0, 0.0, 1.0, 2.0, 3.0]


def test_the_first_non_finite_layer_is_found_by_its_key() -> None:
    flags = [("conv1", (torch.zeros(()),)), ("conv2", (torch.zeros(()), torch.zeros(()))), ("fc", (torch.zeros(()),))]
    values = {("g", "finite", 0): [1.0], ("g", "finite", 1): [2.0, float("nan")], ("g", "finite", 2): [float("inf")]}
    assert first_non_finite(flags, values, ("g", "finite")) == "conv2"
    values["g", "finite", 1] = [2.0, 3.0]
    assert first_non_finite(flags, values, ("g", "finite")) == "fc"
