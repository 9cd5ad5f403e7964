"""bench/compare_training.py end to end at tiny size: every method trains, is evaluated and reported."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest


@pytest.fixture
def compare_training(bench_module):
    return bench_module("compare_training")


def test_quick_runs_every_method_and_reports_it(compare_training, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    runs_file = tmp_path / "runs.json"
    common = ["--quick", "--steps", "2", "--underflow-every", "1", "--cache", str(tmp_path / "data")]
    # Every method on the two cheap tasks; SSD300 (slow on a CPU) with one method per gradient format.
    runs = compare_training.main([*common, "--tasks", "segnet", "resnet", "--methods", *compare_training.METHODS, "--json", str(runs_file)])
    runs += compare_training.main([*common, "--tasks", "ssd", "--methods", "fp32", "fp16-gs", "e5m2-amax-dynamic"])
    assert {(r.task, r.method) for r in runs} == {
        *((task, method) for task in ("segnet", "resnet") for method in compare_training.METHODS),
        ("ssd", "fp32"), ("ssd", "fp16-gs"), ("ssd", "e5m2-amax-dynamic"),
    }
    # Every method but the fp8 recipes gives each cast tensor one power-of-two scale: the oracle is its floor.
    recipes = ("amax", "delayed", "current", "mx")
    for run in runs:
        assert math.isfinite(run.metric) and len(run.losses) == 2
        method = compare_training.METHODS[run.method]
        assert (run.underflow is not None) == (run.oracle_underflow is not None) == method.emulated, run
        assert (run.update_iterations is not None) == run.method.endswith("-gs") and (run.update_iterations or 1) >= 1, run
        assert (run.grads, run.label) == (method.grads, method.label)
        assert run.grad_rounding == (method.grad_rounding if method.emulated else None)
        if method.emulated and not any(recipe in run.method for recipe in recipes):
            assert run.underflow >= run.oracle_underflow, run
    entering = {k for k, m in compare_training.METHODS.items() if m.grad_rounding == "entering"}
    assert {"e5m2-in-current", "e4m3-in-mx", "e5m2-in-gs"} <= entering
    assert {"e5m2-current", "e4m3-mx"} <= set(compare_training.DEFAULT_METHODS) and "e4m3-in-mx" in compare_training.DEFAULT_METHODS
    records = json.loads(runs_file.read_text())
    assert len(records) == 2 * len(compare_training.METHODS)
    assert {"oracle_underflow", "grads", "label", "grad_rounding", "seconds"} <= records[0].keys()

    capsys.readouterr()
    compare_training.main(["--report", str(runs_file), "--plots", str(tmp_path / "plots")])
    table = capsys.readouterr().out
    assert table.count("| segnet |") == len(compare_training.METHODS) and "| resnet | e5m2 | GS |" in table
    assert "| per-tensor oracle |" in table and "| resnet | bf16 + e4m3fn ∇Y | MX blocks of 32 (MXFP8) |" in table
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["compare_training_resnet.png", "compare_training_segnet.png"]
