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


def _run(task: str, method: str, seed: int, **fields) -> dict:
    return {
        "task": task,
        "method": method,
        "seed": seed,
        "metric_name": "top-1",
        "metric": 0.5,
        "skipped_steps": 0,
        "underflow": 0.01,
        "seconds": 2.0,
        "losses": [1.0, 0.5],
        "update_iterations": None,
        "oracle_underflow": 0.001,
        "grads": None,
        "label": None,
        "grad_rounding": "output",
        "recomputed_steps": None,
        **fields,
    }


def test_the_training_section_leads_with_a_figure_and_narrow_tables(docs_results, tmp_path: Path) -> None:
    data = [
        _run("resnet", method, seed, skipped_steps=seed, underflow=0.0 if method == "fp16-gs" else 2e-9)
        for seed in (0, 1)
        for method in ("fp16-gs-paper", "fp16-dynamic", "fp32", "fp16-gs")
    ]
    provenance = {
        "title": "A table",
        "command": "python bench/compare_training.py --tasks resnet --json t.json",
        "commit": "abc",
        "uncommitted": [],
        "date": "today",
        "machine": "here",
        "python": "3.11",
        "seconds": 1.0,
        "additions": [
            {
                "command": "python bench/compare_training.py --methods fp16-gs-paper --merge t.json",
                "commit": "def",
                "uncommitted": [],
                "date": "later",
                "machine": "busy",
                "python": "3.11",
                "torch": "2.9",
                "lightning": "2.6",
                "seconds": 3.0,
                "note": "The machine was shared.",
            }
        ],
    }
    run = docs_results.Recorded("training", provenance, data, "")
    assert run.added_methods() == {"fp16-gs-paper"}
    lines = docs_results.training_section(run)
    text = "\n".join(lines)
    # The first provenance has no versions; the addition's are named, with its note.
    assert "(torch and Lightning versions not recorded)" in text and "torch 2.9, Lightning 2.6." in text
    assert "The machine was shared." in text
    figure = next(i for i, line in enumerate(lines) if line.startswith("!["))
    tables = [line for line in lines[figure:] if line.startswith("| gradients |")]
    assert len(tables) == 2 and all(line.count("|") - 1 <= 7 for line in tables)
    assert tables[0].startswith("| gradients | method | skipped steps | GEMM-gradient underflow |")
    # Rows in the bench's method order (the merged paper row beside GS), GS's in bold, tiny underflow legible.
    methods = [line.split(" | ")[1] for line in lines if line.startswith("| fp")][:4]
    assert methods == ["fp32 (reference)", "dynamic loss scale", "**GS**", f"**{docs_results._paper_label()}**"]
    assert "| 0% |" in text and "2·10⁻⁷%" in text
    assert "were added by the later command above" in text

    # What overflowed where a method skipped, from the runs that recorded it (none did here).
    assert "non-finite at them" not in text
    data[1]["skips"] = [{"step": 4, "non_finite": ["fc.bias", "fc.weight"]}]
    data[5]["skips"] = [{"step": 9, "non_finite": ["fc.bias"]}]
    skipped = "\n".join(docs_results.training_section(run))
    assert "- fp16 dynamic loss scale, 2 skipped steps in 2 runs: fc.bias (2 of 2), fc.weight (1 of 2)" in skipped

    # A later command that ran the same tasks and methods again replaced the first addition's rows: the page names
    # only the command its rows come from, and no table gains a column for the runs that recorded no skips.
    data[2]["skips"] = data[6]["skips"] = None  # as the bench wrote before it recorded them
    run.provenance["additions"].append(
        {
            **run.provenance["additions"][0],
            "command": "python bench/compare_training.py --methods fp16-gs-paper fp16-gs --merge t.json",
            "date": "last",
        }
    )
    replaced = "\n".join(docs_results.training_section(run))
    assert "Measured here: commit `def`, last" in replaced and "Measured here: commit `def`, later" not in replaced
    assert "| skips |" not in replaced
    assert run.added_methods() == {"fp16-gs-paper", "fp16-gs"}

    answer = "\n".join(docs_results.training_answer([run]))
    assert "| ResNet-8 | fp16 | 0.5\u00a0·\u00a00% | 0.5\u00a0·\u00a02·10⁻⁷% | 0.5\u00a0·\u00a02·10⁻⁷% |" in answer
