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
    for run in runs:
        assert math.isfinite(run.metric) and len(run.losses) == 2
        emulated = compare_training.METHODS[run.method].emulated
        assert (run.underflow is not None) == emulated, run
        assert (run.update_iterations is not None) == run.method.endswith("-gs") and (run.update_iterations or 1) >= 1, run
    assert len(json.loads(runs_file.read_text())) == 2 * len(compare_training.METHODS)

    capsys.readouterr()
    compare_training.main(["--report", str(runs_file), "--plots", str(tmp_path / "plots")])
    table = capsys.readouterr().out
    assert table.count("| segnet |") == len(compare_training.METHODS) and "| resnet | e5m2 | GS |" in table
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["compare_training_resnet.png", "compare_training_segnet.png"]
