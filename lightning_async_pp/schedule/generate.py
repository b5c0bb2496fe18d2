"""Schedule generation: the per-stage action lists of "1f1b" and "2bw", segment by segment.

Because the Lightning loop hands over one batch at a time, schedules are
generated per *segment*: :func:`step_actions` gives what a stage does while
the trainer processes step ``t``; :func:`drain_actions` gives what is left at
the end of a run (the outstanding backwards and the last ``UPDATE``; empty for
"1f1b"); :func:`evaluation_actions` gives one evaluation batch, micro-batched. :func:`build_schedule`
concatenates them into a finite :class:`Schedule` for checking
(:func:`~lightning_async_pp.schedule.check`) and timing
(:func:`~lightning_async_pp.schedule.simulate.simulate`); :func:`gpipe_schedule`
builds GPipe the same way, for simulation only. The schedule kinds, the notation and the
weight versions are described in :mod:`lightning_async_pp.schedule.ir`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_async_pp.schedule.ir import Action, Op, PipelineSchedule, get_schedule, require_int, require_position

__all__ = [
    "Schedule",
    "StageFootprint",
    "build_schedule",
    "drain_actions",
    "evaluation_actions",
    "gpipe_schedule",
    "gradients_received_before_forward",
    "updates_settled_by",
    "stage_footprint",
    "step_actions",
]


# --------------------------------------------------------------------------- segments


def step_actions(
    kind: str,
    num_stages: int,
    num_microbatches: int,
    stage: int,
    step: int,
    run_start: int = 0,
    with_comm: bool = True,
) -> list[Action]:
    """Actions ``stage`` executes while the trainer processes batch ``step``.

    For "2bw": for each micro-batch ``m`` of ``step``, ``F(step, m)`` then the
    backward of global micro-batch ``step*M + m - W`` (``W = P-1-stage``) if it
    belongs to the run, each backward that completes a step followed by that
    step's ``UPDATE``. For "1f1b": the whole flushed step, ending with ``UPDATE(step)``.
    (:meth:`~lightning_async_pp.schedule.ir.PipelineSchedule.step_actions` of the kind.)

    Args:
        kind: ``"2bw"`` or ``"1f1b"``.
        num_stages: ``P``.
        num_microbatches: ``M``.
        stage: 0-based stage index.
        step: optimizer step (``>= run_start``).
        run_start: first step of the current run, i.e. the step after which the
            pipeline was last empty (start of training or after a drain). Ignored by "1f1b".
        with_comm: include explicit send/recv actions.
    """
    return get_schedule(kind).step_actions(num_stages, num_microbatches, stage, step, run_start, with_comm)


def gradients_received_before_forward(
    kind: str, num_stages: int, num_microbatches: int, stage: int, step: int, microbatch: int, run_start: int = 0
) -> tuple[int, int] | None:
    """The newest ``(step, micro-batch)`` whose gradient ``stage`` has received from the next stage when it runs
    the forward of ``(step, microbatch)`` (gradients arrive in that order); ``None`` if none of this run.

    Read from :func:`step_actions`: under "2bw" the forward of global micro-batch ``i`` follows the backward of
    ``i - W - 1`` (``W = P-1-stage``); under "1f1b" the forward of micro-batch ``m`` follows the backwards of the
    step's first ``m - W`` micro-batches, and a step starts after every backward of the one before.
    """
    schedule = get_schedule(kind)
    schedule.validate(num_stages, num_microbatches)
    M = num_microbatches
    received = schedule.last_gradient_before_forward(num_stages, M, stage, step * M + microbatch)
    if received < run_start * M:
        return None
    return received // M, received % M


def updates_settled_by(kind: str, num_stages: int) -> int | None:
    """The micro-batch of step ``t + 1`` whose forward, on every stage, comes after every stage's ``UPDATE(t)``
    through the pipeline's own messages; ``None`` for "1f1b" (version ``t + 1`` is needed at once).

    Under "2bw" stage 0's ``UPDATE(t)`` follows the backward of global micro-batch ``(t+1)*M - 1`` and precedes
    the forward of ``(t+1)*M + P - 1``: micro-batch ``P - 1`` of step ``t + 1`` (``M >= P``). That forward's
    activations carry stage 0's update up the pipeline; a higher stage's ``UPDATE(t)`` precedes its forward of the
    same micro-batch, which needs stage 0's. So whatever the updates of step ``t`` exchanged over all stages (the
    clipping norm, the tied gradients' sums) has been posted by every stage when any stage runs that forward.
    """
    schedule = get_schedule(kind)
    schedule.validate(num_stages, num_stages)
    return schedule.updates_settled_by(num_stages)


def drain_actions(
    kind: str,
    num_stages: int,
    num_microbatches: int,
    stage: int,
    last_step: int,
    run_start: int = 0,
    with_comm: bool = True,
) -> list[Action]:
    """What ``stage`` still has to do to empty the pipeline after ``last_step``.

    For "2bw" these are the last ``P-1-stage`` backwards (all of ``last_step``,
    since ``M >= P``) followed by ``UPDATE(last_step)``; empty for the last stage
    and for "1f1b". Call it when training ends or before anything that needs
    settled weights (validation, checkpointing); the next run then starts with
    ``run_start = last_step + 1``.

    Args:
        kind: ``"2bw"`` or ``"1f1b"``.
        num_stages: ``P``.
        num_microbatches: ``M``.
        stage: 0-based stage index.
        last_step: the last step whose segment was executed.
        run_start: first step of the run being drained.
        with_comm: include explicit send/recv actions.
    """
    return get_schedule(kind).drain_actions(num_stages, num_microbatches, stage, last_step, run_start, with_comm)


def evaluation_actions(num_stages: int, stage: int, index: int, num_microbatches: int = 1) -> list[Action]:
    """What ``stage`` does for one evaluation batch of ``num_microbatches`` micro-batches, forwards only.

    Each micro-batch is received, forwarded and sent on before the next one, so stage ``s`` forwards
    micro-batch ``i`` while stage ``s + 1`` forwards ``i - 1``: the stages overlap as in a pipeline's fill.
    ``index`` numbers the batches; they are rendered as step ``-1-index`` (``"1F-1.2"``) and run on version 0.
    Every schedule evaluates alike (:meth:`~lightning_async_pp.schedule.ir.PipelineSchedule.evaluation_actions`).
    """
    return PipelineSchedule.evaluation_actions(num_stages, stage, index, num_microbatches)


# --------------------------------------------------------------------------- finite schedules


@dataclass
class Schedule:
    """A finite run of a schedule, for printing, checking and simulating.

    ``stages[s]`` is the full action list of stage ``s``: the step segments in
    order, with each run's drain right after its last step. ``run_starts`` lists
    the steps at which the pipeline starts empty (``(0,)`` = one run).
    """

    kind: str
    num_stages: int
    num_microbatches: int
    num_steps: int
    stages: list[list[Action]]
    with_comm: bool = True
    run_starts: tuple[int, ...] = (0,)

    def runs(self) -> list[range]:
        """The steps of each run."""
        bounds = [*self.run_starts, self.num_steps]
        return [range(a, b) for a, b in zip(bounds, bounds[1:])]

    def segments(self, stage: int) -> list[list[Action]]:
        """Per-step segments of ``stage``, each run's drain after its last step.

        With a single run: ``num_steps`` step segments followed by the drain
        (possibly empty). Regenerated from the definition, so a hand-edited
        ``stages`` is not reflected here.
        """
        out: list[list[Action]] = []
        args = (self.kind, self.num_stages, self.num_microbatches, stage)
        for run in self.runs():
            for t in run:
                out.append(step_actions(*args, t, run_start=run.start, with_comm=self.with_comm))
            out.append(drain_actions(*args, run[-1], run_start=run.start, with_comm=self.with_comm))
        return out

    def format(self, with_comm: bool = False) -> str:
        """Per-stage table, one row per stage, segments separated by ``|``."""
        head = (
            f"{self.kind} schedule: {self.num_stages} stages, {self.num_microbatches} micro-batches/step, "
            f"{self.num_steps} steps (<stage><op><step*M+mb>, <stage>U<t> = update with step t's gradient)"
        )
        rows = []
        for s in range(self.num_stages):
            segs = [[a for a in seg if with_comm or a.is_compute] for seg in self.segments(s)]
            rows.append([[str(a) for a in seg] for seg in segs])
        width = max((len(x) for r in rows for seg in r for x in seg), default=1)
        lines = [head]
        for s, r in enumerate(rows):
            cells = " | ".join(" ".join(x.ljust(width) for x in seg) for seg in r)
            lines.append(f"stage {s}: {cells}".rstrip())
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format(with_comm=False)


def _normalize_run_starts(run_starts: Sequence[int], num_steps: int) -> tuple[int, ...]:
    starts = tuple(sorted(set(run_starts)) or (0,))
    if starts[0] != 0:
        starts = (0, *starts)
    for r in starts:
        require_int("run start", r, 0)
        if r >= num_steps:
            raise ValueError(f"run start {r} is not a step of the schedule (num_steps={num_steps})")
    return starts


def build_schedule(
    kind: str,
    num_stages: int,
    num_microbatches: int,
    num_steps: int,
    with_comm: bool = True,
    run_starts: Sequence[int] = (0,),
) -> Schedule:
    """Concatenate segments and drains into full per-stage action lists.

    Args:
        kind: ``"2bw"`` or ``"1f1b"``.
        num_stages: ``P``.
        num_microbatches: ``M``.
        num_steps: number of optimizer steps.
        with_comm: include explicit send/recv actions.
        run_starts: steps at which the pipeline starts empty; the previous run is
            drained right before each (0 is always a run start).
    """
    get_schedule(kind).validate(num_stages, num_microbatches)
    require_int("num_steps", num_steps, 1)
    sched = Schedule(
        kind, num_stages, num_microbatches, num_steps, [], with_comm, _normalize_run_starts(run_starts, num_steps)
    )
    sched.stages = [[a for seg in sched.segments(s) for a in seg] for s in range(num_stages)]
    return sched


# --------------------------------------------------------------------------- memory


@dataclass(frozen=True)
class StageFootprint:
    """What a stage must keep: at most ``max_in_flight`` micro-batches forwarded but
    not yet backwarded (stashed activations), and ``weight_versions`` weight copies."""

    max_in_flight: int
    weight_versions: int


def stage_footprint(kind: str, num_stages: int, num_microbatches: int, stage: int) -> StageFootprint:
    """Peak in-flight micro-batches and weight versions alive for ``stage``.

    Args:
        kind: ``"2bw"`` or ``"1f1b"``.
        num_stages: ``P``.
        num_microbatches: ``M``.
        stage: 0-based stage index.
    """
    schedule = get_schedule(kind)
    schedule.validate(num_stages, num_microbatches)
    require_position(num_stages, stage, 0, 0)
    max_in_flight = schedule.max_in_flight(num_stages, num_microbatches, stage)
    return StageFootprint(max_in_flight, schedule.num_weight_versions)


# --------------------------------------------------------------------------- simulation only


def gpipe_schedule(num_stages: int, num_microbatches: int, num_steps: int) -> Schedule:
    """GPipe as a :class:`Schedule`: per step, all forwards, all backwards (in order), then the update.

    Not a schedule the runtime executes (``torch.distributed.pipelining.ScheduleGPipe`` is), and not one of
    :data:`~lightning_async_pp.schedule.SCHEDULES`: its kind is ``"gpipe"``, which
    :func:`~lightning_async_pp.schedule.check` refuses. Built from the same action objects so that the
    simulator times it exactly like the others. No send/recv actions: the simulator then lets each F/B
    wait directly for its neighbour's result. Step ``t`` uses version ``t``, like "1f1b".

    Args:
        num_stages: ``P``.
        num_microbatches: ``M``.
        num_steps: number of optimizer steps.
    """
    require_int("num_stages", num_stages, 1)
    require_int("num_microbatches", num_microbatches, 1)
    require_int("num_steps", num_steps, 1)
    P, M = num_stages, num_microbatches
    stages = []
    for s in range(P):
        actions = []
        for t in range(num_steps):
            actions += [Action(s, Op.FORWARD, t, m, t, M) for m in range(M)]
            actions += [Action(s, Op.BACKWARD, t, m, t, M) for m in range(M)]
            actions.append(Action(s, Op.UPDATE, t, -1, t + 1, M))
        stages.append(actions)
    return Schedule("gpipe", P, M, num_steps, stages, with_comm=False)
