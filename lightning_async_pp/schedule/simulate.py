"""Event-driven timing simulation of a :class:`~lightning_async_pp.schedule.Schedule`.

The simulator executes the *same* per-stage action lists a runtime would, in
order per stage, with a cost per compute action:

* ``F(s, i)`` starts when stage ``s`` is free and ``F(s-1, i)`` has finished
  plus ``transfer``; ``B(s, i)`` likewise waits for ``B(s+1, i)``.
* With explicit communication, sends take no time on the sender (they are
  non-blocking; ``transfer`` is latency seen by the receiver) and a RECV
  occupies its stage until the data has arrived. Without communication actions
  the compute action waits directly; the compute timings are identical.
* ``UPDATE`` costs :attr:`StageCosts.update` on its own stage only.

If no stage can make progress the schedule would hang a real pipeline, and
:class:`DeadlockError` lists the stuck actions.

Example::

    sched = build_schedule("2bw", num_stages=4, num_microbatches=8, num_steps=20)
    result = simulate(sched, StageCosts(forward=1.0, backward=2.0))
    print(result.steady_bubble_fraction, result.throughput)
    print(render_gantt(result))
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from lightning_async_pp.schedule.generate import Schedule
from lightning_async_pp.schedule.ir import Action, Op
from lightning_async_pp.schedule.verify import liveness_trace, needed_event, run_in_order

__all__ = ["DeadlockError", "Event", "SimulationResult", "StageCosts", "plot_gantt", "render_gantt", "simulate"]


@dataclass(frozen=True)
class StageCosts:
    """Seconds a stage spends per micro-batch forward/backward and per optimizer update."""

    forward: float
    backward: float
    update: float = 0.0

    def of(self, op: Op) -> float:
        if op is Op.FORWARD:
            return self.forward
        if op is Op.BACKWARD:
            return self.backward
        if op is Op.UPDATE:
            return self.update
        return 0.0


class Event(NamedTuple):
    action: Action
    start: float
    end: float


class DeadlockError(RuntimeError):
    """No stage can progress: the schedule's per-stage orders are inconsistent."""


@dataclass
class SimulationResult:
    """Timing of one simulated schedule.

    Attributes:
        schedule: the simulated schedule.
        timelines: per stage, ``(action, start, end)`` for every action in order
            (send/recv included when the schedule has them; a RECV lasts while it waits).
        makespan: time at which the last action ends.
        busy: per stage, time spent in F/B/UPDATE.
        utilization: ``busy / makespan`` per stage.
        bubble_fraction: ``1 - utilization`` per stage (idle / makespan).
        steady_window: steps ``(a, b)``; the steady-state figures are measured on
            each stage from its first forward of step ``a`` to its first forward
            of step ``b``, leaving out the ramp-up and drain (a quarter of the
            steps, at least one, at each end). With fewer than 3 steps the window
            is the whole run, up to the stage's last action.
        steady_bubble_fraction: idle fraction per stage inside that window.
        peak_in_flight: per stage, most micro-batches forwarded but not yet backwarded.
        peak_versions_alive: per stage, most weight versions alive at once.
        throughput: micro-batches per second over the whole schedule.
        steady_throughput: micro-batches per second inside stage 0's steady window.
    """

    schedule: Schedule
    timelines: list[list[Event]]
    makespan: float
    busy: list[float]
    utilization: list[float]
    bubble_fraction: list[float]
    steady_window: tuple[int, int]
    steady_bubble_fraction: list[float]
    peak_in_flight: list[int]
    peak_versions_alive: list[int]
    throughput: float
    steady_throughput: float
    costs: list[StageCosts] = field(repr=False, default_factory=list)

    @property
    def mean_bubble_fraction(self) -> float:
        return sum(self.bubble_fraction) / len(self.bubble_fraction)

    @property
    def mean_steady_bubble_fraction(self) -> float:
        return sum(self.steady_bubble_fraction) / len(self.steady_bubble_fraction)

    def gantt(self, **kwargs) -> str:
        """Text Gantt chart, see :func:`render_gantt`."""
        return render_gantt(self, **kwargs)


def _stage_costs(costs: Sequence[StageCosts] | StageCosts, num_stages: int) -> list[StageCosts]:
    if isinstance(costs, StageCosts):
        per_stage = [costs] * num_stages
    else:
        per_stage = list(costs)
        if len(per_stage) != num_stages:
            raise ValueError(
                f"got costs for {len(per_stage)} stages but the schedule has {num_stages}; "
                "pass one StageCosts per stage or a single one for all"
            )
    for s, c in enumerate(per_stage):
        if min(c.forward, c.backward, c.update) < 0:
            raise ValueError(f"stage {s} has a negative cost: {c}")
    return per_stage


def _steady_window(num_steps: int) -> tuple[int, int]:
    # Leave out a quarter of the steps (at least one) at each end of the run.
    if num_steps < 3:
        return (0, num_steps)
    cut = max(1, num_steps // 4)
    return (cut, num_steps - cut)


def simulate(
    schedule: Schedule,
    costs: Sequence[StageCosts] | StageCosts,
    transfer: float = 0.0,
    step_overhead: Sequence[float] | float = 0.0,
    step_sync: bool = False,
    durations: Mapping[str, float] | None = None,
) -> SimulationResult:
    """Time ``schedule`` with the given costs.

    Args:
        schedule: a schedule from :func:`~lightning_async_pp.schedule.build_schedule`
            (or hand-made, e.g. to test a runtime's order).
        costs: one :class:`StageCosts` for all stages or one per stage.
        transfer: seconds between a stage finishing a micro-batch and its
            neighbour being able to use the result (activation or gradient).
        step_overhead: seconds of host work per step and stage outside the
            schedule's actions (the training loop, data loading, hooks), spent
            right before the stage starts its share of each step (the step's
            first action on that stage); one value for all stages or one per stage.
        step_sync: model a trainer that synchronises the stages once per step
            (a barrier): a stage starts its share of step ``t`` only once every
            stage has reached step ``t``, i.e. finished its share of step
            ``t - 1`` and its ``step_overhead``. Lightning does this with a
            blocking broadcast from rank 0 before every training step when
            ``world_size > 1``; ``AsyncPipelineStrategy`` replaces it by a
            non-blocking one, so its runs are modelled without it.
        durations: seconds of individual actions, keyed by the action's name
            (``str(action)``, e.g. ``"1B5"``: stage 1, backward of micro-batch 5),
            overriding ``costs`` for those actions. Fed the durations of a traced
            run, the simulator replays that run with its real, uneven costs
            rather than their averages.

    Raises:
        DeadlockError: when the per-stage orders cannot all run to completion.
    """
    P = schedule.num_stages
    per_stage = _stage_costs(costs, P)
    if transfer < 0:
        raise ValueError(f"transfer must be >= 0, got {transfer}")
    overhead = _step_overheads(step_overhead, P)
    comm = any(a.is_comm for acts in schedule.stages for a in acts)
    step_start = _step_starts(schedule)
    release: dict[int, float] = {}  # step -> when the last of the stages reaches it (step_sync)
    while True:
        timelines, reached = _timelines(
            schedule, per_stage, transfer, overhead, step_start, release, comm, durations or {}
        )
        if not step_sync or all(release.get(t) == v for t, v in reached.items()):
            break
        # Start times only grow from one pass to the next; a few passes settle them.
        release = reached
    return _result(schedule, timelines, per_stage)


def _step_overheads(step_overhead: Sequence[float] | float, num_stages: int) -> list[float]:
    overhead = [float(step_overhead)] * num_stages if isinstance(step_overhead, (int, float)) else list(step_overhead)
    if len(overhead) != num_stages or min(overhead) < 0:
        raise ValueError(
            f"step_overhead must be >= 0, one value or one per stage ({num_stages}), got {step_overhead!r}"
        )
    return overhead


def _step_starts(schedule: Schedule) -> dict[tuple[int, Action], int]:
    """The first action of each step on each stage (its first forward, or that forward's receive) -> the step."""
    step_start: dict[tuple[int, Action], int] = {}
    for s, acts in enumerate(schedule.stages):
        seen: set[int] = set()
        for a in acts:
            if a.op is not Op.UPDATE and a.step not in seen:
                seen.add(a.step)
                step_start[(s, a)] = a.step
    return step_start


def _result(schedule: Schedule, timelines: list[list[Event]], per_stage: list[StageCosts]) -> SimulationResult:
    """The figures of :class:`SimulationResult` measured on ``timelines``."""
    makespan = max((ev.end for tl in timelines for ev in tl), default=0.0)
    busy = [sum(ev.end - ev.start for ev in tl if ev.action.is_compute) for tl in timelines]
    utilization = [b / makespan if makespan > 0 else 1.0 for b in busy]
    window = _steady_window(schedule.num_steps)
    steady, spans = [], []
    for tl in timelines:
        lo, hi = _window_bounds(tl, window, makespan)
        spans.append(hi - lo)
        inside = sum(max(0.0, min(ev.end, hi) - max(ev.start, lo)) for ev in tl if ev.action.is_compute)
        steady.append(1.0 - inside / (hi - lo) if hi > lo else 0.0)
    traces = [liveness_trace(acts) for acts in schedule.stages]
    M = schedule.num_microbatches
    total = schedule.num_steps * M
    return SimulationResult(
        schedule=schedule,
        timelines=timelines,
        makespan=makespan,
        busy=busy,
        utilization=utilization,
        bubble_fraction=[1.0 - u for u in utilization],
        steady_window=window,
        steady_bubble_fraction=steady,
        peak_in_flight=[max((n for n, _ in tr), default=0) for tr in traces],
        peak_versions_alive=[max((len(v) for _, v in tr), default=0) for tr in traces],
        throughput=total / makespan if makespan > 0 else float("inf"),
        steady_throughput=(window[1] - window[0]) * M / spans[0] if spans[0] > 0 else float("inf"),
        costs=per_stage,
    )


def _timelines(
    schedule: Schedule,
    per_stage: list[StageCosts],
    transfer: float,
    overhead: list[float],
    step_start: dict[tuple[int, Action], int],
    release: dict[int, float],
    comm: bool,
    durations: Mapping[str, float],
) -> tuple[list[list[Event]], dict[int, float]]:
    """One pass over the lists; returns the timelines and, per step, when the last of the stages reached it."""
    P = schedule.num_stages
    clock = [0.0] * P
    arrival: dict[tuple, float] = {}  # cross-stage result -> time the receiver can use it
    timelines: list[list[Event]] = [[] for _ in range(P)]
    reached: dict[int, float] = {}

    # Any order respecting the dependencies gives the same times: each start is
    # the max of the stage's clock and the arrival of what it needs.
    def visit(s: int, a: Action, need: tuple | None, made: tuple | None) -> None:
        step = step_start.get((s, a))
        if step is not None:
            clock[s] += overhead[s]
            reached[step] = max(reached.get(step, 0.0), clock[s])
            clock[s] = max(clock[s], release.get(step, 0.0))
        ready = clock[s] if need is None else max(clock[s], arrival[need])
        if a.op in (Op.RECV_F, Op.RECV_B):
            start, end = clock[s], ready  # the stage sits in the receive until the data is there
        else:
            cost = durations.get(str(a)) if durations else None
            start, end = ready, ready + (per_stage[s].of(a.op) if cost is None else cost)
        if made is not None:
            arrival[made] = end + transfer
        timelines[s].append(Event(a, start, end))
        clock[s] = end

    stuck = run_in_order(schedule, visit)
    if stuck:
        detail = "; ".join(f"stage {s} waits at {a} ({_describe_wait(a, P, comm)})" for s, a in stuck)
        raise DeadlockError(f"{schedule.kind} schedule with {P} stages deadlocks: {detail}")
    return timelines, reached


def _window_bounds(timeline: list[Event], window: tuple[int, int], makespan: float) -> tuple[float, float]:
    """Stage-local window: first forward of step ``a`` to first forward of step ``b``
    (or, when ``b`` is past the end, to the stage's last action)."""
    a, b = window
    first_forward: dict[int, float] = {}
    for ev in timeline:
        if ev.action.op is Op.FORWARD and ev.action.step in (a, b):
            first_forward.setdefault(ev.action.step, ev.start)
    lo = first_forward.get(a, 0.0)
    hi = first_forward.get(b, max((ev.end for ev in timeline), default=makespan))
    return lo, hi


def _describe_wait(a: Action, num_stages: int, with_comm: bool) -> str:
    need = needed_event(a, num_stages, with_comm)
    if need is None:
        return "nothing"
    forward, stage, step, mb = need
    src = stage - 1 if forward else stage + 1
    what = "activation" if forward else "gradient"
    return f"needs the {what} of step {step} micro-batch {mb} from stage {src}"


# --------------------------------------------------------------------------- rendering


def _label(a: Action) -> str:
    if a.op is Op.UPDATE:
        return f"U{a.step}"
    return f"{a.op.value}{a.global_microbatch if a.num_microbatches else f'{a.step}.{a.microbatch}'}"


def render_gantt(result: SimulationResult, *, scale: float | None = None, max_width: int = 160) -> str:
    """Text Gantt chart, one row per stage.

    Each compute action is drawn as its label (``F3``, ``B0``, ``U1``) padded
    with ``-`` to its duration; idle time (including waiting in a receive) is ``.``.

    Args:
        result: a simulation result.
        scale: characters per second; by default the shortest compute action
            gets 3 characters, capped so the chart is at most ``max_width`` wide.
        max_width: width cap used when ``scale`` is not given.
    """
    durations = [
        ev.end - ev.start for tl in result.timelines for ev in tl if ev.action.is_compute and ev.end > ev.start
    ]
    if result.makespan <= 0 or not durations:
        return "\n".join(f"stage {s}: (nothing timed)" for s in range(len(result.timelines)))
    if scale is None:
        scale = min(3.0 / min(durations), max_width / result.makespan)
    width = max(1, round(result.makespan * scale))
    rows = [f"{result.schedule.kind}: makespan {result.makespan:g}s, 1 char = {1 / scale:g}s"]
    for s, tl in enumerate(result.timelines):
        cells = ["."] * width
        for ev in tl:
            if not ev.action.is_compute:
                continue
            lo, hi = round(ev.start * scale), round(ev.end * scale)
            if hi <= lo:
                continue
            text = _label(ev.action)[: hi - lo].ljust(hi - lo, "-")
            cells[lo:hi] = text
        rows.append(f"stage {s}: {''.join(cells)}")
    return "\n".join(rows)


def plot_gantt(result: SimulationResult, path: str | None = None, *, ax=None):
    """Draw the timeline with matplotlib (optional dependency); save to ``path`` if given.

    Returns the matplotlib ``Axes``.
    """
    try:
        import matplotlib

        if ax is None and path is not None:
            matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError("plot_gantt needs matplotlib: pip install 'lightning-async-pp[bench]'") from err
    P = len(result.timelines)
    if ax is None:
        _, ax = plt.subplots(figsize=(max(6.0, result.makespan * 0.25), 0.5 * P + 1))
    colors = {Op.FORWARD: "tab:blue", Op.BACKWARD: "tab:green", Op.UPDATE: "tab:red"}
    for s, tl in enumerate(result.timelines):
        for ev in tl:
            if ev.action.is_compute and ev.end > ev.start:
                bar = [(ev.start, ev.end - ev.start)]
                ax.broken_barh(bar, (s - 0.4, 0.8), facecolors=colors[ev.action.op], edgecolor="k")
                ax.text((ev.start + ev.end) / 2, s, _label(ev.action), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(P), [f"stage {s}" for s in range(P)])
    ax.invert_yaxis()
    ax.set_xlabel("time (s)")
    ax.set_title(f"{result.schedule.kind}: makespan {result.makespan:g}s")
    if path is not None:
        ax.figure.savefig(path, bbox_inches="tight")
    return ax
