"""The schedule IR: :class:`Op`, :class:`Action`, and :class:`PipelineSchedule`, what a schedule kind answers.

Nothing here runs a model or touches ``torch.distributed``: a schedule is a
list of :class:`Action` per stage that a runtime executes in order. The design
follows ``torch.distributed.pipelining`` (schedules are data, lowered with
explicit send/recv actions) and DeepSpeed's ``runtime/pipe/schedule.py``.

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

Notation (``str(action)``, parsed back by :meth:`Action.from_str`):
``<stage><op><global micro-batch>``, where the global micro-batch is
``step * M + microbatch`` and ``op`` is the short code of :class:`Op`; e.g.
``"0F3"`` is stage 0's forward of global micro-batch 3, ``"1RB2"`` stage 1's
receive of the gradient for micro-batch 2. An update is ``<stage>U<step>``:
``"0U1"`` means stage 0 applies step 1's gradient. An :class:`Action` built
without ``num_microbatches`` renders the micro-batch as
``<step>.<microbatch>`` instead, e.g. ``"0F1.3"`` (evaluation batches, whose
steps are negative, print this way: ``"0F-1.0"``).

Kinds. Each kind is a :class:`PipelineSchedule` subclass in a registry keyed by its name
(:func:`register_schedule`, :func:`get_schedule`); the built-in ones are in
:mod:`~lightning_async_pp.schedule.kinds`, registered when the package is imported. Nothing outside the
kind's class asks which kind it is: every per-schedule fact is one of its attributes or methods.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

__all__ = [
    "STAGES_PER_PROCESS",
    "Action",
    "Op",
    "PipelineSchedule",
    "get_schedule",
    "lower",
    "register_schedule",
    "require_int",
    "require_position",
    "schedule_names",
    "validate",
    "weight_buffer",
    "weight_version",
]

STAGES_PER_PROCESS = 1
"""One pipeline stage per process: an assumption of every layer, stated here once.

An action's ``stage`` is also the process that runs it, so :attr:`Action.peer` (``stage ± 1``) is the
neighbouring process; ``StageRuntime``'s ``prev``/``next`` links go to the processes of stages ``s - 1`` and
``s + 1``; ``PipelineDims.stage_of`` maps a rank to exactly one stage, and the layers are placed as one
contiguous slice per stage. A schedule with several (virtual) stages per process, such as interleaved 1F1B,
would replace these with a map from virtual stage to process.
"""


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
# Two-letter codes first, so that a one-letter code never matches the tail of one.
_ACTION_RE = re.compile(
    r"(?P<stage>\d+)(?P<op>{})(?P<index>-?\d+)(?:\.(?P<microbatch>\d+))?".format(
        "|".join(op.value for op in sorted(Op, key=lambda op: -len(op.value)))
    )
)


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
        """The stage on the other end of a send/recv (``None`` for compute): a neighbour, as each process runs
        one stage (:data:`STAGES_PER_PROCESS`)."""
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

    @classmethod
    def from_str(cls, text: str, num_microbatches: int | None = None, *, kind: str | None = None) -> Action:
        """Parse what ``str(action)`` prints: ``"0F3"``, ``"1RB2"``, ``"0U1"``, ``"0F1.3"``, ``"0F-1.0"``.

        The printed form has no weight version; it is the one the action has in a schedule: ``step + 1``
        for an ``UPDATE``, ``0`` for an evaluation batch (negative step), otherwise
        :func:`weight_version` of ``kind``. So ``Action.from_str(str(a), a.num_microbatches or None,
        kind=kind) == a`` for every action that :func:`~lightning_async_pp.schedule.build_schedule` and
        :func:`~lightning_async_pp.schedule.evaluation_actions` produce, and
        ``str(Action.from_str(text, ...)) == text`` for every text accepted.

        Args:
            text: the printed action.
            num_microbatches: ``M``; needed to split a global micro-batch index (``"0F3"``) into step and
                micro-batch, and kept on the result so that it prints the same way. With the
                ``<step>.<microbatch>`` form it only bounds the micro-batch, and the result, like the
                action that printed it, has no ``num_microbatches``.
            kind: the schedule kind (a name of :func:`get_schedule`), which fixes the version of a forward,
                backward, send or receive of a training step; not needed for updates and evaluation.

        Raises:
            ValueError: if ``text`` is not a printed action, or what it needs to be parsed is missing.
        """
        if not isinstance(text, str):
            raise ValueError(f"an action is parsed from a str, got {type(text).__name__} ({text!r})")
        match = _ACTION_RE.fullmatch(text)
        if match is None:
            codes = "/".join(op.value for op in Op)
            raise ValueError(
                f"{text!r} is not an action: expected <stage><op><global micro-batch> (e.g. '0F3', '1RB2'), "
                f"<stage><op><step>.<microbatch> (e.g. '0F1.3') or <stage>U<step> (e.g. '0U1'), op one of {codes}"
            )
        if num_microbatches is not None:
            require_int("num_microbatches", num_microbatches, 1)
        action = _from_match(text, match, num_microbatches or 0, kind)
        if str(action) != text:
            raise ValueError(f"{text!r} is not how the action prints; it prints as {str(action)!r}")
        return action


def _from_match(text: str, match: re.Match, num_microbatches: int, kind: str | None) -> Action:
    stage, op, index = int(match["stage"]), Op(match["op"]), int(match["index"])
    if op is Op.UPDATE:
        if match["microbatch"] is not None:
            raise ValueError(f"{text!r}: an update names its step only, as in '{stage}U{index}'")
        return Action(stage, op, index, -1, index + 1, num_microbatches)
    if match["microbatch"] is not None:
        step, microbatch = index, int(match["microbatch"])
        if num_microbatches and microbatch >= num_microbatches:
            raise ValueError(f"{text!r}: micro-batch {microbatch} is not below num_microbatches={num_microbatches}")
        # As printed: the action that prints this form has no num_microbatches.
        num_microbatches = 0
    elif num_microbatches:
        step, microbatch = divmod(index, num_microbatches)
    else:
        raise ValueError(
            f"{text!r} names global micro-batch {index}; pass num_microbatches to split it into step and micro-batch"
        )
    if step < 0:
        version = 0
    elif kind is None:
        raise ValueError(
            f"the weight version of {text!r} depends on the schedule; pass kind (one of {schedule_names()})"
        )
    else:
        version = weight_version(kind, step)
    return Action(stage, op, step, microbatch, version, num_microbatches)


# --------------------------------------------------------------------------- validation


def is_int(value: object) -> bool:
    """Whether ``value`` is an integer: an ``int`` that is not a ``bool`` (``True`` is an ``int`` to Python)."""
    return isinstance(value, int) and not isinstance(value, bool)


def require_int(name: str, value: object, minimum: int) -> None:
    """Raise a ``TypeError`` unless ``value`` is an int (not a bool), a ``ValueError`` if below ``minimum``."""
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def validate(kind: str, num_stages: int, num_microbatches: int) -> None:
    """Raise a ``ValueError`` saying what to change if the configuration is invalid.

    Args:
        kind: a registered schedule's name (see :func:`get_schedule`).
        num_stages: number of pipeline stages ``P`` (>= 1).
        num_microbatches: micro-batches per optimizer step ``M`` (>= 1; >= P for "2bw").
    """
    get_schedule(kind).validate(num_stages, num_microbatches)


def require_position(num_stages: int, stage: int, step: int, run_start: int) -> None:
    """Raise unless ``stage`` is a stage of ``num_stages`` and ``run_start <= step`` (both >= 0)."""
    require_int("stage", stage, 0)
    if stage >= num_stages:
        raise ValueError(f"stage must be < num_stages={num_stages}, got {stage}")
    require_int("run_start", run_start, 0)
    require_int("step", step, 0)
    if step < run_start:
        raise ValueError(f"step {step} precedes the start of its run (run_start={run_start})")


# --------------------------------------------------------------------------- versions


def weight_version(kind: str, step: int) -> int:
    """Weight version that every forward/backward of ``step`` uses."""
    return get_schedule(kind).weight_version(step)


def weight_buffer(version: int) -> int:
    """Index of the 2BW buffer holding ``version`` (``-1 -> 1``; both start as w[0])."""
    return version % 2


# --------------------------------------------------------------------------- lowering


def lower(actions: Iterable[Action], num_stages: int) -> list[Action]:
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


# --------------------------------------------------------------------------- kinds


class PipelineSchedule:
    """A schedule kind: every question whose answer depends on the schedule, answered by its subclass.

    A subclass sets the class attributes, implements the methods that raise ``NotImplementedError`` and is
    registered with :func:`register_schedule`; the generation (:mod:`~lightning_async_pp.schedule.generate`),
    the check (:func:`~lightning_async_pp.schedule.check`), the runtime and the strategy ask it, never its name.
    Instances hold no state: :func:`get_schedule` returns one per name.

    Attributes:
        name: the ``schedule=`` string that selects it.
        num_weight_versions: weight versions a stage keeps alive at once (its weight buffers); version ``v``
            lives in buffer ``v % num_weight_versions``.
        delay: steps between the version a step's gradient is computed on and the version it is applied to:
            ``UPDATE(t)`` applies the gradient of version ``t - delay`` to version ``t``. Every stage has it.
        checkpoint_lags: the versions a checkpoint holds, as steps behind the newest one (``(0, 1)``: the
            newest weights and the ones before, which the next steps still run on).
    """

    name: ClassVar[str]
    num_weight_versions: ClassVar[int]
    delay: ClassVar[int]
    checkpoint_lags: ClassVar[tuple[int, ...]]

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    # --- configuration and versions

    def validate(self, num_stages: int, num_microbatches: int) -> None:
        """Raise a ``ValueError`` (``TypeError`` for a non-int) saying what to change if ``P``/``M`` do not fit."""
        require_int("num_stages", num_stages, 1)
        require_int("num_microbatches", num_microbatches, 1)

    def weight_version(self, step: int) -> int:
        """Weight version that every forward/backward of ``step`` uses."""
        return step - self.delay

    def stage_delays(self, num_stages: int) -> list[int]:
        """Each stage's gradient delay in steps (see :attr:`delay`)."""
        return [self.delay] * num_stages

    @property
    def reference_delay(self) -> int:
        """The delay of the one-device run a pipeline must equal: ``1`` is
        :class:`~lightning_async_pp.reference.delayed.DelayedWeights`, ``0`` plain training."""
        return self.delay

    def buffer_of(self, version: int) -> int:
        """The weight buffer that holds ``version`` (version ``-1`` is the initial weights, like version 0)."""
        return version % self.num_weight_versions

    def flush_steps(self, num_steps: int, run_starts: tuple[int, ...]) -> Sequence[int]:
        """The steps before which the pipeline is empty, besides step 0 (``run_starts``: where runs begin)."""
        return run_starts[1:]

    def max_in_flight(self, num_stages: int, num_microbatches: int, stage: int) -> int:
        """Most micro-batches ``stage`` has forwarded and not yet backwarded (its stashed activations)."""
        raise NotImplementedError

    def updates_settled_by(self, num_stages: int) -> int | None:
        """The micro-batch of step ``t + 1`` whose forward, on every stage, follows every stage's ``UPDATE(t)``
        through the pipeline's own messages; ``None`` if version ``t + 1`` is needed at once."""
        raise NotImplementedError

    # --- actions

    def step_actions(
        self, num_stages: int, num_microbatches: int, stage: int, step: int, run_start: int, with_comm: bool
    ) -> list[Action]:
        """Actions ``stage`` executes while the trainer processes batch ``step`` (after checking the arguments)."""
        self.validate(num_stages, num_microbatches)
        require_position(num_stages, stage, step, run_start)
        out = self.compute_step(num_stages, num_microbatches, stage, step, run_start)
        return lower(out, num_stages) if with_comm else out

    def drain_actions(
        self, num_stages: int, num_microbatches: int, stage: int, last_step: int, run_start: int, with_comm: bool
    ) -> list[Action]:
        """What ``stage`` still has to do to empty the pipeline after ``last_step``."""
        self.validate(num_stages, num_microbatches)
        require_position(num_stages, stage, last_step, run_start)
        out = self.compute_drain(num_stages, num_microbatches, stage, last_step, run_start)
        return lower(out, num_stages) if with_comm else out

    @staticmethod
    def evaluation_actions(num_stages: int, stage: int, index: int, num_microbatches: int) -> list[Action]:
        """One evaluation batch, forwards only: each micro-batch received, forwarded and sent on before the next;
        rendered as step ``-1-index`` on version 0. The same for every schedule (evaluation has no update)."""
        require_position(num_stages, stage, 0, 0)
        require_int("num_microbatches", num_microbatches, 1)
        step = -1 - index
        out = []
        for mb in range(num_microbatches):
            if stage > 0:
                out.append(Action(stage, Op.RECV_F, step, mb, 0))
            out.append(Action(stage, Op.FORWARD, step, mb, 0))
            if stage < num_stages - 1:
                out.append(Action(stage, Op.SEND_F, step, mb, 0))
        return out

    def compute_step(
        self, num_stages: int, num_microbatches: int, stage: int, step: int, run_start: int
    ) -> list[Action]:
        """The forwards, backwards and updates of :meth:`step_actions`, before communication is lowered."""
        raise NotImplementedError

    def compute_drain(
        self, num_stages: int, num_microbatches: int, stage: int, last_step: int, run_start: int
    ) -> list[Action]:
        """The backwards and updates of :meth:`drain_actions`, before communication is lowered."""
        raise NotImplementedError

    def last_gradient_before_forward(self, num_stages: int, num_microbatches: int, stage: int, index: int) -> int:
        """The global micro-batch whose gradient ``stage`` received last before the forward of global micro-batch
        ``index`` (gradients arrive in order; the caller drops those before the run)."""
        raise NotImplementedError

    def compute_action(self, stage: int, op: Op, index: int, num_microbatches: int) -> Action:
        """The forward or backward of global micro-batch ``index``, on its step's version."""
        step, microbatch = divmod(index, num_microbatches)
        return Action(stage, op, step, microbatch, self.weight_version(step), num_microbatches)

    @staticmethod
    def update_action(stage: int, step: int, num_microbatches: int) -> Action:
        """``UPDATE(step)``, producing version ``step + 1``."""
        return Action(stage, Op.UPDATE, step, -1, step + 1, num_microbatches)


_REGISTRY: dict[str, PipelineSchedule] = {}


def register_schedule(cls: type[PipelineSchedule]) -> type[PipelineSchedule]:
    """Class decorator: make ``cls`` the schedule selected by ``cls.name``."""
    if cls.name in _REGISTRY:
        raise ValueError(f"a schedule named {cls.name!r} is registered already ({_REGISTRY[cls.name]!r})")
    _REGISTRY[cls.name] = cls()
    return cls


def schedule_names() -> tuple[str, ...]:
    """The registered schedules' names, in the order they were registered."""
    return tuple(_REGISTRY)


def get_schedule(name: str) -> PipelineSchedule:
    """The schedule registered as ``name``.

    Raises:
        ValueError: naming the registered schedules, if none is called ``name``.
    """
    schedule = _REGISTRY.get(name) if isinstance(name, str) else None
    if schedule is None:
        known = ", ".join(repr(k) for k in _REGISTRY)
        raise ValueError(f"unknown pipeline schedule {name!r}; expected one of {known}")
    return schedule
