"""Pipeline schedules as data: per-stage action lists for "1f1b" and "2bw".

Nothing here runs a model or touches ``torch.distributed``: a schedule is a
list of :class:`Action` per stage that a runtime executes in order, that
:func:`check` verifies and that :mod:`lightning_async_pp.schedule.simulate`
times. The design follows ``torch.distributed.pipelining`` (schedules are data,
lowered with explicit send/recv actions) and DeepSpeed's
``runtime/pipe/schedule.py``.

Terms: ``P`` stages (``stage`` 0-based), ``M`` micro-batches per optimizer
step, steps ``t = 0, 1, ...``. Micro-batches are numbered globally
``i = t * M + m``.

* ``"1f1b"`` (synchronous, flushed): every step is self-contained. Stage ``s``
  does ``W = min(P-1-s, M)`` warm-up forwards, alternates one forward and one
  backward, drains the remaining backwards and finally does ``UPDATE(t)``.
  Step ``t`` uses weight version ``t``; ``UPDATE(t)`` produces ``t + 1``.
* ``"2bw"`` (PipeDream-2BW, asynchronous, no flush): one continuous 1F1B stream
  across steps. Stage ``s`` does ``W = P-1-s`` warm-up forwards only when a
  *run* (consecutive steps starting from an empty pipeline) begins, then for
  each ``i``: ``F(i)`` followed by ``B(i - W)``. Right after the backward of
  the last micro-batch of step ``t`` the stage does ``UPDATE(t)`` on its own
  clock. Every micro-batch of step ``t`` uses version ``t - 1`` (version -1 is
  the initial weights, like version 0), and ``UPDATE(t)`` applies that gradient
  to version ``t``, producing ``t + 1``: each gradient is applied exactly one
  version after the one it was computed on. Two weight buffers per stage
  suffice, version ``v`` living in buffer ``v % 2`` (see :func:`weight_buffer`).

Because the Lightning loop hands over one batch at a time, schedules are
generated per *segment*: :func:`step_actions` gives what a stage does while
the trainer processes step ``t``; :func:`drain_actions` gives what is left at
the end of a run (the outstanding backwards and the last ``UPDATE``; empty for
"1f1b").

Notation (``str(action)``): ``<stage><op><global micro-batch>``, where the
global micro-batch is ``step * M + microbatch`` and ``op`` is the short code of
:class:`Op`; e.g. ``"0F3"`` is stage 0's forward of global micro-batch 3,
``"1RB2"`` stage 1's receive of the gradient for micro-batch 2. An update is
``<stage>U<step>``: ``"0U1"`` means stage 0 applies step 1's gradient. An
:class:`Action` built without ``num_microbatches`` renders the micro-batch as
``<step>.<microbatch>`` instead, e.g. ``"0F1.3"``.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

__all__ = [
    "SCHEDULES",
    "Action",
    "Op",
    "PostingPlan",
    "Schedule",
    "StageFootprint",
    "build_schedule",
    "check",
    "check_transfers",
    "drain_actions",
    "evaluation_actions",
    "host_program",
    "liveness_trace",
    "posting_plan",
    "stage_footprint",
    "step_actions",
    "validate",
    "weight_buffer",
    "weight_version",
]

SCHEDULES = ("2bw", "1f1b")


class Op(str, enum.Enum):
    """What an action does; the value is the short code used when printing."""

    FORWARD = "F"
    BACKWARD = "B"
    SEND_F = "SF"
    RECV_F = "RF"
    SEND_B = "SB"
    RECV_B = "RB"
    UPDATE = "U"

    def __str__(self) -> str:
        return self.value


_COMPUTE_OPS = (Op.FORWARD, Op.BACKWARD, Op.UPDATE)
_COMM_OPS = (Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B)


@dataclass(frozen=True)
class Action:
    """One thing a stage does.

    Args:
        stage: the pipeline stage executing the action.
        op: what it does.
        step: optimizer step the micro-batch belongs to; for ``UPDATE`` the
            step whose gradient is applied.
        microbatch: index within the step, ``0..M-1``; ``-1`` for ``UPDATE``.
        version: weight version used (forward, backward, send, recv); for
            ``UPDATE`` the version produced (``step + 1``).
        num_microbatches: ``M``, only used to print the global micro-batch
            index; ignored by ``==`` and ``hash`` (0 = unknown).
    """

    stage: int
    op: Op
    step: int
    microbatch: int
    version: int
    num_microbatches: int = field(default=0, compare=False, repr=False)

    @property
    def is_compute(self) -> bool:
        return self.op in _COMPUTE_OPS

    @property
    def is_comm(self) -> bool:
        return self.op in _COMM_OPS

    @property
    def global_microbatch(self) -> int:
        """``step * M + microbatch`` (needs ``num_microbatches``)."""
        if self.op is Op.UPDATE:
            raise ValueError(f"{self!r} is an UPDATE and has no micro-batch")
        if self.num_microbatches < 1:
            raise ValueError(f"{self!r} was built without num_microbatches; the global index is unknown")
        return self.step * self.num_microbatches + self.microbatch

    @property
    def peer(self) -> int | None:
        """The stage on the other end of a send/recv (``None`` for compute)."""
        if self.op in (Op.SEND_F, Op.RECV_B):
            return self.stage + 1
        if self.op in (Op.RECV_F, Op.SEND_B):
            return self.stage - 1
        return None

    def __str__(self) -> str:
        if self.op is Op.UPDATE:
            return f"{self.stage}U{self.step}"
        if self.num_microbatches > 0:
            return f"{self.stage}{self.op.value}{self.global_microbatch}"
        return f"{self.stage}{self.op.value}{self.step}.{self.microbatch}"


# --------------------------------------------------------------------------- validation


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def validate(kind: str, num_stages: int, num_microbatches: int) -> None:
    """Raise a ``ValueError`` saying what to change if the configuration is invalid.

    Args:
        kind: one of :data:`SCHEDULES`.
        num_stages: number of pipeline stages ``P`` (>= 1).
        num_microbatches: micro-batches per optimizer step ``M`` (>= 1; >= P for "2bw").
    """
    if kind not in SCHEDULES:
        known = ", ".join(repr(k) for k in SCHEDULES)
        raise ValueError(f"unknown pipeline schedule {kind!r}; expected one of {known}")
    _check_int("num_stages", num_stages, 1)
    _check_int("num_microbatches", num_microbatches, 1)
    # With M < P the first stage keeps micro-batches of three steps in flight
    # across two updates, which two weight buffers cannot hold.
    if kind == "2bw" and num_microbatches < num_stages:
        raise ValueError(
            f"the '2bw' schedule needs num_microbatches >= the number of pipeline stages, got "
            f"num_microbatches={num_microbatches} with {num_stages} stages; set num_microbatches >= "
            f"{num_stages} (or use schedule='1f1b')"
        )


def _check_position(num_stages: int, stage: int, step: int, run_start: int) -> None:
    _check_int("stage", stage, 0)
    if stage >= num_stages:
        raise ValueError(f"stage must be < num_stages={num_stages}, got {stage}")
    _check_int("run_start", run_start, 0)
    _check_int("step", step, 0)
    if step < run_start:
        raise ValueError(f"step {step} precedes the start of its run (run_start={run_start})")


# --------------------------------------------------------------------------- versions


def weight_version(kind: str, step: int) -> int:
    """Weight version that every forward/backward of ``step`` uses."""
    if kind not in SCHEDULES:
        validate(kind, 1, 1)
    return step - 1 if kind == "2bw" else step


def weight_buffer(version: int) -> int:
    """Index of the 2BW buffer holding ``version`` (``-1 -> 1``; both start as w[0])."""
    return version % 2


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
    validate(kind, num_stages, num_microbatches)
    _check_position(num_stages, stage, 0, 0)
    if kind == "2bw":
        return StageFootprint(num_stages - stage, 2)
    return StageFootprint(min(num_stages - stage, num_microbatches), 1)


# --------------------------------------------------------------------------- generation


def _compute(kind: str, P: int, M: int, s: int, op: Op, i: int) -> Action:
    step, mb = divmod(i, M)
    return Action(s, op, step, mb, weight_version(kind, step), M)


def _update(s: int, step: int, M: int) -> Action:
    return Action(s, Op.UPDATE, step, -1, step + 1, M)


def _backward_2bw(P: int, M: int, s: int, i: int) -> list[Action]:
    out = [_compute("2bw", P, M, s, Op.BACKWARD, i)]
    if i % M == M - 1:
        # Update on the stage's own clock as soon as its share of the gradient is complete.
        out.append(_update(s, i // M, M))
    return out


def _lower(actions: Iterable[Action], num_stages: int) -> list[Action]:
    """Insert explicit communication: RECV right before its F/B, SEND right after."""
    out: list[Action] = []
    for a in actions:
        first, last = a.stage == 0, a.stage == num_stages - 1
        if a.op is Op.FORWARD:
            if not first:
                out.append(Action(a.stage, Op.RECV_F, a.step, a.microbatch, a.version, a.num_microbatches))
            out.append(a)
            if not last:
                out.append(Action(a.stage, Op.SEND_F, a.step, a.microbatch, a.version, a.num_microbatches))
        elif a.op is Op.BACKWARD:
            if not last:
                out.append(Action(a.stage, Op.RECV_B, a.step, a.microbatch, a.version, a.num_microbatches))
            out.append(a)
            # The gradient goes upstream before UPDATE so the previous stage is not
            # kept waiting by this stage's optimizer.
            if not first:
                out.append(Action(a.stage, Op.SEND_B, a.step, a.microbatch, a.version, a.num_microbatches))
        else:
            out.append(a)
    return out


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
    validate(kind, num_stages, num_microbatches)
    _check_position(num_stages, stage, step, run_start)
    P, M, s = num_stages, num_microbatches, stage
    out: list[Action] = []
    if kind == "2bw":
        warmup = P - 1 - s
        for m in range(M):
            i = step * M + m
            out.append(_compute(kind, P, M, s, Op.FORWARD, i))
            if i - warmup >= run_start * M:
                out += _backward_2bw(P, M, s, i - warmup)
    else:
        warmup = min(P - 1 - s, M)
        base = step * M
        for m in range(M):
            out.append(_compute(kind, P, M, s, Op.FORWARD, base + m))
            if m >= warmup:
                out.append(_compute(kind, P, M, s, Op.BACKWARD, base + m - warmup))
        for m in range(M - warmup, M):
            out.append(_compute(kind, P, M, s, Op.BACKWARD, base + m))
        out.append(_update(s, step, M))
    return _lower(out, P) if with_comm else out


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
    validate(kind, num_stages, num_microbatches)
    _check_position(num_stages, stage, last_step, run_start)
    if kind == "1f1b":
        return []
    P, M, s = num_stages, num_microbatches, stage
    end = (last_step + 1) * M
    out: list[Action] = []
    for i in range(max(run_start * M, end - (P - 1 - s)), end):
        out += _backward_2bw(P, M, s, i)
    return _lower(out, P) if with_comm else out


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
        _check_int("run start", r, 0)
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
    validate(kind, num_stages, num_microbatches)
    _check_int("num_steps", num_steps, 1)
    sched = Schedule(
        kind, num_stages, num_microbatches, num_steps, [], with_comm, _normalize_run_starts(run_starts, num_steps)
    )
    sched.stages = [[a for seg in sched.segments(s) for a in seg] for s in range(num_stages)]
    return sched


# --------------------------------------------------------------------------- checking


def liveness_trace(actions: Sequence[Action]) -> list[tuple[int, frozenset[int]]]:
    """After each action of one stage: (micro-batches in flight, weight versions alive).

    A micro-batch is in flight between its forward and its backward (its
    activations are stashed). Alive versions are those of the in-flight
    micro-batches plus the newest one produced (initially 0).
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


def _needs(a: Action, num_stages: int, with_comm: bool) -> tuple | None:
    """Key of the cross-stage event ``a`` must wait for, or None."""
    if with_comm:
        if a.op in (Op.RECV_F, Op.RECV_B):
            return (a.op is Op.RECV_F, a.stage, a.step, a.microbatch)
        return None
    if a.op is Op.FORWARD and a.stage > 0:
        return (True, a.stage, a.step, a.microbatch)
    if a.op is Op.BACKWARD and a.stage < num_stages - 1:
        return (False, a.stage, a.step, a.microbatch)
    return None


def _provides(a: Action, num_stages: int, with_comm: bool) -> tuple | None:
    """Key of the cross-stage event that finishing ``a`` makes available, or None."""
    forward = a.op in (Op.FORWARD, Op.SEND_F)
    if with_comm != a.is_comm or a.op in (Op.RECV_F, Op.RECV_B, Op.UPDATE):
        return None
    dst = a.stage + 1 if forward else a.stage - 1
    if not 0 <= dst < num_stages:
        return None
    return (forward, dst, a.step, a.microbatch)


def _fail(msg: str) -> None:
    raise AssertionError(msg)


def _check_stage(sched: Schedule, s: int) -> None:
    P, M, kind = sched.num_stages, sched.num_microbatches, sched.kind
    acts = sched.stages[s]
    where = f"{kind} P={P} M={M} stage {s}"
    expected = {(t, m) for t in range(sched.num_steps) for m in range(M)}
    fwd: dict[tuple[int, int], int] = {}
    bwd: dict[tuple[int, int], int] = {}
    for k, a in enumerate(acts):
        if a.stage != s:
            _fail(f"{where}: action {a!r} at position {k} belongs to stage {a.stage}")
        if a.op is Op.UPDATE:
            continue
        key = (a.step, a.microbatch)
        if key not in expected:
            _fail(f"{where}: {a} refers to micro-batch {key} outside the schedule")
        if a.version != weight_version(kind, a.step):
            _fail(f"{where}: {a} uses version {a.version}, expected {weight_version(kind, a.step)}")
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

    # Communication lowering: RECV right before its F/B, SEND right after.
    has_comm = any(a.is_comm for a in acts)
    if has_comm != (sched.with_comm and P > 1):
        _fail(f"{where}: with_comm={sched.with_comm} but the list {'has' if has_comm else 'has no'} send/recv")
    if sched.with_comm:
        _check_comm(acts, P, where)

    # Updates: one per step, in order, after the step's last backward, before
    # the forwards that need the version they produce.
    updates = [(k, a) for k, a in enumerate(acts) if a.op is Op.UPDATE]
    if [a.step for _, a in updates] != list(range(sched.num_steps)):
        got = [a.step for _, a in updates]
        _fail(f"{where}: updates are for steps {got}, expected 0..{sched.num_steps - 1} in order")
    lag = 1 if kind == "2bw" else 0  # steps between the version used and the newest one
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

    # Memory: activations of at most P - s micro-batches, at most two weight
    # buffers (2bw), and in 2bw each version read from the buffer holding it.
    limit_versions = 2 if kind == "2bw" else 1
    for k, (n, versions) in enumerate(liveness_trace(acts)):
        if n > P - s:
            _fail(f"{where}: {n} micro-batches in flight after {acts[k]} (position {k}), limit {P - s}")
        if len(versions) > limit_versions:
            _fail(f"{where}: versions {sorted(versions)} alive after {acts[k]} (position {k}), limit {limit_versions}")
    if kind == "2bw":
        buffers = [0, -1]
        for k, a in enumerate(acts):
            if a.op is Op.UPDATE:
                buffers[weight_buffer(a.version)] = a.version
            elif a.op in (Op.FORWARD, Op.BACKWARD) and buffers[weight_buffer(a.version)] != a.version:
                _fail(
                    f"{where}: {a} at position {k} needs version {a.version} but buffer "
                    f"{weight_buffer(a.version)} holds {buffers[weight_buffer(a.version)]}"
                )

    # Flushes: nothing of a run may be left when the next run starts; 1f1b
    # flushes after every step.
    boundaries = range(1, sched.num_steps) if kind == "1f1b" else sched.run_starts[1:]
    for r in boundaries:
        last_before = max(k for k, a in enumerate(acts) if a.step < r)
        first_after = min(k for k, a in enumerate(acts) if a.step >= r)
        if last_before > first_after:
            _fail(f"{where}: {acts[last_before]} (step < {r}) comes after {acts[first_after]} (step >= {r}); no flush")


def _check_comm(acts: list[Action], P: int, where: str) -> None:
    for k, a in enumerate(acts):
        if a.op in (Op.FORWARD, Op.BACKWARD):
            before, after = (Op.RECV_F, Op.SEND_F) if a.op is Op.FORWARD else (Op.RECV_B, Op.SEND_B)
            recv_side = a.stage > 0 if a.op is Op.FORWARD else a.stage < P - 1
            send_side = a.stage < P - 1 if a.op is Op.FORWARD else a.stage > 0
            same = lambda b, op: (b.op, b.step, b.microbatch, b.version) == (op, a.step, a.microbatch, a.version)
            if recv_side and not (k > 0 and same(acts[k - 1], before)):
                _fail(f"{where}: {a} at position {k} is not preceded by its {before.name}")
            if send_side and not (k + 1 < len(acts) and same(acts[k + 1], after)):
                _fail(f"{where}: {a} at position {k} is not followed by its {after.name}")
        elif a.is_comm:
            if not 0 <= a.peer < P:
                _fail(f"{where}: {a} at position {k} talks to stage {a.peer}, which does not exist")


def _run_in_order(
    sched: Schedule, visit: Callable[[int, Action, tuple | None, tuple | None], None]
) -> list[tuple[int, Action]]:
    """Execute the per-stage lists against each other, ignoring time.

    Calls ``visit(stage, action, needed_key, provided_key)`` for every action in an order that
    respects each stage's list and the cross-stage data dependencies. Returns
    the ``(stage, action)`` pairs left blocked (empty unless the lists deadlock).
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
            need = _needs(a, P, comm)
            if need is not None and need not in done:
                waiting[need] = s
                break
            made = _provides(a, P, comm)
            visit(s, a, need, made)
            if made is not None:
                done.add(made)
                if (w := waiting.pop(made, None)) is not None:
                    ready.append(w)
            pos[s] += 1
    return [(s, sched.stages[s][pos[s]]) for s in range(P) if pos[s] < len(sched.stages[s])]


def _check_cross_stage(sched: Schedule) -> None:
    stuck = _run_in_order(sched, lambda *_: None)
    if stuck:
        detail = "; ".join(f"stage {s} waits at {a}" for s, a in stuck)
        _fail(f"{sched.kind} P={sched.num_stages} M={sched.num_microbatches}: deadlock: {detail}")


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
    """
    validate(schedule.kind, schedule.num_stages, schedule.num_microbatches)
    if len(schedule.stages) != schedule.num_stages:
        _fail(f"schedule has {len(schedule.stages)} stage lists for {schedule.num_stages} stages")
    for s in range(schedule.num_stages):
        _check_stage(schedule, s)
    _check_cross_stage(schedule)


# --------------------------------------------------------------------------- transfers (NCCL semantics)

_PREV_LINK = (Op.RECV_F, Op.SEND_B)  # operations on the link with stage - 1
_NEXT_LINK = (Op.SEND_F, Op.RECV_B)  # operations on the link with stage + 1
_RECEIVES = (Op.RECV_F, Op.RECV_B)


@dataclass(frozen=True)
class PostingPlan:
    """When a stage posts the receives of one segment of actions (sends are posted at their action).

    Args:
        start: receive ops (``RECV_F`` for the link with the previous stage, ``RECV_B`` for the next one)
            whose link's first receive is posted when the segment starts.
        post_next: per action: post the next receive of the action's link with it, batched with the send
            (a ``SEND_*``) or right after the receive completed (a ``RECV_*``).
    """

    start: frozenset[Op]
    post_next: tuple[bool, ...]


def posting_plan(actions: Sequence[Action], eager: bool = False) -> PostingPlan:
    """How :class:`~lightning_async_pp.runtime.stage.StageRuntime` posts the transfers of ``actions``.

    Each receive is posted as early as possible without overtaking an earlier operation of its link: at
    the segment start when it is its link's first operation, batched with the send right before it on
    its link, or right after the receive right before it on its link completed. Per link, operations are
    therefore posted in the schedule's order, and the transfer overlaps the compute in between.

    Args:
        actions: one segment of one stage (:func:`step_actions`, :func:`drain_actions` or an evaluation).
        eager: the plan before transfers were batched: each link's first receive posted at the segment
            start and each next one as soon as the previous one completed, ahead of sends. On NCCL it
            deadlocks (:func:`check_transfers` shows it); kept to test the model.
    """
    post_next = [False] * len(actions)
    start: set[Op] = set()
    for link in (_PREV_LINK, _NEXT_LINK):
        positions = [k for k, a in enumerate(actions) if a.op in link]
        receives = [k for k in positions if actions[k].op in _RECEIVES]
        if not receives:
            continue
        start.add(actions[receives[0]].op)
        if eager:
            for k in receives[:-1]:
                post_next[k] = True
            continue
        if receives[0] != positions[0]:
            start.discard(actions[receives[0]].op)
        for before, k in zip(positions, positions[1:]):
            if actions[k].op in _RECEIVES:
                post_next[before] = True
    return PostingPlan(frozenset(start), tuple(post_next))


def evaluation_actions(num_stages: int, stage: int, index: int) -> list[Action]:
    """What ``stage`` does for one evaluation batch (``index`` numbers them; rendered as step ``-1-index``)."""
    _check_position(num_stages, stage, 0, 0)
    step = -1 - index
    out = []
    if stage > 0:
        out.append(Action(stage, Op.RECV_F, step, 0, 0))
    out.append(Action(stage, Op.FORWARD, step, 0, 0))
    if stage < num_stages - 1:
        out.append(Action(stage, Op.SEND_F, step, 0, 0))
    return out


# A transfer operation in the model: (role "S"/"R", link (lower stage, upper stage), message), the message
# being (direction "F"/"B", step, micro-batch).
_TransferOp = tuple[str, tuple[int, int], tuple[str, int, int]]


def _transfer_op(a: Action, role: str | None = None) -> _TransferOp:
    peer = a.peer
    assert peer is not None
    forward = a.op in (Op.SEND_F, Op.RECV_F)
    if role is None:
        role = "S" if a.op in (Op.SEND_F, Op.SEND_B) else "R"
    return (role, (min(a.stage, peer), max(a.stage, peer)), ("F" if forward else "B", a.step, a.microbatch))


def host_program(segments: Iterable[Sequence[Action]], eager: bool = False) -> list[tuple]:
    """What one stage's host does with transfers, segment after segment, under :func:`posting_plan`.

    Items are ``("post", ops)`` (one :func:`torch.distributed.batch_isend_irecv` call) and
    ``("wait", op)`` (waiting for a receive before the compute that needs it). A wait on NCCL does not
    block the host but orders the compute stream behind the transfer, and every later send or receive
    is ordered behind that compute, so blocking the host at the wait models the same dependencies.
    """
    items: list[tuple] = []
    for actions in segments:
        plan = posting_plan(actions, eager)
        pending = {op: [a for a in actions if a.op is op] for op in _RECEIVES}
        posted: dict[Op, _TransferOp] = {}

        def next_receive(op: Op) -> list[_TransferOp]:
            if op in posted or not pending[op]:
                return []
            posted[op] = _transfer_op(pending[op].pop(0))
            return [posted[op]]

        for op in sorted(plan.start):
            items.append(("post", tuple(next_receive(op))))
        for k, a in enumerate(actions):
            if not a.is_comm:
                continue
            receive_op = Op.RECV_F if a.op in _PREV_LINK else Op.RECV_B
            if a.op in _RECEIVES:
                if a.op not in posted:
                    items.append(("post", tuple(next_receive(a.op))))
                expected = _transfer_op(a)
                if posted.pop(a.op) != expected:
                    raise AssertionError(f"stage {a.stage}: receives posted out of order at {a}")
                items.append(("wait", expected))
                if plan.post_next[k] and (more := next_receive(receive_op)):
                    items.append(("post", tuple(more)))
            else:
                batch = [_transfer_op(a)]
                if plan.post_next[k]:
                    batch += next_receive(receive_op)
                items.append(("post", tuple(batch)))
        if posted:
            raise AssertionError(f"receives {sorted(posted.values())} stay posted after the segment")
    return items


def check_transfers(programs: Sequence[Sequence[tuple]], rendezvous: bool = True, per_link: bool = True) -> None:
    """Run the stages' :func:`host_program` against each other under NCCL's point-to-point semantics.

    Model: each stage posts batches on a queue per link (``per_link=False``: one queue per stage, as
    when all links share one communicator); a queue starts its next batch only once the previous one has
    completed, and a batch completes when each of its operations has. A receive completes once the
    peer's matching send has started (its batch is at the head of the peer's queue); with ``rendezvous``
    a send also waits for the matching receive to start (large NCCL messages do), otherwise it completes
    as soon as it starts. A stage's host blocks at a wait until the receive's batch has completed.

    Raises ``AssertionError`` naming where each stage is stuck if the programs deadlock, or if anything
    is left posted at the end.
    """
    P = len(programs)
    pc = [0] * P
    queues: dict[tuple, collections.deque] = collections.defaultdict(collections.deque)
    where: dict[tuple, tuple] = {}  # (stage, op) -> its batch
    done: set[tuple] = set()  # (stage, op) completed
    finished: set[int] = set()  # ids of completed batches

    def queue_of(stage: int, op: _TransferOp) -> tuple:
        return (stage, op[1]) if per_link else (stage,)

    def peer_of(stage: int, op: _TransferOp) -> tuple[int, _TransferOp]:
        low, high = op[1]
        return (high if stage == low else low), ("R" if op[0] == "S" else "S", op[1], op[2])

    def started(stage: int, op: _TransferOp) -> bool:
        batch = where.get((stage, op))
        return batch is not None and (queues[queue_of(stage, op)] or [None])[0] is batch

    progress = True
    while progress:
        progress = False
        for s in range(P):
            while pc[s] < len(programs[s]):
                kind, arg = programs[s][pc[s]]
                if kind == "post":
                    if not arg:
                        pc[s] += 1
                        continue
                    batch = (id(arg), s, arg)
                    keys = {queue_of(s, op) for op in arg}
                    if len(keys) != 1:
                        raise AssertionError(f"stage {s}: one batch spans several queues: {arg}")
                    queues[keys.pop()].append(batch)
                    for op in arg:
                        where[(s, op)] = batch
                elif id(where[(s, arg)]) not in finished:
                    break
                pc[s] += 1
                progress = True
        for key, queue in list(queues.items()):
            while queue:
                batch = queue[0]
                s, ops = batch[1], batch[2]
                for op in ops:
                    if (s, op) in done:
                        continue
                    peer, match = peer_of(s, op)
                    if (op[0] == "S" and not rendezvous) or started(peer, match) or (peer, match) in done:
                        done.add((s, op))
                if not all((s, op) in done for op in ops):
                    break
                queue.popleft()
                finished.add(id(batch))
                progress = True
    stuck = [f"stage {s} waits at {programs[s][pc[s]]}" for s in range(P) if pc[s] < len(programs[s])]
    left = [f"stage {b[1]} has {b[2]} posted" for q in queues.values() for b in q]
    if stuck or left:
        _fail("transfers deadlock: " + "; ".join((stuck + left)[:6]))
