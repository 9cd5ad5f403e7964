"""bench/compare_training.py end to end at tiny size: every method trains, is evaluated and reported."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch


@pytest.fixture
def compare_training(bench_module):
    return bench_module("compare_training")


def test_quick_runs_every_method_and_reports_it(
    compare_training, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    runs_file = tmp_path / "runs.json"
    common = ["--quick", "--steps", "2", "--underflow-every", "1", "--cache", str(tmp_path / "data")]
    # Every method on the two cheap tasks; SSD300 (slow on a CPU) with one method per gradient format.
    runs = compare_training.main(
        [*common, "--tasks", "segnet", "resnet", "--methods", *compare_training.METHODS, "--json", str(runs_file)]
    )
    runs += compare_training.main([*common, "--tasks", "ssd", "--methods", "fp32", "fp16-gs", "e5m2-amax-dynamic"])
    assert {(r.task, r.method) for r in runs} == {
        *((task, method) for task in ("segnet", "resnet") for method in compare_training.METHODS),
        ("ssd", "fp32"),
        ("ssd", "fp16-gs"),
        ("ssd", "e5m2-amax-dynamic"),
    }
    # Every method but the fp8 recipes gives each cast tensor one power-of-two scale: the oracle is its floor.
    recipes = ("amax", "delayed", "current", "mx")
    for run in runs:
        assert math.isfinite(run.metric) and len(run.losses) == 2
        method = compare_training.METHODS[run.method]
        assert (run.underflow is not None) == (run.oracle_underflow is not None) == method.emulated, run
        assert (run.update_iterations is not None) == ("-gs" in run.method) and (run.update_iterations or 1) >= 1, run
        assert (run.grads, run.label) == (method.grads, method.label)
        assert run.grad_rounding == (method.grad_rounding if method.emulated else None)
        if method.emulated and not any(recipe in run.method for recipe in recipes):
            assert run.underflow >= run.oracle_underflow, run
    entering = {k for k, m in compare_training.METHODS.items() if m.grad_rounding == "entering"}
    assert {"e5m2-in-current", "e4m3-in-mx", "e5m2-in-gs"} <= entering
    assert {"e5m2-current", "e4m3-mx"} <= set(
        compare_training.DEFAULT_METHODS
    ) and "e4m3-in-mx" in compare_training.DEFAULT_METHODS
    records = json.loads(runs_file.read_text())
    assert len(records) == 2 * len(compare_training.METHODS)
    assert {"oracle_underflow", "grads", "label", "grad_rounding", "seconds"} <= records[0].keys()

    capsys.readouterr()
    compare_training.main(["--report", str(runs_file), "--plots", str(tmp_path / "plots")])
    table = capsys.readouterr().out
    assert table.count("| segnet |") == len(compare_training.METHODS) and "| resnet | e5m2 | GS |" in table
    assert "| per-tensor oracle |" in table and "| resnet | bf16 + e4m3fn ∇Y | MX blocks of 32 (MXFP8) |" in table
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "compare_training_resnet.png",
        "compare_training_segnet.png",
    ]


def test_deep_task_reports_its_gradient_spread_and_trains(
    compare_training, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    methods = ["fp32", "fp16-none", "fp16-dynamic", "fp16-gs"]
    runs = compare_training.main(
        [
            "--quick",
            "--steps",
            "2",
            "--cache",
            str(tmp_path / "data"),
            "--tasks",
            "deep",
            "--gradient-magnitudes",
            "--methods",
            *methods,
        ]
    )
    assert [r.method for r in runs] == methods
    assert all(math.isfinite(r.metric) and r.metric_name == "mIoU" for r in runs)
    printed = capsys.readouterr().out
    assert f"{compare_training.GRADIENT_HEADER} of `deep`" in printed and "binades" in printed

    rows = compare_training.gradient_magnitudes(compare_training.BUILDERS["deep"](tmp_path / "data", True))
    assert len(rows) == 16  # one per convolution
    # The bottom layers' incoming gradients sit far below the scaled-down layers' weight gradients:
    # the spread the task is built for (29.5 binades on the full dataset's first batch).
    largest = max(max(r["∇W max"], r["∇Y max"]) for r in rows)
    assert largest - rows[0]["∇Y median"] > 25


def test_deep_task_trains_as_the_unscaled_network_in_fp32(bench_module, tmp_path: Path) -> None:
    """The power-of-two layer scales and layer_scaled_adam change the magnitudes, not the fp32 training."""
    tasks = bench_module("_training_tasks")
    task = tasks.deep_task(tmp_path / "data", True)
    gains = tasks.DEEP_LOG2_GAINS
    scaled = task.build(0)
    torch.manual_seed(0)
    unscaled = tasks.plain_cnn(len(tasks.CAMVID_CLASSES), log2_gains=(0,) * len(gains))
    input_scale = 2.0 ** sum(gains)  # what the scaled network's product of gains does to its input
    optimizers = task.make_optimizer(scaled), torch.optim.Adam(unscaled.parameters(), lr=task.lr, eps=1e-8)
    for step in range(3):
        images, labels = task.batch(
            torch.arange(step * task.batch_size, (step + 1) * task.batch_size) % len(task.train[0])
        )
        losses = task.loss(scaled, images, labels), task.loss(unscaled, images * input_scale, labels)
        assert torch.equal(*losses)
        for optimizer, loss in zip(optimizers, losses):
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    convs = [(a, b) for a, b in zip(scaled, unscaled) if isinstance(a, torch.nn.Conv2d)]
    assert all(torch.equal(a.weight, b.weight * 2.0**k) for (a, b), k in zip(convs, gains, strict=True))


def test_underflow_by_tensor_names_the_tensors_that_underflowed_most(compare_training) -> None:
    meter = compare_training.TensorUnderflowMeter(torch.float16, {(2, 3)})
    activation, weight = torch.ones(4), torch.ones(2, 3)
    half_lost = torch.tensor([1.0, 0.0, 1.0, 0.0])
    for rounded_activation, rounded_weight in ((activation, torch.zeros(2, 3)), (half_lost, weight)):  # two steps
        meter.add(activation, rounded_activation)
        meter.add(weight, rounded_weight)
        meter.collect_with_oracle()
    assert meter.worst(2) == "#1 ∇W (2, 3) 50.00%; #0 ∇X (4,) 25.00%"
    entering = compare_training.TensorUnderflowMeter(None, set(), grad_rounding="entering")
    entering.add(activation, half_lost)
    entering.collect_with_oracle()
    assert entering.worst(5) == "#0 ∇Y (4,) 50.00%"


def test_merge_adds_the_paper_rows_to_an_earlier_table(compare_training, tmp_path: Path) -> None:
    table = tmp_path / "table.json"
    common = ["--quick", "--steps", "2", "--cache", str(tmp_path / "data"), "--tasks", "resnet"]
    first = compare_training.main([*common, "--methods", "fp32", "fp16-gs", "--json", str(table)])
    merged = compare_training.main([*common, "--methods", "fp16-gs", "fp16-gs-paper", "--merge", str(table)])
    # fp16-gs ran again and took its earlier place; the paper's row follows; fp32 is kept as it was.
    assert [r.method for r in merged] == ["fp32", "fp16-gs", "fp16-gs-paper"]
    assert merged[0] == first[0] and [r["method"] for r in json.loads(table.read_text())] == [
        "fp32",
        "fp16-gs",
        "fp16-gs-paper",
    ]
    paper = merged[2]
    assert paper.label == compare_training.PAPER_LABEL and paper.update_iterations >= 1
    assert compare_training.METHODS["e5m2-gs-paper"].grads == "e5m2"
    assert {"fp16-gs-paper", "e5m2-gs-paper"} <= set(compare_training.DEFAULT_METHODS)

    with pytest.raises(SystemExit):  # another number of steps than the table's
        compare_training.main([*common[:2], "3", *common[3:], "--methods", "fp16-gs-paper", "--merge", str(table)])
    with pytest.raises(SystemExit):  # no such table
        compare_training.main([*common, "--methods", "fp32", "--merge", str(tmp_path / "missing.json")])


def test_time_ratios_pair_each_run_with_the_dynamic_loss_scale_it_was_stepped_with(compare_training) -> None:
    """Per seed, a run's seconds over those of the dynamic loss scale of its gradient format trained in lockstep with
    it; a run trained alone (no lockstep id) or with no such partner has none."""

    def run(method: str, grads: str, label: str, seconds: float, lockstep: str | None) -> object:
        return compare_training.Run("resnet", method, 0, "top-1", 1.0, 0, None, seconds, [], grads=grads, label=label,
                                    lockstep=lockstep)  # fmt: skip

    runs = [
        run("fp16-dynamic", "fp16", "dynamic loss scale", 10.0, "a"),
        run("fp16-gs", "fp16", "GS", 11.0, "a"),
        run("fp16-dynamic", "fp16", "dynamic loss scale", 20.0, "b"),
        run("fp16-gs", "fp16", "GS", 21.0, "b"),
        run("e5m2-gs", "e5m2", "GS", 12.0, "a"),  # no e5m2 dynamic loss scale stepped with it
        run("fp16-gs", "fp16", "GS", 5.0, None),  # trained alone
    ]
    ratios = compare_training.time_ratios(runs)
    assert ratios[("resnet", "fp16", "fp16-gs")] == pytest.approx([1.1, 1.05])
    assert ratios[("resnet", "fp16", "fp16-dynamic")] == [1.0, 1.0]
    assert ("resnet", "e5m2", "e5m2-gs") not in ratios


def test_a_runs_seconds_leave_out_the_underflow_meters_own_work(compare_training, tmp_path: Path) -> None:
    """Measuring the underflow is the benchmark's work: every emulated method pays it alike, and counted in their
    seconds it would pull their ratios towards 1."""

    class SlowMeter(compare_training.UnderflowMeter):
        def add(self, exact: torch.Tensor, rounded: torch.Tensor) -> None:
            super().add(exact, rounded)
            started = time.perf_counter()
            time.sleep(0.01)  # as if measuring took 10 ms more
            self.seconds += time.perf_counter() - started

    task = compare_training.BUILDERS["resnet"](tmp_path / "data", True)
    method = compare_training.METHODS["fp16-dynamic"]
    timed, slow = (
        compare_training.Training(task, method, 0, 1, meter=meter)
        for meter in (compare_training.UnderflowMeter(torch.float16), SlowMeter(torch.float16))
    )
    for step in range(2):
        timed.step(step)
        slow.step(step)
    slept = slow.meter.seconds - timed.meter.seconds
    assert slept > 0.2  # ResNet-8 casts 20 gradients a step
    assert slow.seconds < timed.seconds + slept / 4
    assert slow.underflow == timed.underflow  # nothing but the time changes


def test_a_skipped_step_names_the_parameters_whose_gradients_overflowed(compare_training, tmp_path: Path) -> None:
    """Where a method skips a step, the run records which parameters' gradients were non-finite there, outside
    the timed part (the bench's reading, not the method's)."""
    task = compare_training.BUILDERS["resnet"](tmp_path / "data", True)
    training = compare_training.Training(task, compare_training.METHODS["fp16-dynamic"], 0, 10**9)
    name, parameter = list(training.model.named_parameters())[-1]
    now = {"step": 0}
    parameter.register_hook(lambda grad: grad * math.inf if now["step"] == 1 else grad)  # as user code may
    for step in range(3):
        now["step"] = step
        training.step(step)
    run = training.result()
    assert run.skipped_steps == 1 and run.skips == [{"step": 1, "non_finite": [name]}]

    skips = [{"step": 3, "non_finite": ["b", "a", "c", "d"]}, {"step": 7, "non_finite": ["b"]}]
    assert compare_training.skip_causes(skips) == "b (2 of 2), a (1 of 2), c (1 of 2), 1 more"
    assert compare_training.skip_causes([{"step": 0, "non_finite": []}]) == "no parameter"
