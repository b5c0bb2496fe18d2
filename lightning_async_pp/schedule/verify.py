"""Schedule verification: the invariants of :func:`check`, the liveness of one stage's list, and the
dependency-respecting execution order (:func:`run_in_order`) that the check and the simulator share.

A cross-stage *event* is the arrival of a micro-batch's activation (forward) or gradient (backward) at a
stage, keyed ``(forward, receiving stage, step, microbatch)``: :func:`needed_event` gives the one an
action waits for, :func:`provided_event` the one it makes available.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from lightning_async_pp.schedule.generate import Schedule
from lightning_async_pp.schedule.ir import Action, Op, PipelineSchedule, get_schedule, validate, weight_version

__all__ = ["check", "liveness_trace", "needed_event", "provided_event", "run_in_order"]


def check(schedule: Schedule) -> None:
    """Verify a schedule's invariants; raise ``AssertionError`` naming the first violation.

    Per stage: every micro-batch forwarded and backwarded exactly once, backward
    after forward, both with the kind's weight version; explicit send/recv placed
    around each F/B; one ``UPDATE`` per step after the step's last backward and
    before the first forward that needs its result, applying the gradient one
    version later ("2bw") or on the same version ("1f1b"); at most ``P - s``
    micro-batches in flight and at most 2 ("2bw") / 1 ("1f1b") weight versions
    alive, read from the right buffer; flushes at run starts (every step for
    "1f1b"). Across stages: the lists run to completion against each other.

    Args:
        schedule: a schedule of one of :data:`~lightning_async_pp.schedule.SCHEDULES`.
    """
    validate(schedule.kind, schedule.num_stages, schedule.num_microbatches)
    if len(schedule.stages) != schedule.num_stages:
        _fail(f"schedule has {len(schedule.stages)} stage lists for {schedule.num_stages} stages")
    for s in range(schedule.num_stages):
        _check_stage(schedule, s)
    _check_cross_stage(schedule)


def liveness_trace(actions: Sequence[Action]) -> list[tuple[int, frozenset[int]]]:
    """After each action of one stage: (micro-batches in flight, weight versions alive).

    A micro-batch is in flight between its forward and its backward (its
    activations are stashed). Alive versions are those of the in-flight
    micro-batches plus the newest one produced (initially 0).

    Args:
        actions: the list of one stage, in order.
    """
    newest = 0
    in_flight: dict[tuple[int, int], int] = {}
    per_version: dict[int, int] = {}  # version -> in-flight micro-batches using it
    state = (0, frozenset({newest}))
    out = []
    for a in actions:
        if a.is_compute:
            key = (a.step, a.microbatch)
            if a.op is Op.FORWARD:
                in_flight[key] = a.version
                per_version[a.version] = per_version.get(a.version, 0) + 1
            elif a.op is Op.BACKWARD and key in in_flight:
                v = in_flight.pop(key)
                per_version[v] -= 1
                if not per_version[v]:
                    del per_version[v]
            elif a.op is Op.UPDATE:
                newest = max(newest, a.version)
            state = (len(in_flight), frozenset(per_version).union((newest,)))
        out.append(state)
    return out


def needed_event(a: Action, num_stages: int, with_comm: bool) -> tuple | None:
    """Key of the cross-stage event ``a`` must wait for, or None.

    Args:
        a: the action.
        num_stages: ``P``.
        with_comm: whether the lists have explicit send/recv actions: then a receive waits, otherwise
            the forward or backward itself.
    """
    if with_comm:
        if a.op in (Op.RECV_F, Op.RECV_B):
            return (a.op is Op.RECV_F, a.stage, a.step, a.microbatch)
        return None
    if a.op is Op.FORWARD and a.stage > 0:
        return (True, a.stage, a.step, a.microbatch)
    if a.op is Op.BACKWARD and a.stage < num_stages - 1:
        return (False, a.stage, a.step, a.microbatch)
    return None


def provided_event(a: Action, num_stages: int, with_comm: bool) -> tuple | None:
    """Key of the cross-stage event that finishing ``a`` makes available, or None.

    Args:
        a: the action.
        num_stages: ``P``.
        with_comm: whether the lists have explicit send/recv actions: then a send provides, otherwise
            the forward or backward itself.
    """
    forward = a.op in (Op.FORWARD, Op.SEND_F)
    if with_comm != a.is_comm or a.op in (Op.RECV_F, Op.RECV_B, Op.UPDATE):
        return None
    dst = a.stage + 1 if forward else a.stage - 1
    if not 0 <= dst < num_stages:
        return None
    return (forward, dst, a.step, a.microbatch)


def run_in_order(
    sched: Schedule, visit: Callable[[int, Action, tuple | None, tuple | None], None]
) -> list[tuple[int, Action]]:
    """Execute the per-stage lists against each other, ignoring time.

    Calls ``visit`` for every action in an order that respects each stage's list and the cross-stage
    data dependencies (:func:`needed_event`, :func:`provided_event`). Returns the ``(stage, action)``
    pairs left blocked (empty unless the lists deadlock).

    Args:
        sched: the schedule; with or without send/recv actions, as its lists have them.
        visit: called as ``visit(stage, action, needed_key, provided_key)``.
    """
    P = sched.num_stages
    # Go by the lists rather than the flag, so hand-made lists time correctly either way.
    comm = any(a.is_comm for acts in sched.stages for a in acts)
    pos = [0] * P
    done: set[tuple] = set()
    waiting: dict[tuple, int] = {}  # key -> the stage blocked on it
    ready = list(range(P - 1, -1, -1))
    while ready:
        s = ready.pop()
        acts = sched.stages[s]
        while pos[s] < len(acts):
            a = acts[pos[s]]
            need = needed_event(a, P, comm)
            if need is not None and need not in done:
                waiting[need] = s
                break
            made = provided_event(a, P, comm)
            visit(s, a, need, made)
            if made is not None:
                done.add(made)
                if (w := waiting.pop(made, None)) is not None:
                    ready.append(w)
            pos[s] += 1
    return [(s, sched.stages[s][pos[s]]) for s in range(P) if pos[s] < len(sched.stages[s])]


def _fail(msg: str) -> None:
    raise AssertionError(msg)


def _check_stage(sched: Schedule, s: int) -> None:
    P, kind = sched.num_stages, sched.kind
    acts = sched.stages[s]
    where = f"{kind} P={P} M={sched.num_microbatches} stage {s}"
    fwd, bwd = _check_microbatches(sched, s, where)

    # Communication lowering: RECV right before its F/B, SEND right after.
    has_comm = any(a.is_comm for a in acts)
    if has_comm != (sched.with_comm and P > 1):
        _fail(f"{where}: with_comm={sched.with_comm} but the list {'has' if has_comm else 'has no'} send/recv")
    if sched.with_comm:
        _check_comm(acts, P, where)
    _check_updates(sched, acts, fwd, bwd, where)
    _check_memory(get_schedule(kind), P - s, acts, where)
    _check_flushes(sched, acts, where)


def _check_microbatches(sched: Schedule, s: int, where: str) -> tuple[dict, dict]:
    """Every micro-batch forwarded and backwarded once, backward after forward, with the kind's version.

    Returns the positions of the forwards and of the backwards, keyed ``(step, microbatch)``.
    """
    expected = {(t, m) for t in range(sched.num_steps) for m in range(sched.num_microbatches)}
    fwd: dict[tuple[int, int], int] = {}
    bwd: dict[tuple[int, int], int] = {}
    for k, a in enumerate(sched.stages[s]):
        if a.stage != s:
            _fail(f"{where}: action {a!r} at position {k} belongs to stage {a.stage}")
        if a.op is Op.UPDATE:
            continue
        key = (a.step, a.microbatch)
        if key not in expected:
            _fail(f"{where}: {a} refers to micro-batch {key} outside the schedule")
        if a.version != weight_version(sched.kind, a.step):
            _fail(f"{where}: {a} uses version {a.version}, expected {weight_version(sched.kind, a.step)}")
        if a.op is Op.FORWARD:
            if key in fwd:
                _fail(f"{where}: micro-batch {key} forwarded twice (positions {fwd[key]} and {k})")
            fwd[key] = k
        elif a.op is Op.BACKWARD:
            if key in bwd:
                _fail(f"{where}: micro-batch {key} backwarded twice (positions {bwd[key]} and {k})")
            if key not in fwd:
                _fail(f"{where}: backward {a} at position {k} precedes its forward")
            bwd[key] = k
    for name, seen in (("forwarded", fwd), ("backwarded", bwd)):
        if missing := sorted(expected - seen.keys()):
            _fail(f"{where}: micro-batches (step, mb) never {name}: {missing[:8]}")
    return fwd, bwd


def _check_updates(sched: Schedule, acts: list[Action], fwd: dict, bwd: dict, where: str) -> None:
    """One update per step, in order, after the step's last backward, before the forwards that need the
    version it produces, applying the gradient with the kind's delay."""
    M = sched.num_microbatches
    updates = [(k, a) for k, a in enumerate(acts) if a.op is Op.UPDATE]
    if [a.step for _, a in updates] != list(range(sched.num_steps)):
        got = [a.step for _, a in updates]
        _fail(f"{where}: updates are for steps {got}, expected 0..{sched.num_steps - 1} in order")
    lag = get_schedule(sched.kind).delay  # steps between the version used and the newest one
    for k, u in updates:
        t = u.step
        if u.version != t + 1:
            _fail(f"{where}: {u} produces version {u.version}, expected {t + 1}")
        last_b = max(bwd[(t, m)] for m in range(M))
        if k < last_b:
            _fail(f"{where}: {u} at position {k} precedes the backward of step {t} at position {last_b}")
        grad_version = acts[last_b].version
        if u.version - 1 - grad_version != lag:
            _fail(
                f"{where}: {u} applies a gradient computed on version {grad_version} to version "
                f"{u.version - 1}; expected a delay of {lag}"
            )
        nxt = t + 1 + lag
        if nxt < sched.num_steps and k > (first_f := min(fwd[(nxt, m)] for m in range(M))):
            _fail(f"{where}: {u} at position {k} comes after the first forward of step {nxt} (position {first_f})")


def _check_memory(kind: PipelineSchedule, max_in_flight: int, acts: list[Action], where: str) -> None:
    """Activations of at most ``max_in_flight`` (``P - s``) micro-batches, at most the kind's weight versions
    alive, and each version read from the buffer holding it."""
    limit_versions = kind.num_weight_versions
    for k, (n, versions) in enumerate(liveness_trace(acts)):
        if n > max_in_flight:
            _fail(f"{where}: {n} micro-batches in flight after {acts[k]} (position {k}), limit {max_in_flight}")
        if len(versions) > limit_versions:
            _fail(f"{where}: versions {sorted(versions)} alive after {acts[k]} (position {k}), limit {limit_versions}")
    buffers = {kind.buffer_of(v): v for v in range(0, -limit_versions, -1)}  # all start as w[0]
    for k, a in enumerate(acts):
        if a.op is Op.UPDATE:
            buffers[kind.buffer_of(a.version)] = a.version
        elif a.op in (Op.FORWARD, Op.BACKWARD) and buffers[kind.buffer_of(a.version)] != a.version:
            _fail(
                f"{where}: {a} at position {k} needs version {a.version} but buffer "
                f"{kind.buffer_of(a.version)} holds {buffers[kind.buffer_of(a.version)]}"
            )


def _check_flushes(sched: Schedule, acts: list[Action], where: str) -> None:
    """Nothing of a run may be left when the next run starts; 1f1b flushes after every step."""
    boundaries = get_schedule(sched.kind).flush_steps(sched.num_steps, sched.run_starts)
    for r in boundaries:
        last_before = max(k for k, a in enumerate(acts) if a.step < r)
        first_after = min(k for k, a in enumerate(acts) if a.step >= r)
        if last_before > first_after:
            _fail(f"{where}: {acts[last_before]} (step < {r}) comes after {acts[first_after]} (step >= {r}); no flush")


def _check_comm(acts: list[Action], P: int, where: str) -> None:
    """Each F/B preceded by its receive and followed by its send where it has a neighbour there."""
    for k, a in enumerate(acts):
        if a.op in (Op.FORWARD, Op.BACKWARD):
            before, after = (Op.RECV_F, Op.SEND_F) if a.op is Op.FORWARD else (Op.RECV_B, Op.SEND_B)
            recv_side = a.stage > 0 if a.op is Op.FORWARD else a.stage < P - 1
            send_side = a.stage < P - 1 if a.op is Op.FORWARD else a.stage > 0
            if recv_side and not (k > 0 and _same_message(acts[k - 1], before, a)):
                _fail(f"{where}: {a} at position {k} is not preceded by its {before.name}")
            if send_side and not (k + 1 < len(acts) and _same_message(acts[k + 1], after, a)):
                _fail(f"{where}: {a} at position {k} is not followed by its {after.name}")
        elif a.is_comm:
            if not 0 <= a.peer < P:
                _fail(f"{where}: {a} at position {k} talks to stage {a.peer}, which does not exist")


def _same_message(b: Action, op: Op, a: Action) -> bool:
    """Whether ``b`` is the ``op`` carrying the micro-batch and version of ``a``."""
    return (b.op, b.step, b.microbatch, b.version) == (op, a.step, a.microbatch, a.version)


def _check_cross_stage(sched: Schedule) -> None:
    stuck = run_in_order(sched, lambda *_: None)
    if stuck:
        detail = "; ".join(f"stage {s} waits at {a}" for s, a in stuck)
        _fail(f"{sched.kind} P={sched.num_stages} M={sched.num_microbatches}: deadlock: {detail}")
