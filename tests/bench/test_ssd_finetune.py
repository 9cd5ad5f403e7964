"""bench/ssd_finetune.py at tiny size: pretrained backbone cached, runs recorded per group, report and plots."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

import pytest

# SSD300's GEMM gradients per backward pass: the 12 multibox-head convs and the 8 extra-layer
# convs (∇W and ∇X each) are fresh; conv1_1..conv7 (15 convs, ∇W each, ∇X but for conv1_1) pretrained.
HEAD_TENSORS, BACKBONE_TENSORS = 2 * (12 + 8), 15 + 14


@pytest.fixture
def ssd_finetune(bench_module):
    return bench_module("ssd_finetune")


@pytest.mark.slow  # ~35 s of CPU: data, pretraining and three SSD300 runs
def test_quick_run_records_skips_scales_and_underflow_per_group(
    ssd_finetune, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    meter = ssd_finetune.GroupedUnderflowMeter()
    task, pretrain = ssd_finetune.finetune_task(ssd_finetune.QUICK, tmp_path / "data", tmp_path / "weights", meter)
    (cached,) = (tmp_path / "weights").iterdir()
    assert 0.0 <= pretrain["crop_accuracy"] <= 1.0 and pretrain["crops"] > 0
    again, _ = ssd_finetune.pretrained_backbone(ssd_finetune.QUICK, tmp_path / "data", tmp_path / "weights")
    assert list((tmp_path / "weights").iterdir()) == [cached]  # loaded, not rebuilt

    runs = []
    for key in ("fp16-dynamic", "fp16-gs", "e5m2-fixed8"):
        run = ssd_finetune.run_one(task, meter, ssd_finetune.ALL_METHODS[key], seed=0, steps=2, underflow_every=1)
        assert meter.counts == {"heads": HEAD_TENSORS, "backbone": BACKBONE_TENSORS}, key
        assert math.isfinite(run.metric) and len(run.losses) == 2
        assert len(run.skipped_at) == run.skipped_steps and all(0 <= s < 2 for s in run.skipped_at)
        assert all(v is not None for v in run.underflow_groups.values()) and set(run.underflow_groups) == {
            "heads",
            "backbone",
        }
        runs.append(run)
    dynamic, gs, fixed = runs
    # One loss scale for every layer: 2^16 halved per skipped step.
    assert dynamic.log2_scale["heads"] == dynamic.log2_scale["backbone"]
    assert dynamic.log2_scale["heads"][-1] == 16 - dynamic.skipped_steps
    assert fixed.log2_scale["heads"] == [3.0, 3.0]
    assert gs.scale_steps and len(gs.log2_scale["heads"]) == len(gs.scale_steps) == len(gs.log2_scale["backbone"])

    runs_file = tmp_path / "runs.json"
    runs_file.write_text(json.dumps([asdict(r) for r in runs]))
    capsys.readouterr()
    ssd_finetune.main(["--report", str(runs_file), "--plots", str(tmp_path / "plots")])
    table = capsys.readouterr().out
    assert "| fp16 | dynamic loss scale |" in table and "| e5m2 | fixed loss scale 2^3 (best fixed) |" in table
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "ssd_finetune_scales.png",
        "ssd_finetune_skips.png",
    ]


def test_rejects_non_positive_steps(ssd_finetune) -> None:
    with pytest.raises(SystemExit):
        ssd_finetune.main(["--quick", "--steps", "0"])
