"""Schedule kinds as classes: the registry, and each kind's declared answers against the action lists it
generates (read independently, with ``liveness_trace`` and by scanning the lists)."""

from __future__ import annotations

import pytest

from lightning_async_pp.schedule import (
    SCHEDULES,
    Op,
    PipelineSchedule,
    Schedule2BW,
    build_schedule,
    check,
    get_schedule,
    ir,
    liveness_trace,
    register_schedule,
    step_actions,
    validate,
)
from tests.unit.test_architecture import SCHEDULE_NAMES

KINDS = [get_schedule(name) for name in SCHEDULES]
SHAPES = [(2, 2), (2, 4), (3, 3), (3, 5), (4, 8), (3, 1), (4, 2)]  # (P, M)
STEPS = 5


def accepts(kind: PipelineSchedule, P: int, M: int) -> bool:
    try:
        kind.validate(P, M)
    except ValueError:
        return False
    return True


CASES = [
    pytest.param(kind, P, M, id=f"{kind.name}-P{P}-M{M}") for kind in KINDS for P, M in SHAPES if accepts(kind, P, M)
]


def test_registry_lists_the_schedules():
    assert SCHEDULES == ("2bw", "1f1b")
    assert SCHEDULE_NAMES == SCHEDULES  # the architecture test looks for exactly these names
    assert [type(kind).__name__ for kind in KINDS] == ["Schedule2BW", "Schedule1F1B"]
    assert all(kind.name == name for kind, name in zip(KINDS, SCHEDULES))
    assert get_schedule("2bw") is get_schedule("2bw")


@pytest.mark.parametrize("name", ["gpipe", "2BW", "", None, 2])
def test_unknown_names_are_refused_with_the_known_ones(name):
    with pytest.raises(ValueError, match=r"unknown pipeline schedule .*expected one of '2bw', '1f1b'"):
        get_schedule(name)


def test_a_name_is_registered_once():
    class Again(Schedule2BW):
        name = "1f1b"

    with pytest.raises(ValueError, match="'1f1b' is registered already"):
        register_schedule(Again)
    assert type(get_schedule("1f1b")).__name__ == "Schedule1F1B"


@pytest.mark.parametrize(("kind", "P", "M"), CASES)
def test_versions_kept_and_activations_stashed_are_what_the_lists_need(kind, P, M):
    sched = build_schedule(kind.name, P, M, STEPS)
    for s, acts in enumerate(sched.stages):
        trace = liveness_trace(acts)
        assert max(len(versions) for _, versions in trace) == kind.num_weight_versions, (s, trace)
        assert max(n for n, _ in trace) == kind.max_in_flight(P, M, s)


@pytest.mark.parametrize(("kind", "P", "M"), CASES)
def test_each_stage_delay_is_the_gap_between_gradient_and_update(kind, P, M):
    sched = build_schedule(kind.name, P, M, STEPS, with_comm=False)
    measured = []
    for acts in sched.stages:
        computed_on = {a.step: a.version for a in acts if a.op is Op.BACKWARD}
        gaps = {a.version - 1 - computed_on[a.step] for a in acts if a.op is Op.UPDATE}
        assert len(gaps) == 1, gaps
        measured.append(gaps.pop())
    assert kind.stage_delays(P) == measured
    assert kind.reference_delay == kind.delay == measured[0]
    assert [kind.weight_version(t) for t in range(STEPS)] == [
        next(a.version for a in sched.stages[0] if a.op is Op.FORWARD and a.step == t) for t in range(STEPS)
    ]


@pytest.mark.parametrize("kind", KINDS, ids=SCHEDULES)
def test_a_checkpoint_holds_the_versions_the_next_steps_run_on(kind):
    """After step ``t``'s update the newest version is ``t + 1``; the steps after it run on ``weight_version``."""
    for t in range(STEPS):
        newest = t + 1
        needed = {newest} | {kind.weight_version(t + 1)}
        assert {newest - lag for lag in kind.checkpoint_lags} == needed


@pytest.mark.parametrize(("kind", "P", "M"), CASES)
@pytest.mark.parametrize("run_starts", [(0,), (0, 2)])
def test_the_declared_flushes_are_where_the_lists_are_empty(kind, P, M, run_starts):
    sched = build_schedule(kind.name, P, M, STEPS, run_starts=run_starts)
    flushed = set()
    for r in range(1, STEPS):
        if all(
            max(k for k, a in enumerate(acts) if a.step < r) < min(k for k, a in enumerate(acts) if a.step >= r)
            for acts in sched.stages
        ):
            flushed.add(r)
    assert set(kind.flush_steps(STEPS, sched.run_starts)) == flushed


@pytest.mark.parametrize("kind", KINDS, ids=SCHEDULES)
def test_evaluation_is_the_same_for_every_kind(kind):
    assert kind.evaluation_actions(3, 1, 2, 4) == PipelineSchedule.evaluation_actions(3, 1, 2, 4)


def test_a_registered_subclass_is_a_schedule_everywhere(monkeypatch):
    """Adding a kind is one class: generation, the check and validation find it by name."""
    monkeypatch.setattr(ir, "_REGISTRY", dict(ir._REGISTRY))

    @register_schedule
    class Late2BW(Schedule2BW):
        """2BW under another name."""

        name = "late-2bw"

    check(build_schedule("late-2bw", 3, 3, 4, run_starts=(0, 2)))
    assert step_actions("late-2bw", 3, 4, 1, 2) == step_actions("2bw", 3, 4, 1, 2)
    with pytest.raises(ValueError, match="num_microbatches >= the number of pipeline stages"):
        validate("late-2bw", 3, 2)
