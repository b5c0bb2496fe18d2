"""Schedules as data: per-stage invariants, segments, printing, cross-stage consistency."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from lightning_async_pp.schedule import (
    SCHEDULES,
    Action,
    Op,
    build_schedule,
    check,
    drain_actions,
    evaluation_actions,
    liveness_trace,
    posting_plan,
    stage_footprint,
    step_actions,
    validate,
    weight_buffer,
)
from lightning_async_pp.schedule.simulate import StageCosts, simulate


def configs():
    """(kind, P, M) covering M = P, 2P, P+1 and, for 1f1b, M < P."""
    for P in (1, 2, 3, 4, 8):
        for M in sorted({P, 2 * P, P + 1, max(1, P // 2), 1}):
            for kind in SCHEDULES:
                if kind == "2bw" and M < P:
                    continue
                yield kind, P, M


CONFIGS = list(configs())
RUN_STARTS = [(0,), (0, 2), (0, 1, 3, 4)]
NUM_STEPS = 6


def compute(actions):
    return [a for a in actions if a.is_compute]


def labels(actions):
    """Compact per-stage labels without the stage prefix: F3, B0, U1."""
    return [str(a)[len(str(a.stage)) :] for a in compute(actions)]


# --------------------------------------------------------------------------- validation


def test_validate_errors():
    with pytest.raises(ValueError, match=r"unknown pipeline schedule 'gpipe'.*'2bw', '1f1b'"):
        validate("gpipe", 2, 4)
    with pytest.raises(ValueError, match="num_stages must be >= 1"):
        validate("1f1b", 0, 4)
    with pytest.raises(ValueError, match="num_microbatches must be >= 1"):
        validate("1f1b", 2, 0)
    with pytest.raises(ValueError, match=r"num_microbatches >= 4") as err:
        validate("2bw", 4, 3)
    assert "num_microbatches=3" in str(err.value)
    with pytest.raises(ValueError, match="num_microbatches"):
        build_schedule("2bw", 8, 4, 2)
    validate("2bw", 4, 4)
    validate("1f1b", 4, 1)  # a flushed schedule does not need M >= P
    with pytest.raises(ValueError, match="stage must be < num_stages"):
        step_actions("2bw", 2, 2, stage=2, step=0)
    with pytest.raises(ValueError, match="precedes the start of its run"):
        step_actions("2bw", 2, 2, stage=0, step=1, run_start=2)


# --------------------------------------------------------------------------- per-stage invariants


@pytest.mark.parametrize("kind,P,M", CONFIGS)
@pytest.mark.parametrize("run_starts", RUN_STARTS)
def test_per_stage_invariants(kind, P, M, run_starts):
    sched = build_schedule(kind, P, M, NUM_STEPS, run_starts=run_starts)
    check(sched)
    for s, acts in enumerate(sched.stages):
        ops = compute(acts)
        fwd = {(a.step, a.microbatch): k for k, a in enumerate(ops) if a.op is Op.FORWARD}
        bwd = {(a.step, a.microbatch): k for k, a in enumerate(ops) if a.op is Op.BACKWARD}
        every = {(t, m) for t in range(NUM_STEPS) for m in range(M)}
        # Exactly once each (the dicts would hide duplicates, so count too).
        assert sum(a.op is Op.FORWARD for a in ops) == len(every) and fwd.keys() == every
        assert sum(a.op is Op.BACKWARD for a in ops) == len(every) and bwd.keys() == every
        version = {a.step: a.version for a in ops if a.op is not Op.UPDATE}
        for key in every:
            assert fwd[key] < bwd[key], f"stage {s}: backward of {key} before its forward"
            assert ops[fwd[key]].version == ops[bwd[key]].version
        # Weight versions: 2bw is one step stale, 1f1b is not.
        for t, v in version.items():
            assert v == (t - 1 if kind == "2bw" else t)

        in_flight, peak = set(), 0
        for a in ops:
            if a.op is Op.FORWARD:
                in_flight.add((a.step, a.microbatch))
            elif a.op is Op.BACKWARD:
                in_flight.discard((a.step, a.microbatch))
            peak = max(peak, len(in_flight))
        assert peak <= P - s
        assert peak == stage_footprint(kind, P, M, s).max_in_flight
        assert max(len(v) for _, v in liveness_trace(acts)) == stage_footprint(kind, P, M, s).weight_versions

        updates = [(k, a) for k, a in enumerate(ops) if a.op is Op.UPDATE]
        assert [a.step for _, a in updates] == list(range(NUM_STEPS))
        for k, u in updates:
            t = u.step
            assert u.version == t + 1
            assert k > max(bwd[(t, m)] for m in range(M))
            grad_version = version[t]
            if kind == "2bw":
                # Applied to version t, one version after the one it was computed on.
                assert (u.version - 1) - grad_version == 1
                if t + 2 < NUM_STEPS:
                    assert k < min(fwd[(t + 2, m)] for m in range(M))
            else:
                assert u.version - 1 == grad_version
                if t + 1 < NUM_STEPS:
                    assert k < min(fwd[(t + 1, m)] for m in range(M))

        if kind == "1f1b":
            # Flushed: everything of step t before anything of step t+1.
            steps = [a.step for a in ops]
            assert steps == sorted(steps)


@pytest.mark.parametrize("P,M", [(P, M) for kind, P, M in CONFIGS if kind == "2bw"])
def test_2bw_two_buffers_suffice(P, M):
    """Replaying the updates into two buffers (v % 2), every F/B finds its version there."""
    sched = build_schedule("2bw", P, M, NUM_STEPS, with_comm=False, run_starts=(0, 3))
    for acts in sched.stages:
        buffers = [0, -1]  # both hold w[0]; version -1 is w[0] too
        alive = []
        for a in acts:
            if a.op is Op.UPDATE:
                buffers[weight_buffer(a.version)] = a.version
            else:
                assert buffers[weight_buffer(a.version)] == a.version, a
        for _, versions in liveness_trace(acts):
            alive.append(len(versions))
        assert max(alive) <= 2


@pytest.mark.parametrize("P,M", [(2, 2), (3, 3), (4, 5), (8, 8)])
def test_2bw_never_flushes_inside_a_run(P, M):
    """At every step boundary inside a run, stage s still has P-1-s micro-batches in
    flight (stage 0: P-1 >= 1), while 1f1b is empty there."""
    steps = 5
    for kind, expect in (("2bw", lambda s: P - 1 - s), ("1f1b", lambda s: 0)):
        sched = build_schedule(kind, P, M, steps, with_comm=False)
        for s in range(P):
            in_flight = set()
            for t, seg in enumerate(sched.segments(s)[:steps]):
                for a in seg:
                    if a.op is Op.FORWARD:
                        in_flight.add((a.step, a.microbatch))
                    elif a.op is Op.BACKWARD:
                        in_flight.remove((a.step, a.microbatch))
                if t < steps - 1:
                    assert len(in_flight) == expect(s), (kind, s, t)
            assert len(in_flight) == expect(s)  # before the drain
    if P > 1:
        seg = step_actions("2bw", P, M, 0, 2, with_comm=False)
        # Stage 0's segment mixes backwards of the previous step with forwards of this one.
        assert {a.step for a in seg if a.op is Op.BACKWARD} == {1, 2}


# --------------------------------------------------------------------------- hand-written orders


def test_2bw_order_by_hand():
    # P=2, M=2. Stage 0 warms up with W = 1 forward, then F(i) B(i-1); step t's
    # update follows the backward of its last micro-batch 2t+1. Stage 1 (W = 0)
    # alternates F(i) B(i). Micro-batches of step t use version t-1.
    sched = build_schedule("2bw", 2, 2, 3, with_comm=False)
    assert labels(sched.stages[0]) == "F0 F1 B0 F2 B1 U0 F3 B2 F4 B3 U1 F5 B4 B5 U2".split()
    assert labels(sched.stages[1]) == "F0 B0 F1 B1 U0 F2 B2 F3 B3 U1 F4 B4 F5 B5 U2".split()
    assert [a.version for a in compute(sched.stages[0])[:5]] == [-1, -1, -1, 0, -1]

    # P=3, M=3, stage 0 (W = 2): F0 F1 F2 B0 F3 B1 F4 B2 U0 F5 B3 ...
    s0 = build_schedule("2bw", 3, 3, 2, with_comm=False).stages[0]
    assert labels(s0) == "F0 F1 F2 B0 F3 B1 F4 B2 U0 F5 B3 B4 B5 U1".split()


def test_1f1b_order_by_hand():
    # P=3, M=4: stage 0 warms up with 2 forwards, stage 1 with 1, stage 2 none;
    # each step ends with its cool-down backwards and the update (flush).
    sched = build_schedule("1f1b", 3, 4, 2, with_comm=False)
    assert labels(sched.stages[0])[:10] == "F0 F1 F2 B0 F3 B1 B2 B3 U0 F4".split()
    assert labels(sched.stages[1])[:9] == "F0 F1 B0 F2 B1 F3 B2 B3 U0".split()
    assert labels(sched.stages[2])[:9] == "F0 B0 F1 B1 F2 B2 F3 B3 U0".split()
    # M < P: stage 0 cannot fill its warm-up and simply does all forwards first.
    assert labels(build_schedule("1f1b", 4, 2, 1).stages[0]) == "F0 F1 B0 B1 U0".split()


def test_communication_lowering_by_hand():
    seg = step_actions("2bw", 3, 3, stage=1, step=0)
    # Stage 1: W = 1; receive before each F/B, send right after it, update after the send.
    assert [str(a) for a in seg] == ("1RF0 1F0 1SF0 1RF1 1F1 1SF1 1RB0 1B0 1SB0 1RF2 1F2 1SF2 1RB1 1B1 1SB1".split())
    first, last = step_actions("2bw", 3, 3, 0, 0), step_actions("2bw", 3, 3, 2, 0)
    assert not any(a.op in (Op.RECV_F, Op.SEND_B) for a in first)
    assert not any(a.op in (Op.SEND_F, Op.RECV_B) for a in last)
    assert [a.peer for a in seg[:3]] == [0, None, 2]
    assert not any(a.is_comm for a in build_schedule("2bw", 1, 2, 3).stages[0])


def test_evaluation_by_hand():
    # Forwards only, micro-batch after micro-batch: stage 1 receives micro-batch i, forwards it and sends it on
    # before micro-batch i + 1, and posts the receive of i + 1 as soon as i arrived (the transfer overlaps F i).
    seg = evaluation_actions(3, stage=1, index=0, num_microbatches=3)
    assert [str(a) for a in seg] == "1RF-1.0 1F-1.0 1SF-1.0 1RF-1.1 1F-1.1 1SF-1.1 1RF-1.2 1F-1.2 1SF-1.2".split()
    assert all(a.version == 0 for a in seg)
    plan = posting_plan(seg)
    assert plan.start == {Op.RECV_F}
    assert [str(a) for a, post in zip(seg, plan.post_next) if post] == ["1RF-1.0", "1RF-1.1"]
    assert [str(a) for a in evaluation_actions(3, 0, 1, 2)] == "0F-2.0 0SF-2.0 0F-2.1 0SF-2.1".split()
    assert [str(a) for a in evaluation_actions(3, 2, 0)] == "2RF-1.0 2F-1.0".split()
    assert [str(a) for a in evaluation_actions(1, 0, 0, 2)] == "0F-1.0 0F-1.1".split()
    with pytest.raises(ValueError, match="num_microbatches"):
        evaluation_actions(2, 0, 0, 0)


# --------------------------------------------------------------------------- segments and drains


@pytest.mark.parametrize("kind,P,M", CONFIGS)
def test_segments_concatenate_and_drain(kind, P, M):
    steps = 4
    sched = build_schedule(kind, P, M, steps, run_starts=(0, 2))
    for s in range(P):
        segs = sched.segments(s)
        assert len(segs) == steps + 2  # two runs: 2 steps + drain each
        assert [a for seg in segs for a in seg] == sched.stages[s]
        # Assemble from the public per-segment functions like a runtime would.
        own = []
        for run_start, run in ((0, range(0, 2)), (2, range(2, 4))):
            for t in run:
                own += step_actions(kind, P, M, s, t, run_start=run_start)
            own += drain_actions(kind, P, M, s, run[-1], run_start=run_start)
        assert own == sched.stages[s]

    single = build_schedule(kind, P, M, steps, with_comm=False)
    for s in range(P):
        drain = single.segments(s)[-1]
        assert drain == drain_actions(kind, P, M, s, steps - 1, with_comm=False)
        if kind == "1f1b":
            assert drain == []
            continue
        # Outstanding backwards = the stage's warm-up depth, all from the last
        # step, in order, then that step's update; nothing else.
        before = [a for seg in single.segments(s)[:-1] for a in seg]
        done = {(a.step, a.microbatch) for a in before if a.op is Op.BACKWARD}
        outstanding = sorted((t, m) for t in range(steps) for m in range(M) if (t, m) not in done)
        assert len(outstanding) == P - 1 - s
        expected = [Action(s, Op.BACKWARD, t, m, t - 1) for t, m in outstanding]
        expected += [Action(s, Op.UPDATE, steps - 1, -1, steps)] if outstanding else []
        assert drain == expected
        assert sum(a.op is Op.UPDATE for a in before) == steps - (1 if outstanding else 0)


def test_first_segment_of_a_restarted_run_warms_up_again():
    # After a drain at step 2, stage 0 of P=3 starts step 3 with two forwards
    # (warm-up) instead of backwards of step 2.
    seg = step_actions("2bw", 3, 4, 0, 3, run_start=3, with_comm=False)
    assert labels([*seg]) == "F12 F13 F14 B12 F15 B13".split()
    cont = step_actions("2bw", 3, 4, 0, 3, run_start=0, with_comm=False)
    assert labels(cont) == "F12 B10 F13 B11 U2 F14 B12 F15 B13".split()


# --------------------------------------------------------------------------- printing


def test_str():
    assert str(Action(0, Op.FORWARD, 1, 1, 0, num_microbatches=2)) == "0F3"
    assert str(Action(1, Op.RECV_B, 1, 0, 0, num_microbatches=2)) == "1RB2"
    assert str(Action(0, Op.UPDATE, 1, -1, 2, num_microbatches=2)) == "0U1"
    assert str(Action(0, Op.FORWARD, 1, 3, 0)) == "0F1.3"  # M unknown
    assert Action(0, Op.FORWARD, 1, 1, 0, num_microbatches=2) == Action(0, Op.FORWARD, 1, 1, 0)

    text = str(build_schedule("2bw", 2, 2, 3))
    rows = {line.split(":")[0]: line for line in text.splitlines() if line.startswith("stage")}
    # Derived from the definition: stage 0 warms up with one forward, stage 1 with none.
    assert rows["stage 0"].split(":", 1)[1].split()[:4] == ["0F0", "0F1", "0B0", "|"]
    assert rows["stage 1"].split(":", 1)[1].split()[:5] == ["1F0", "1B0", "1F1", "1B1", "1U0"]
    assert "0RB" not in text  # compute only by default
    assert "0RB0" in build_schedule("2bw", 2, 2, 3).format(with_comm=True)
    assert "2bw" in text and "1f1b" in str(build_schedule("1f1b", 2, 2, 1))


# --------------------------------------------------------------------------- check() catches errors


def _mutated(sched, stage, fn):
    stages = [list(a) for a in sched.stages]
    stages[stage] = fn(stages[stage])
    return dataclasses.replace(sched, stages=stages)


def _replace_if(action, target, **changes):
    return dataclasses.replace(action, **changes) if action == target else action


def _swap(acts, x, y):
    i, j = acts.index(x), acts.index(y)
    acts[i], acts[j] = acts[j], acts[i]
    return acts


@pytest.mark.parametrize(
    "mutate,message",
    [
        # A backward moved before its forward.
        (lambda a: _swap(a, Action(0, Op.FORWARD, 0, 0, -1), Action(0, Op.BACKWARD, 0, 0, -1)), "precedes its forward"),
        # Update too early: before the last backward of its step.
        (lambda a: _swap(a, Action(0, Op.UPDATE, 0, -1, 1), Action(0, Op.BACKWARD, 0, 3, -1)), "precedes the backward"),
        # Wrong weight version on a forward.
        (lambda a: [_replace_if(x, Action(0, Op.FORWARD, 0, 1, -1), version=0) for x in a], "uses version 0"),
        # A micro-batch forwarded twice.
        (lambda a: a + [Action(0, Op.FORWARD, 0, 0, -1)], "forwarded twice"),
        # An extra warm-up forward: too many in flight.
        (lambda a: _swap(a, Action(0, Op.FORWARD, 0, 3, -1), Action(0, Op.BACKWARD, 0, 0, -1)), "in flight"),
    ],
)
def test_check_rejects_broken_schedules(mutate, message):
    sched = build_schedule("2bw", 3, 4, 3, with_comm=False)
    check(sched)
    with pytest.raises(AssertionError, match=message):
        check(_mutated(sched, 0, mutate))


def test_check_detects_cross_stage_deadlock():
    # P=2, M=3, 1f1b. Stage 0 runs F0 F1 B0 F2 B1 B2: it only produces F2 after
    # B0 came back. A stage 1 that starts with F2 is fine on its own but waits
    # for F2 while stage 0 waits for B0.
    sched = build_schedule("1f1b", 2, 3, 1, with_comm=False)
    reordered = [Action(1, op, 0, m, 0) for m in (1, 0, 2) for op in (Op.FORWARD, Op.BACKWARD)]
    check(dataclasses.replace(sched, stages=[sched.stages[0], reordered + [Action(1, Op.UPDATE, 0, -1, 1)]]))
    stuck = [Action(1, op, 0, m, 0) for m in (2, 0, 1) for op in (Op.FORWARD, Op.BACKWARD)]
    broken = dataclasses.replace(sched, stages=[sched.stages[0], stuck + [Action(1, Op.UPDATE, 0, -1, 1)]])
    with pytest.raises(AssertionError, match=r"deadlock: stage 0 waits at 0B0; stage 1 waits at 1F0\.2"):
        check(broken)


# --------------------------------------------------------------------------- cross-stage consistency


@pytest.mark.parametrize("kind,P,M", CONFIGS)
@pytest.mark.parametrize("with_comm", [True, False])
def test_simulation_runs_every_schedule(kind, P, M, with_comm):
    for run_starts in RUN_STARTS:
        sched = build_schedule(kind, P, M, NUM_STEPS, with_comm=with_comm, run_starts=run_starts)
        result = simulate(sched, StageCosts(forward=1.0, backward=2.0, update=0.5), transfer=0.25)
        assert all(len(tl) == len(acts) for tl, acts in zip(result.timelines, sched.stages))
        # Cross-stage order: F on s after F on s-1, B on s after B on s+1.
        end = {}
        for tl in result.timelines:
            for ev in tl:
                end[(ev.action.op, ev.action.stage, ev.action.step, ev.action.microbatch)] = ev
        for (op, s, t, m), ev in end.items():
            if op is Op.FORWARD and s > 0:
                assert ev.start >= end[(op, s - 1, t, m)].end + 0.25
            if op is Op.BACKWARD and s < P - 1:
                assert ev.start >= end[(op, s + 1, t, m)].end + 0.25


def test_configs_cover_the_brief():
    kinds = {(k, P, M) for k, P, M in CONFIGS}
    for P, kind in itertools.product((1, 2, 3, 4, 8), SCHEDULES):
        for M in (P, 2 * P, P + 1):
            assert (kind, P, M) in kinds
    assert any(k == "1f1b" and M < P for k, P, M in CONFIGS)


@pytest.mark.parametrize("kind", SCHEDULES)
@pytest.mark.parametrize("P", [2, 3, 4, 6])
@pytest.mark.parametrize("run_start", [0, 2])
def test_gradients_received_before_each_forward_follow_the_action_lists(kind, P, run_start):
    """The closed form against a scan of the stage's own action lists: the newest gradient received before
    each forward (what lets the next stage release its sends)."""
    from lightning_async_pp.schedule import gradients_received_before_forward

    for M in sorted({P, P + 1, 2 * P}):
        for stage in range(P - 1):
            last, checked = None, 0
            for step in range(run_start, run_start + 5):
                for a in step_actions(kind, P, M, stage, step, run_start):
                    if a.op is Op.RECV_B:
                        last = (a.step, a.microbatch)
                    elif a.op is Op.FORWARD:
                        got = gradients_received_before_forward(kind, P, M, stage, a.step, a.microbatch, run_start)
                        assert got == last, (kind, P, M, stage, a)
                        checked += last is not None
            assert checked > 0
