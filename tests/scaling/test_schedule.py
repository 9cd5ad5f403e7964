"""The update schedule (:mod:`gs_lightning.scaling.schedule`): each rule on exact inputs, and the reasons a
training run reports, by member."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gs_lightning import GradientScaler
from gs_lightning.scaling.drift import ROUNDING_LOG2, DriftReading
from gs_lightning.scaling.schedule import UpdateReason, UpdateRecord, UpdateSchedule, drift_reasons, reasons_named

R = UpdateReason


def test_a_structure_that_never_decided_updates_first_then_every_interval() -> None:
    schedule = UpdateSchedule()
    assert schedule.reasons(3, decided=False) == {R.FIRST}  # not INTERVAL too: nothing ran to count
    reasons = []
    for _ in range(7):
        reasons.append(schedule.reasons(3, decided=True))
        schedule.backwards += 1
    assert reasons == [{R.INTERVAL}, set(), set(), {R.INTERVAL}, set(), set(), {R.INTERVAL}]
    assert [UpdateSchedule().due(1) for _ in range(3)] == [True] * 3  # update_interval=1: every backward


def test_what_asks_for_an_update_is_recorded_with_it_and_answered_by_it() -> None:
    schedule = UpdateSchedule()
    schedule.backwards = 4
    schedule.ask(R.DRIFT)
    schedule.ask(R.DRIFT, R.UNMEASURED_WEIGHT_BOUND)
    reasons = schedule.reasons(3, decided=True)
    assert reasons == {R.DRIFT, R.UNMEASURED_WEIGHT_BOUND}
    assert schedule.updated(17, reasons) == UpdateRecord(17, 4, frozenset({R.DRIFT, R.UNMEASURED_WEIGHT_BOUND}))
    assert schedule.pending == set() and schedule.reasons(3, decided=True) == set()


def test_a_skip_asks_for_an_update_and_restarts_the_clean_interval() -> None:
    schedule = UpdateSchedule()
    schedule.backwards = 5
    schedule.skipped()
    assert schedule.last_skip == 5 and schedule.reasons(4, decided=True) == {R.SKIPPED_STEP}
    # the back-off relaxes at a multiple of the interval at least one interval after the skip
    assert [b for b in range(17) if schedule.clean_interval(b, 4)] == [12, 16]


@pytest.mark.parametrize(
    ("reading", "reasons"),
    [
        (DriftReading(drift_log2=0.5, tolerance_log2=1.0), set()),
        (DriftReading(drift_log2=1.0, tolerance_log2=1.0), {R.DRIFT}),
        (DriftReading(drift_log2=3.0, tolerance_log2=None), set()),  # no drift rule
        (DriftReading(drift_log2=math.inf, tolerance_log2=1.0), {R.ZERO_GRADIENT}),
        (DriftReading(drift_log2=math.inf, non_finite=frozenset({2}), tolerance_log2=1.0), {R.NON_FINITE_GRADIENT}),
        (DriftReading(surprise_log2=ROUNDING_LOG2, tolerance_log2=1.0), set()),  # rounding, not a rise
        (DriftReading(surprise_log2=0.25, tolerance_log2=1.0), {R.EXPECTED_MAXIMUM_EXCEEDED}),
        (DriftReading(drift_log2=2.0, surprise_log2=0.25, tolerance_log2=1.0), {R.DRIFT, R.EXPECTED_MAXIMUM_EXCEEDED}),
    ],
)
def test_a_reading_names_why_it_asks_for_an_update(reading: DriftReading, reasons: set[UpdateReason]) -> None:
    assert drift_reasons(reading) == reasons
    assert bool(reasons) == reading.drifted


def test_the_schedule_survives_a_checkpoint_and_reads_one_that_had_a_bool() -> None:
    schedule = UpdateSchedule()
    schedule.backwards, schedule.last_skip = 9, 7
    schedule.ask(R.SKIPPED_STEP, R.DRIFT)
    schedule.last = UpdateRecord(30, 8, frozenset({R.INTERVAL}))
    state = schedule.state_dict()
    assert state == {
        "backwards": 9,
        "last_skip": 7,
        "update_reasons": ["DRIFT", "SKIPPED_STEP"],
        "last_update": [30, 8, ["INTERVAL"]],
    }
    restored = UpdateSchedule()
    restored.load_state_dict(state)
    assert vars(restored) == vars(schedule)
    for force_update, pending in ((True, {R.RESUMED}), (False, set())):
        old = UpdateSchedule()
        old.load_state_dict({"backwards": 3, "last_skip": 0, "force_update": force_update})
        assert old.pending == pending and old.backwards == 3 and old.last is None
    with pytest.raises(ValueError, match="unknown update reason.*'SKIPPED'.*expected names of"):
        reasons_named(["SKIPPED"])


def test_a_training_run_reports_why_each_update_ran_by_name() -> None:
    """First backward, every interval-th (counted from the structure's first backward, whatever updated between),
    and the one after a skipped step: each update says which, as a member."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    scaler = GradientScaler(model, update_interval=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    seen = []
    for step in range(8):
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y) * (math.inf if step == 4 else 1.0)
        scaler.backward(loss)
        seen.append(scaler.updates)
        assert scaler.step(optimizer) == (step != 4)
        scaler.update()
    assert [[(u.iteration, u.reasons) for u in updates] for updates in seen] == [
        [(0, {R.FIRST})],
        [],
        [],
        [(3, {R.INTERVAL})],
        [],
        # the skip, and what the step's reading saw: a non-finite gradient, above all that was expected
        [(5, {R.SKIPPED_STEP, R.NON_FINITE_GRADIENT, R.EXPECTED_MAXIMUM_EXCEEDED})],
        [(6, {R.INTERVAL})],
        [],
    ]
    assert scaler.graphs[-1].schedule.last == UpdateRecord(6, 6, frozenset({R.INTERVAL}))
    assert scaler.update_iterations == 4
