"""The schedule IR: :class:`Op`, :class:`Action`, the schedule kinds and their weight versions.

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
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field

__all__ = [
    "SCHEDULES",
    "Action",
    "Op",
    "require_int",
    "require_position",
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
            kind: the schedule kind (one of :data:`SCHEDULES`), which fixes the version of a forward,
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
        raise ValueError(f"the weight version of {text!r} depends on the schedule; pass kind (one of {SCHEDULES})")
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
        kind: one of :data:`SCHEDULES`.
        num_stages: number of pipeline stages ``P`` (>= 1).
        num_microbatches: micro-batches per optimizer step ``M`` (>= 1; >= P for "2bw").
    """
    if kind not in SCHEDULES:
        known = ", ".join(repr(k) for k in SCHEDULES)
        raise ValueError(f"unknown pipeline schedule {kind!r}; expected one of {known}")
    require_int("num_stages", num_stages, 1)
    require_int("num_microbatches", num_microbatches, 1)
    # With M < P the first stage keeps micro-batches of three steps in flight
    # across two updates, which two weight buffers cannot hold.
    if kind == "2bw" and num_microbatches < num_stages:
        raise ValueError(
            f"the '2bw' schedule needs num_microbatches >= the number of pipeline stages, got "
            f"num_microbatches={num_microbatches} with {num_stages} stages; set num_microbatches >= "
            f"{num_stages} (or use schedule='1f1b')"
        )


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
    if kind not in SCHEDULES:
        validate(kind, 1, 1)
    return step - 1 if kind == "2bw" else step


def weight_buffer(version: int) -> int:
    """Index of the 2BW buffer holding ``version`` (``-1 -> 1``; both start as w[0])."""
    return version % 2
