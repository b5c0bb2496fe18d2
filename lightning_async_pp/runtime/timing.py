"""Where a stage's time goes: per-step statistics, the action trace, and their relay to global rank 0.

:class:`StepTimer` times a stage's actions with an :class:`ActionClock` and sums them into one
:class:`StepStats` per step; with a trace, it also keeps the start and end of every action.

Every stage but the one on rank 0 posts a small non-blocking send per step (:class:`StatsRelay`); rank 0
polls its posted receives between steps and hands complete records to a callback. A blocking gather would
make every stage wait for the slowest one at every step, which is exactly the bubble 2BW removes.
"""

from __future__ import annotations

import collections
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_async_pp.files import atomic_write_text
from lightning_async_pp.schedule import Action, Op

FIELDS = ("step", "wall", "forward", "backward", "wait", "update", "version_lag", "aux_loss")
_TIMED = {Op.FORWARD: "forward", Op.BACKWARD: "backward", Op.RECV_F: "wait", Op.RECV_B: "wait", Op.UPDATE: "update"}


@dataclass
class StepStats:
    """Where one stage's time went while the trainer processed one step (seconds)."""

    step: int
    wall: float = 0.0
    forward: float = 0.0
    backward: float = 0.0
    wait: float = 0.0
    update: float = 0.0
    version_lag: int = 0
    aux_loss: float = math.nan
    """Mean over the step's forwards of the auxiliary losses recorded on the stage (NaN: none); see
    :mod:`~lightning_async_pp.runtime.auxiliary`."""

    @property
    def bubble_fraction(self) -> float:
        return self.wait / self.wall if self.wall > 0 else 0.0


class ActionClock:
    """Marks points in a stage's work: CUDA events on a CUDA device (device time, read once the device got
    there, so timing never makes the host wait), the wall clock otherwise. Either way a wait for a transfer
    counts as the time the stage's compute stood still.

    CUDA events are pooled: a mark that has been read is handed back (:meth:`release`) and recorded again
    later, so the steady state creates no events.

    Args:
        device: The stage's device.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self._origin: tuple[Any, float] | None = None
        self._free: list[Any] = []

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        if self._origin is None:  # ties device time to the host clock, for the trace; never reused
            origin = torch.cuda.Event(enable_timing=True)
            origin.record()
            self._origin = (origin, time.perf_counter())
        event = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def release(self, mark: Any) -> None:
        """Hand back a mark whose time has been read (a CUDA event is recorded again by a later :meth:`mark`)."""
        if self.cuda:
            self._free.append(mark)

    def ready(self, mark: Any) -> bool:
        return not self.cuda or mark.query()

    def seconds(self, begin: Any, end: Any) -> float:
        if not self.cuda:
            return end - begin
        end.synchronize()
        return begin.elapsed_time(end) / 1e3

    def time(self, mark: Any) -> float:
        """Seconds on the host's ``perf_counter`` scale."""
        if not self.cuda:
            return mark
        assert self._origin is not None
        return self._origin[1] + self.seconds(self._origin[0], mark)


@dataclass
class _StepTiming:
    stats: StepStats | None  # None: actions of no step (a drain, an evaluation), kept for the trace only
    start: Any
    end: Any = None
    actions: list[tuple[str | None, Action, Any, Any]] = field(default_factory=list)
    aux_loss: Tensor | None = None  # host memory, filled by a copy queued before `end`


class StepTimer:
    """Times a stage's actions and turns them into one :class:`StepStats` per step, and into a trace.

    On CUDA the clock's marks are read only once the device has passed them, so a step's statistics usually
    come out a step or two after the step (:meth:`pop_ready`), never making the host wait, except at
    :meth:`resolve` with ``wait_beyond=0``.

    Args:
        device: The stage's device.
        trace: Keep the start and end time of every action in :attr:`events`.
        trace_window: How many actions :attr:`events` keeps (a sliding window, so long runs stay bounded).
        time_actions: Time every action, for the forward, backward, wait and update seconds of each step (two
            clock marks per action: CUDA events on a GPU). Off: only each step's wall time is measured and those
            fields are NaN; a trace times its actions regardless.
    """

    def __init__(
        self, device: torch.device, trace: bool = False, trace_window: int = 20_000, time_actions: bool = True
    ) -> None:
        self.clock = ActionClock(device)
        self.trace = trace
        self.time_actions = time_actions or trace
        self.events: collections.deque[tuple[str, float, float]] = collections.deque(maxlen=trace_window)
        """The traced actions as ``(label, start, end)``, in seconds on the host's ``perf_counter`` scale."""
        self._step: _StepTiming | None = None
        self._timings: collections.deque[_StepTiming] = collections.deque()
        self._ready: collections.deque[StepStats] = collections.deque()

    @property
    def active(self) -> bool:
        """Whether actions are timed now (inside a step, or always when tracing)."""
        return (self._step is not None and self.time_actions) or self.trace

    def begin_step(self, step: int) -> None:
        stats = StepStats(step)
        if not self.time_actions:
            stats.forward = stats.backward = stats.wait = stats.update = math.nan
        self._step = _StepTiming(stats, self.clock.mark())

    def end_step(self, version_lag: int, aux_loss: Tensor | None = None) -> None:
        """Close the step :meth:`begin_step` opened; read what the device has finished.

        Args:
            version_lag: The stage's version lag after the step.
            aux_loss: The step's auxiliary loss on the stage (a device scalar): copied to host memory without
                blocking, read with the step's clock marks.
        """
        timing, self._step = self._step, None
        assert timing is not None and timing.stats is not None
        if aux_loss is not None:
            on_cuda = aux_loss.is_cuda
            timing.aux_loss = torch.empty((), dtype=torch.float64, pin_memory=on_cuda)
            timing.aux_loss.copy_(aux_loss.detach(), non_blocking=on_cuda)
        timing.end = self.clock.mark()
        timing.stats.version_lag = version_lag
        self._timings.append(timing)
        self.resolve(wait_beyond=2)

    def record(self, action: Action, begin: Any, end: Any) -> None:
        """Count one action, which ran from clock mark ``begin`` to ``end``."""
        entry = (_TIMED.get(action.op), action, begin, end)
        if self._step is not None:
            self._step.actions.append(entry)
        else:  # traced, but part of no step's statistics
            self._timings.append(_StepTiming(None, begin, end, [entry]))

    def resolve(self, wait_beyond: int) -> None:
        """Read the timings the device has completed (and those older than ``wait_beyond`` records)."""
        clock = self.clock
        while self._timings:
            timing = self._timings[0]
            if len(self._timings) <= wait_beyond and not clock.ready(timing.end):
                break
            self._timings.popleft()
            stats = timing.stats
            for name, action, begin, end in timing.actions:
                if stats is not None and name is not None:
                    setattr(stats, name, getattr(stats, name) + clock.seconds(begin, end))
                if self.trace:
                    self.events.append((str(action), clock.time(begin), clock.time(end)))
                clock.release(begin)
                clock.release(end)
            if stats is not None:  # (a record of no step holds one action's marks, released above)
                stats.wall = clock.seconds(timing.start, timing.end)
                if timing.aux_loss is not None:  # host memory, written before the end mark: no device sync
                    stats.aux_loss = float(timing.aux_loss.numpy())  # numpy: refused for a device tensor
                self._ready.append(stats)
                clock.release(timing.start)
                clock.release(timing.end)

    def pop_ready(self) -> StepStats | None:
        """The oldest step whose statistics are known, or ``None``."""
        return self._ready.popleft() if self._ready else None

    def take(self) -> list[StepStats]:
        """Every step's statistics not handed out yet (waits for the device)."""
        self.resolve(wait_beyond=0)
        out = list(self._ready)
        self._ready.clear()
        return out


def encode(stats: StepStats) -> Tensor:
    return torch.tensor([float(getattr(stats, name)) for name in FIELDS], dtype=torch.float64)


def decode(values: Tensor) -> StepStats:
    record = dict(zip(FIELDS, values.tolist()))
    return StepStats(step=int(record.pop("step")), version_lag=int(record.pop("version_lag")), **record)


class StatsRelay:
    """Moves each stage's :class:`StepStats` to rank 0.

    Args:
        rank: This process's global rank.
        peers: Global ranks that report to rank 0 (the other stages of one pipeline).
        group: A gloo process group of rank 0 and ``peers``, used only for statistics, so that they never
            queue behind activations.
    """

    def __init__(self, rank: int, peers: list[int], group: dist.ProcessGroup | None) -> None:
        self.rank = rank
        self.peers = list(peers)
        self.group = group
        self._sends: list[tuple[dist.Work, Tensor]] = []
        self._recvs: dict[int, tuple[Tensor, dist.Work]] = {}
        self.sent = 0
        self.received = {peer: 0 for peer in self.peers}

    def publish(self, stats: StepStats) -> None:
        """Non-zero ranks: post the send of this step's record."""
        if self.rank not in self.peers:
            return
        values = encode(stats)
        self._sends = [(w, t) for w, t in self._sends if not w.is_completed()]
        self._sends.append((dist.isend(values, 0, group=self.group), values))
        self.sent += 1

    def poll(self, handle: Callable[[int, StepStats], None], steps: int, block: bool = False) -> None:
        """Rank 0: hand every arrived record to ``handle(rank, stats)``.

        Args:
            handle: Called once per record, in step order for each peer.
            steps: Steps run so far; every peer sends one record per step, so no receive is posted beyond.
            block: Wait until all ``steps`` records arrived from every peer (at the end of training).
        """
        if self.rank != 0:
            return
        for peer in self.peers:
            while self.received[peer] < steps:
                if peer not in self._recvs:
                    buffer = torch.empty(len(FIELDS), dtype=torch.float64)
                    self._recvs[peer] = (buffer, dist.irecv(buffer, peer, group=self.group))
                buffer, work = self._recvs[peer]
                if not block and not work.is_completed():
                    break
                work.wait()
                del self._recvs[peer]
                self.received[peer] += 1
                handle(peer, decode(buffer))

    def close(self) -> None:
        """Non-zero ranks: wait until rank 0 has taken every record."""
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()


def write_chrome_trace(stage_events: list[tuple[int, list[tuple[str, float, float]]]], directory: str) -> str:
    """Write every stage's action timings as one Chrome trace (one row per stage); returns its path.

    Args:
        stage_events: ``(stage, [(action, start, end), ...])`` per stage, times in seconds on one clock.
        directory: Created if missing; the file is ``pipeline_trace.json``, replaced atomically.
    """
    origin = min((events[0][1] for _, events in stage_events if events), default=0.0)
    trace = []
    for stage, events in sorted(stage_events):
        trace.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": stage, "args": {"name": f"stage {stage}"}})
        for name, start, end in events:
            trace.append(
                {
                    "name": name,
                    "cat": _op_of(name).value,
                    "ph": "X",
                    "pid": 0,
                    "tid": stage,
                    "ts": (start - origin) * 1e6,
                    "dur": (end - start) * 1e6,
                }
            )
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "pipeline_trace.json")
    atomic_write_text(path, json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}))
    return path


def _op_of(label: str) -> Op:
    """The op of a traced action's label (``"1RB4"`` -> ``RB``)."""
    # The label has no weight version, and the global micro-batch index is split by M: with M = 1 any kind
    # parses it, and the op does not depend on either.
    return Action.from_str(label, 1, kind="1f1b").op
