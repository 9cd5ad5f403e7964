"""bench/docs_results.py: recording a run's provenance, adding rows to it, and the training page's parts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest


@pytest.fixture
def docs_results(bench_module, monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    module = bench_module("docs_results")
    monkeypatch.setattr(module, "DATA", tmp_path)
    return module


def test_a_record_names_the_versions_and_an_addition_keeps_the_first_provenance(docs_results, tmp_path: Path) -> None:
    assert docs_results.record("run", "A run", [sys.executable, "-c", "print('first')"]) == 0
    first = json.loads((tmp_path / "run.run.json").read_text())
    assert {"commit", "python", "torch", "lightning", "seconds"} <= first.keys() and first["title"] == "A run"
    assert first["torch"] == docs_results.versions()["torch"] != "not installed"

    assert docs_results.record("run", None, [sys.executable, "-c", "print(2)"], add=True) == 0
    added = json.loads((tmp_path / "run.run.json").read_text())
    assert {k: v for k, v in added.items() if k != "additions"} == first
    assert [a["command"] for a in added["additions"]] == [f"{sys.executable} -c 'print(2)'"]
    assert "title" not in added["additions"][0] and "lightning" in added["additions"][0]
    output = (tmp_path / "run.out.txt").read_text()
    assert output.startswith("first\n") and output.endswith("-c 'print(2)'\n2\n")

    with pytest.raises(SystemExit, match="no .* to add to"):
        docs_results.record("other", None, [sys.executable, "-c", "pass"], add=True)
