"""Simulator: closed-form bubble and throughput numbers, deadlock detection, rendering."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_async_pp.schedule import Action, Op, build_schedule, stage_footprint
from lightning_async_pp.schedule.simulate import DeadlockError, StageCosts, plot_gantt, render_gantt, simulate

EQUAL = StageCosts(forward=1.0, backward=1.0)
REALISTIC = StageCosts(forward=1.0, backward=2.0)
SHAPES = [(2, 2), (2, 5), (4, 4), (4, 8), (3, 7), (8, 8)]


@pytest.mark.parametrize("costs", [EQUAL, REALISTIC], ids=["b=f", "b=2f"])
@pytest.mark.parametrize("P,M", SHAPES)
def test_1f1b_bubble_closed_form(P, M, costs):
    # A flushed step takes (M + P - 1) (f + b) of which each stage works M (f + b).
    result = simulate(build_schedule("1f1b", P, M, 8, with_comm=False), costs)
    expected = (P - 1) / (M + P - 1)
    assert result.steady_bubble_fraction == pytest.approx([expected] * P, abs=1e-9)
    # Flushes make every step identical, so the whole run has the same bubble.
    assert result.bubble_fraction == pytest.approx([expected] * P, abs=1e-9)
    step = (M + P - 1) * (costs.forward + costs.backward)
    assert result.makespan == pytest.approx(8 * step)


@pytest.mark.parametrize("costs", [EQUAL, REALISTIC], ids=["b=f", "b=2f"])
@pytest.mark.parametrize("P,M", SHAPES)
def test_2bw_has_no_steady_state_bubble(P, M, costs):
    result = simulate(build_schedule("2bw", P, M, 12), costs)
    assert max(result.steady_bubble_fraction) < 1e-9
    # Only the ramp-up and drain of the run are idle: (P - 1)(f + b) per stage.
    per_mb = costs.forward + costs.backward
    assert result.makespan == pytest.approx((12 * M + P - 1) * per_mb)


@pytest.mark.parametrize("P,M", SHAPES)
def test_throughput_ratio(P, M):
    r1 = simulate(build_schedule("1f1b", P, M, 40, with_comm=False), REALISTIC)
    r2 = simulate(build_schedule("2bw", P, M, 40, with_comm=False), REALISTIC)
    ratio = (M + P - 1) / M
    assert r2.steady_throughput / r1.steady_throughput == pytest.approx(ratio, abs=1e-9)
    # Over the whole run only the one-off ramp-up of 2bw is lost.
    whole = r2.throughput / r1.throughput
    assert whole <= ratio + 1e-9
    assert whole == pytest.approx(ratio * 40 * M / (40 * M + P - 1))
    assert r2.throughput == pytest.approx(40 * M / r2.makespan)


def test_single_microbatch_latency_with_transfer():
    # One micro-batch crosses P stages forward and back: P (f + b) compute and
    # 2 (P - 1) transfers; every F/B in between waits.
    P, x = 4, 0.5
    for with_comm in (True, False):
        result = simulate(build_schedule("1f1b", P, 1, 1, with_comm=with_comm), REALISTIC, transfer=x)
        assert result.makespan == pytest.approx(P * 3.0 + 2 * (P - 1) * x)
        starts = {(ev.action.op, ev.action.stage): ev.start for tl in result.timelines for ev in tl}
        assert starts[(Op.FORWARD, 1)] == pytest.approx(1.0 + x)
        assert starts[(Op.BACKWARD, P - 2)] == pytest.approx(P * 1.0 + (P - 1) * x + 2.0 + x)


def test_comm_does_not_change_compute_times():
    costs = [StageCosts(1.0, 2.0, 0.3), StageCosts(1.5, 2.5, 0.1), StageCosts(0.5, 1.0, 0.2)]
    a = simulate(build_schedule("2bw", 3, 4, 5, run_starts=(0, 3)), costs, transfer=0.2)
    b = simulate(build_schedule("2bw", 3, 4, 5, with_comm=False, run_starts=(0, 3)), costs, transfer=0.2)

    def times(r):
        return [[(str(e.action), e.start, e.end) for e in tl if e.action.is_compute] for tl in r.timelines]

    assert times(a) == times(b)
    assert a.busy == pytest.approx(b.busy)
    # A receive occupies its stage while it waits: busy excludes it.
    recv = [e for e in a.timelines[1] if e.action.op is Op.RECV_F]
    assert recv and all(e.end >= e.start for e in recv)
    assert a.busy[1] == pytest.approx(5 * 4 * (1.5 + 2.5) + 5 * 0.1)


def test_uneven_stages_bottleneck():
    # The slowest stage sets the 2bw steady-state rate; the others idle.
    costs = [StageCosts(1.0, 2.0), StageCosts(2.0, 4.0), StageCosts(1.0, 2.0)]
    result = simulate(build_schedule("2bw", 3, 6, 12), costs)
    assert result.steady_throughput == pytest.approx(1 / 6.0)
    assert result.steady_bubble_fraction[1] < 1e-9
    assert result.steady_bubble_fraction[0] == pytest.approx(0.5)


@pytest.mark.parametrize("kind,P,M", [("2bw", 4, 4), ("2bw", 3, 7), ("1f1b", 4, 2), ("1f1b", 3, 6)])
def test_peaks_match_footprint(kind, P, M):
    result = simulate(build_schedule(kind, P, M, 5, run_starts=(0, 2)), REALISTIC)
    for s in range(P):
        fp = stage_footprint(kind, P, M, s)
        assert result.peak_in_flight[s] == fp.max_in_flight
        assert result.peak_versions_alive[s] == fp.weight_versions


def test_deadlock_is_reported_with_the_stuck_actions():
    sched = build_schedule("1f1b", 2, 3, 1, with_comm=False)
    # Stage 1 starts with micro-batch 2, which stage 0 sends only after B0 returns.
    stuck = [Action(1, op, 0, m, 0, 3) for m in (2, 0, 1) for op in (Op.FORWARD, Op.BACKWARD)]
    broken = dataclasses.replace(sched, stages=[sched.stages[0], stuck + [Action(1, Op.UPDATE, 0, -1, 1, 3)]])
    with pytest.raises(DeadlockError) as err:
        simulate(broken, EQUAL)
    msg = str(err.value)
    assert "stage 0 waits at 0B0" in msg and "stage 1 waits at 1F2" in msg
    assert "activation of step 0 micro-batch 2 from stage 0" in msg


def test_cost_validation():
    sched = build_schedule("2bw", 2, 2, 1)
    with pytest.raises(ValueError, match="costs for 3 stages but the schedule has 2"):
        simulate(sched, [EQUAL] * 3)
    with pytest.raises(ValueError, match="negative"):
        simulate(sched, StageCosts(1.0, -1.0))
    with pytest.raises(ValueError, match="transfer"):
        simulate(sched, EQUAL, transfer=-1.0)


def test_render_gantt():
    result = simulate(build_schedule("2bw", 2, 2, 2), EQUAL)
    text = render_gantt(result)
    lines = text.splitlines()
    assert lines[0].startswith("2bw: makespan 10s")
    # 3 chars per unit: stage 0 forwards 0 and 1 back to back, then waits for B0.
    assert lines[1].startswith("stage 0: F0-F1-...B0-")
    assert lines[2].startswith("stage 1: ...F0-B0-F1-B1-")
    assert len({len(line) for line in lines[1:]}) == 1
    assert result.gantt() == text


def test_plot_gantt_needs_matplotlib_or_draws(tmp_path):
    result = simulate(build_schedule("1f1b", 2, 2, 1), EQUAL)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"pip install 'lightning-async-pp\[bench\]'"):
            plot_gantt(result, tmp_path / "g.png")
    else:
        plot_gantt(result, tmp_path / "g.png")
        assert (tmp_path / "g.png").stat().st_size > 0


def test_per_action_durations_override_the_stage_costs():
    costs = StageCosts(forward=1.0, backward=2.0, update=0.5)
    schedule = build_schedule("2bw", 2, 4, 4)
    base = simulate(schedule, costs)
    # Durations equal to the costs change nothing; names are the actions' own (`str(action)`).
    same = {str(a): costs.of(a.op) for acts in schedule.stages for a in acts if a.is_compute}
    assert "1B5" in same and simulate(schedule, costs, durations=same).makespan == pytest.approx(base.makespan)
    # One slow backward on the last stage: its stage is the bottleneck, so everything after it shifts by the
    # extra time, and the action itself takes exactly what it was given.
    slow = simulate(schedule, costs, durations={"1B5": 2.0 + 3.0})
    assert slow.makespan == pytest.approx(base.makespan + 3.0)
    event = next(ev for ev in slow.timelines[1] if str(ev.action) == "1B5")
    assert event.end - event.start == pytest.approx(5.0)
    # A slow action on the stage with slack hides partly in the other's work: never more than the extra time.
    hidden = simulate(schedule, [StageCosts(1.0, 2.0), StageCosts(1.5, 3.0)], durations={"0F6": 1.0 + 0.5})
    loose = simulate(schedule, [StageCosts(1.0, 2.0), StageCosts(1.5, 3.0)])
    assert loose.makespan <= hidden.makespan <= loose.makespan + 0.5
