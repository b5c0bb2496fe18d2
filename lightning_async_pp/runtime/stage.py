"""Executes one stage's schedule: forwards, backwards, transfers and weight updates.

The runtime is an interpreter for the action lists of :mod:`lightning_async_pp.schedule`; it
knows nothing of Lightning. One process runs one :class:`StageRuntime`.

Weight versions. Each stage keeps ``num_buffers`` copies of its trainable parameters (two for ``"2bw"``,
one for ``"1f1b"``), as separate leaf tensors, and runs its layers with
:func:`torch.func.functional_call` on the copy of the version a micro-batch was pinned to. The optimizer's
own ``nn.Parameter`` objects alias the newest copy, so optimizer state, schedulers and checkpoints see
ordinary parameters. An update writes the new version into the copy nobody uses any more (its
micro-batches are all done), never into a tensor an in-flight autograd graph saved.

Recomputation. A layer that recomputes its forward in backward (``torch.utils.checkpoint``) reads its
parameters again then, so every backward runs under the same re-parametrization as its forward: the
recompute sees the micro-batch's version, never the newest one.

Tied weights. A parameter that layers of several stages share has a copy on each of them; ``ties`` sums
their gradients before each update (see :mod:`lightning_async_pp.runtime.ties`), so the copies stay equal.

Update timing. ``UPDATE(t)`` runs as soon as the stage's last backward of step ``t`` is done. With
gradient clipping, the global norm needs every stage's share, so the stage posts a non-blocking
all-reduce and applies the update only when the new version is first needed (the first forward of step
``t + 2``), which keeps the pipeline free of a barrier.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.func import functional_call
from torch.nn.utils.stateless import _reparametrize_module
from torch.optim import Optimizer

from lightning_async_pp.runtime import activations
from lightning_async_pp.runtime.activations import Spec
from lightning_async_pp.runtime.comm import Channel
from lightning_async_pp.runtime.contract import Stage
from lightning_async_pp.runtime.fingerprint import FingerprintCheck, fingerprint
from lightning_async_pp.runtime.host_flag import HostFlag
from lightning_async_pp.runtime.microbatch import split_microbatches
from lightning_async_pp.runtime.ties import TiedGradients
from lightning_async_pp.schedule import (
    Action,
    Op,
    drain_actions,
    posting_plan,
    step_actions,
    validate,
    weight_version,
)

Key = tuple[int, int]  # (step, micro-batch)
_RECEIVES = (Op.RECV_F, Op.RECV_B)
_TIMED = {Op.FORWARD: "forward", Op.BACKWARD: "backward", Op.RECV_F: "wait", Op.RECV_B: "wait", Op.UPDATE: "update"}
_NOT_HYPERPARAMETERS = ("params", "param_names")


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

    @property
    def bubble_fraction(self) -> float:
        return self.wait / self.wall if self.wall > 0 else 0.0


@dataclass
class _StepTiming:
    stats: StepStats | None
    start: Any
    end: Any = None
    actions: list[tuple[str | None, str, Any, Any]] = field(default_factory=list)


class ActionClock:
    """Marks points in a stage's work: CUDA events on a CUDA device (device time, read once the device got
    there, so timing never makes the host wait), the wall clock otherwise. Either way a wait for a transfer
    counts as the time the stage's compute stood still.

    Args:
        device: The stage's device.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self._origin: tuple[Any, float] | None = None

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        if self._origin is None:  # ties device time to the host clock, for the trace
            self._origin = (event, time.perf_counter())
        return event

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
class _PendingUpdate:
    step: int
    grads: dict[str, Tensor]
    norm_sq: Tensor | None = None
    work: Any = None
    finish: Callable[[], Tensor | None] | None = None  # completes the tied-gradient sums (and the norm)


@dataclass
class StageRuntime:
    """One pipeline stage.

    Args:
        kind: ``"2bw"`` or ``"1f1b"``.
        stage: This stage's index.
        num_stages: Number of stages.
        num_microbatches: Micro-batches per step.
        layers: This stage's layers, in order.
        optimizer: Optimizer over exactly the trainable parameters of ``layers``.
        inputs_fn: First stage: turns a micro-batch into the first layer's input.
        loss_fn: Last stage: ``loss_fn(output, microbatch)``, a scalar mean over the micro-batch.
        device: Device of the stage.
        prev_rank: Global rank of the previous stage (``None`` on the first stage).
        next_rank: Global rank of the next stage (``None`` on the last stage).
        clip_grad_norm: Clip the gradient of each step to this global norm (across all stages).
        norm_group: Process group of all stages of this pipeline, for the clipping norm.
        data_group: Process group of this stage's replicas (data parallelism): their gradients are averaged
            before each update. ``None`` without replicas.
        p2p_group: Process group of the activation and gradient transfers. Give each its own group: gloo
            numbers a group's collectives with the same tags that point-to-point messages use.
        forward_context: Context manager factory around forwards (e.g. autocast).
        trace: Record the start and end time of every action (the last ``trace_window`` actions).
        trace_window: How many actions the trace keeps (a sliding window, so long runs stay bounded).
        start_version: Weight version the parameters hold (non-zero when resuming).
        check_data_order: Send a fingerprint of each micro-batch with its activation and stop with
            :class:`~lightning_async_pp.runtime.fingerprint.DataOrderError` when a stage's own micro-batch does
            not match the previous stage's. On CPU the check stops the micro-batch before its forward; on a GPU
            the result is read without waiting for the device, at the latest two steps later and at every
            :meth:`drain`. Every stage of a pipeline must agree on it.
        before_update: Called once per step when the stage's gradient of that step is complete (averaged over
            the replicas, not yet clipped), with the gradient in the parameters' ``.grad``, before the norm for
            clipping is taken and the update applied. It may read or change the gradients in place. A tied
            parameter's gradient is still this stage's share (the sum over its stages follows).
        check_finite: Stop with an error naming the step and micro-batch when a loss is NaN or infinite. The
            check never waits for the device: each step's flag is copied to the host without blocking and
            read once the device is done with that step, at the latest two steps later and at every
            :meth:`drain` (so before any validation, checkpoint or the end of training). See
            :class:`FiniteCheck`.
        ties: Sums the gradients of parameters this stage shares with other stages (tied weights).
    """

    kind: str
    stage: int
    num_stages: int
    num_microbatches: int
    layers: Sequence[nn.Module]
    optimizer: Optimizer
    inputs_fn: Callable[[Any], Tensor]
    loss_fn: Callable[[Tensor, Any], Tensor]
    device: torch.device
    prev_rank: int | None = None
    next_rank: int | None = None
    clip_grad_norm: float | None = None
    norm_group: Any = None
    p2p_group: Any = None
    data_group: Any = None
    forward_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    trace: bool = False
    start_version: int = 0
    check_finite: bool = True
    before_update: Callable[[], None] | None = None
    ties: TiedGradients | None = None
    check_data_order: bool = True
    trace_window: int = 20_000
    events: collections.deque[tuple[str, float, float]] = field(default_factory=collections.deque)

    def __post_init__(self) -> None:
        validate(self.kind, self.num_stages, self.num_microbatches)
        self.module = Stage(*self.layers)
        self.params = {name: p for name, p in self.module.named_parameters() if p.requires_grad}
        self.num_buffers = 2 if self.kind == "2bw" else 1
        # The newest version's buffer aliases the parameters; the other 2BW buffer starts as a copy
        # (w[-1] = w[0] at the start of training; a resumed run overwrites it with the saved version).
        # `.data` (unlike `.detach()`) gives a tensor with its own autograd version counter: the optimizer's
        # in-place steps on a parameter must not look like edits of a buffer an in-flight graph saved.
        newest = {n: p.data.requires_grad_(True) for n, p in self.params.items()}
        self.buffers: list[dict[str, Tensor]] = [newest]
        if self.num_buffers == 2:
            copy = {n: p.detach().clone().requires_grad_(True) for n, p in self.params.items()}
            self.buffers = [newest, copy] if self.start_version % 2 == 0 else [copy, newest]
        self.newest_version = self.start_version
        self.run_start: int | None = None
        self.last_step: int | None = None
        self.is_first = self.stage == 0
        self.is_last = self.stage == self.num_stages - 1
        self.prev = self.next = None
        if self.prev_rank is not None:
            self.prev = Channel(
                self.prev_rank, self.device, self.p2p_group, f"stage {self.stage} <- stage {self.stage - 1}"
            )
        if self.next_rank is not None:
            self.next = Channel(
                self.next_rank, self.device, self.p2p_group, f"stage {self.stage} <- stage {self.stage + 1}"
            )
        self._microbatches: dict[int, list[Any]] = {}
        # What travels may be several tensors (see `activations`): a received input keeps its spec, and an
        # in-flight micro-batch keeps the specs of its input and output, so each gradient finds its tensor.
        self._inflight: dict[Key, tuple[Any, Spec | None, Any, Spec | None]] = {}
        self._pinned: dict[Key, dict[str, Tensor]] = {}  # the weights each in-flight micro-batch runs on
        self._received: dict[Key, tuple[Any, Spec]] = {}
        self._input_grads: dict[Key, list[Tensor]] = {}
        self._recv_spec: Spec | None = None  # of the messages from the previous stage, learnt once per layout
        self._send_spec: Spec | None = None  # of the messages to the next stage, fixed once per layout
        self._losses: dict[int, list[Tensor]] = {}
        self._finite_checks: collections.deque[FiniteCheck] = collections.deque()
        self._fingerprints: dict[Key, Tensor] = {}  # received from the previous stage, then this stage's to send
        self._order_checks: collections.deque[tuple[int, FingerprintCheck]] = collections.deque()
        self._hyperparameters: dict[int, list[dict[str, Any]]] = {}
        # Param-group keys set from outside the optimizer (a scheduler, the user): only those are versioned per
        # step. Keys the optimizer writes itself (schedule-free's `k`, Prodigy's `d`) are its own state.
        self._external_keys: set[str] = set()
        self._last_seen: list[dict[str, Any]] | None = None
        self._pending: list[_PendingUpdate] = []
        self._timing: _StepTiming | None = None
        self._clock = ActionClock(self.device)
        self._timings: collections.deque[_StepTiming] = collections.deque()
        self._ready_stats: collections.deque[StepStats] = collections.deque()
        self.events = collections.deque(self.events, maxlen=self.trace_window)
        self.versions_used: dict[int, int] = {}  # step -> weight version its micro-batches ran on (recent steps)
        self.update_log: collections.deque[tuple[int, int, int]] = collections.deque(maxlen=1024)
        """Recent updates as (step, version the gradient was computed on, version produced)."""

    # --- public API ------------------------------------------------------------------------------------

    def run_step(self, step: int, batch: Any) -> tuple[Tensor | None, StepStats | None]:
        """Execute this stage's share of ``step``.

        Returns the step's mean loss (last stage, a device tensor) and the timings of the oldest step whose
        timings are known: on CPU this step's; on CUDA, where they are read from events once the device has
        run the step, usually an earlier step's (``StepStats.step`` says which), or ``None``. The rest come
        from :meth:`take_stats`.
        """
        self._read_finite_checks(wait_beyond=2)
        self._read_order_checks(oldest_step=step - 2)
        if self.run_start is None:
            self.run_start = step
            self._forget_layouts()  # evaluation may have sent other shapes since the last run
        timing = self._timing = _StepTiming(StepStats(step), self._clock.mark())
        self._hyperparameters[step] = self._observe_hyperparameters()
        self._microbatches[step] = split_microbatches(batch, self.num_microbatches)
        self._execute(step_actions(self.kind, self.num_stages, self.num_microbatches, self.stage, step, self.run_start))
        self.last_step = step
        del self._microbatches[step]
        self.versions_used.pop(step - 3, None)
        loss = None
        if self.is_last:
            losses = torch.stack(self._losses.pop(step))
            if self.check_finite:
                self._finite_checks.append(FiniteCheck(losses, step, self.stage))
            loss = losses.mean()
        self._timing = None
        stats = timing.stats
        timing.end = self._clock.mark()
        if self.update_log:
            applied_step, gradient_version, produced = self.update_log[-1]
            stats.version_lag = (produced - 1) - max(gradient_version, 0)
        self._timings.append(timing)
        self._resolve_timings(wait_beyond=2)
        return loss, (self._ready_stats.popleft() if self._ready_stats else None)

    def take_stats(self) -> list[StepStats]:
        """The timings of every step run so far that :meth:`run_step` has not returned yet (waits for the device)."""
        self._resolve_timings(wait_beyond=0)
        out = list(self._ready_stats)
        self._ready_stats.clear()
        return out

    def _resolve_timings(self, wait_beyond: int) -> None:
        """Read the timings the device has completed (and those older than ``wait_beyond`` records)."""
        while self._timings:
            timing = self._timings[0]
            if len(self._timings) <= wait_beyond and not self._clock.ready(timing.end):
                break
            self._timings.popleft()
            stats = timing.stats
            for name, label, begin, end in timing.actions:
                if stats is not None and name is not None:
                    setattr(stats, name, getattr(stats, name) + self._clock.seconds(begin, end))
                if self.trace:
                    self.events.append((label, self._clock.time(begin), self._clock.time(end)))
            if stats is not None:
                stats.wall = self._clock.seconds(timing.start, timing.end)
                self._ready_stats.append(stats)

    def drain(self) -> None:
        """Finish every started micro-batch and apply every pending update (empties the pipeline)."""
        if self.run_start is not None and self.last_step is not None:
            self._execute(
                drain_actions(
                    self.kind, self.num_stages, self.num_microbatches, self.stage, self.last_step, self.run_start
                )
            )
        self._complete_updates(up_to_version=None)
        for channel in (self.prev, self.next):
            if channel is not None:
                channel.wait_sends()
        self._read_finite_checks(wait_beyond=0)
        self._read_order_checks(oldest_step=None)
        self._resolve_timings(wait_beyond=0)
        self.run_start = None
        self._hyperparameters.clear()

    @torch.no_grad()
    def evaluate(self, batch: Any) -> Tensor | None:
        """Forward one batch through the stage on the newest weights; returns the output on the last stage."""
        self._forget_layouts()  # evaluation batches may differ in size (the last one often does)
        x = self.inputs_fn(batch) if self.is_first else self._receive_input()[0]
        with self.forward_context():
            y = self.module(x, batch)
        if not self.is_last:
            self.next.send(self._output_message(y)[0])
            return None
        return y

    def _forget_layouts(self) -> None:
        for channel in (self.prev, self.next):
            if channel is not None:
                channel.forget_layout()
        self._recv_spec = self._send_spec = None

    def _receive_input(self, key: Key | None = None) -> tuple[Any, Spec]:
        message = self.prev.recv()
        if key is not None and self.check_data_order:
            # A training message ends with the fingerprint of its micro-batch (see `_check_data_order`).
            self._fingerprints[key], message = message[-1], message[:-1]
        value, self._recv_spec = activations.read_message(message, self._recv_spec)
        return value, self._recv_spec

    def _output_message(self, y: Any) -> tuple[list[Tensor], Spec]:
        tensors, spec = activations.message(y)
        if self._send_spec is None:
            self._send_spec = spec
        elif spec != self._send_spec:
            raise RuntimeError(
                f"Pipeline stage {self.stage} passed {spec} to the next stage after {self._send_spec} in the same "
                "run (structure, keys or which tensors require grad). Make every micro-batch's output the same "
                "structure."
            )
        return tensors, spec

    def previous_weights(self) -> dict[str, Tensor]:
        """The version before the newest one (what step ``newest`` will run on), keyed like the parameters."""
        index = (self.newest_version - 1) % self.num_buffers
        return {n: t.detach() for n, t in self.buffers[index].items()}

    def restore_version(self, version: int) -> None:
        """Make ``version`` the newest weight version (resuming, before the first step): the buffers are
        relabelled so that the parameters' copy holds it; load ``w[t-1]`` into :meth:`previous_weights` after."""
        if self._pending or self.run_start is not None:
            raise RuntimeError("A weight version can only be restored on a drained runtime.")
        if self.num_buffers == 2 and (version - self.newest_version) % 2:
            self.buffers.reverse()
        self.newest_version = version

    def load_previous_weights(self, state: dict[str, Tensor]) -> None:
        index = (self.newest_version - 1) % self.num_buffers
        with torch.no_grad():
            for name, tensor in self.buffers[index].items():
                tensor.copy_(state[name])

    def _read_finite_checks(self, wait_beyond: int) -> None:
        """Raise for a non-finite loss the device has reported; wait for flags older than ``wait_beyond`` steps."""
        checks = self._finite_checks
        while checks and (len(checks) > wait_beyond or checks[0].ready()):
            checks.popleft().raise_if_not_finite()

    def _read_order_checks(self, oldest_step: int | None) -> None:
        """Raise for a data-order mismatch the device has reported; wait for checks of steps before ``oldest_step``
        (all if ``None``)."""
        checks = self._order_checks
        while checks and (oldest_step is None or checks[0][0] < oldest_step or checks[0][1].ready()):
            checks.popleft()[1].raise_if_different()

    # --- the interpreter -------------------------------------------------------------------------------

    def _execute(self, actions: list[Action]) -> None:
        # Receives are posted ahead of the compute that needs them, but never ahead of an earlier send on
        # their link (see `posting_plan`: that order cannot deadlock on NCCL), and never past the segment.
        plan = posting_plan(actions)
        for op in plan.start:
            self._channel(op).prefetch()
        timing = self._timing  # None in a drain or an evaluation
        for index, action in enumerate(actions):
            label = str(action)
            begin = self._clock.mark() if timing is not None or self.trace else None
            with torch.profiler.record_function(f"pipeline {label}"):
                self._run(action, plan.post_next[index])
            if begin is None:
                continue
            entry = (_TIMED.get(action.op), label, begin, self._clock.mark())
            if timing is not None:
                timing.actions.append(entry)
            else:  # traced, but part of no step's statistics
                self._timings.append(_StepTiming(None, begin, entry[3], [entry]))

    def _channel(self, op: Op) -> Channel:
        return self.prev if op in (Op.RECV_F, Op.SEND_B) else self.next

    def _run(self, a: Action, post_next: bool) -> None:
        key = (a.step, a.microbatch)
        op = a.op
        if op is Op.FORWARD:
            self._forward(a, key)
        elif op is Op.BACKWARD:
            self._backward(key)
        elif op is Op.RECV_F:
            self._received[key] = self._receive_input(key)
        elif op is Op.RECV_B:
            self._input_grads[key] = self.next.recv()
        elif op is Op.SEND_F:
            message = self._output_message(self._inflight[key][2])[0]
            data_fingerprint = self._fingerprints.pop(key, None)
            if data_fingerprint is not None:
                message = [*message, data_fingerprint]
            self.next.send(message, post_recv=post_next)
        elif op is Op.SEND_B:
            # A message holds at least one tensor: an input without gradients answers with an empty one.
            grads = self._input_grads.pop(key) or [torch.zeros(0, device=self.device)]
            self.prev.send(grads, post_recv=post_next)
        if post_next and op in _RECEIVES:
            self._channel(op).prefetch()
        elif op is Op.UPDATE:
            self._start_update(a.step)

    def _forward(self, a: Action, key: Key) -> None:
        self._complete_updates(up_to_version=a.version)
        microbatch = self._microbatches[a.step][a.microbatch]
        if self.check_data_order and self.num_stages > 1:
            self._check_data_order(key, microbatch)
        x_spec = None
        if self.is_first:
            x = self.inputs_fn(microbatch)
        else:
            x, x_spec = self._received.pop(key)
            activations.with_grad_inputs(x, x_spec)
        weights = self.buffers[a.version % self.num_buffers]
        self.versions_used[a.step] = a.version
        with self.forward_context():
            y = functional_call(self.module, weights, (x, microbatch))
            if self.is_last:
                y = self.loss_fn(y, microbatch)
                self._losses.setdefault(a.step, []).append(y.detach())
        y_spec = None if self.is_last else activations.flatten(y)[1]
        self._inflight[key] = (x, x_spec, y, y_spec)
        self._pinned[key] = weights

    def _check_data_order(self, key: Key, microbatch: Any) -> None:
        """Compare this stage's micro-batch with the previous stage's; keep this stage's fingerprint to send on."""
        mine = fingerprint(microbatch)
        if not self.is_first:
            self._order_checks.append((key[0], FingerprintCheck(mine, self._fingerprints.pop(key), *key, self.stage)))
            self._read_order_checks(oldest_step=key[0] - 2)  # on CPU: this micro-batch's own check, at once
        if not self.is_last:
            self._fingerprints[key] = mine

    def _backward(self, key: Key) -> None:
        x, x_spec, y, y_spec = self._inflight.pop(key)
        # A layer that recomputes its forward here must see the weights the forward saw.
        with _reparametrize_module(self.module, self._pinned.pop(key), tie_weights=True):
            if self.is_last:
                (y / self.num_microbatches).backward()
            else:
                outputs = activations.differentiable(y, y_spec)
                grads = self._input_grads.pop(key)
                if outputs:
                    torch.autograd.backward(outputs, grads[: len(outputs)])
        if not self.is_first:
            self._input_grads[key] = activations.input_grads(x, x_spec)

    # --- updates -------------------------------------------------------------------------------------

    def _start_update(self, step: int) -> None:
        """Take step ``step``'s gradient off its buffer; apply now, or once the clipping norm is known."""
        source = self.buffers[weight_version(self.kind, step) % self.num_buffers]
        grads = {}
        for name, tensor in source.items():
            grads[name] = tensor.grad if tensor.grad is not None else torch.zeros_like(tensor)
            tensor.grad = None
        if self.data_group is not None:
            self._average_over_replicas(grads)
        if self.before_update is not None:
            self._call_before_update(grads)
        pending = _PendingUpdate(step, grads)
        tied = self.ties.local_names if self.ties is not None else set()
        if self.clip_grad_norm is not None:
            # A tied parameter's norm is that of its summed gradient, counted once (added by `ties`).
            norms = [torch.linalg.vector_norm(g.float()) for n, g in grads.items() if n not in tied]
            local = torch.stack(norms).pow(2).sum() if norms else torch.zeros((), device=self.device)
            pending.norm_sq = local.reshape(1)
            if self.ties is not None:
                pending.finish = self.ties.start(grads, pending.norm_sq, self.norm_group)
            elif self.num_stages > 1:
                pending.work = dist.all_reduce(pending.norm_sq, group=self.norm_group, async_op=True)
            self._pending.append(pending)
        elif self.ties is not None:
            pending.finish = self.ties.start(grads)
            self._pending.append(pending)
        else:
            self._apply_update(pending)

    def _call_before_update(self, grads: dict[str, Tensor]) -> None:
        for name, param in self.params.items():
            param.grad = grads[name]
        self.before_update()
        for name, param in self.params.items():
            if param.grad is not None:  # the hook may have replaced a gradient
                grads[name] = param.grad
            param.grad = None

    def _average_over_replicas(self, grads: dict[str, Tensor]) -> None:
        tensors = list(grads.values())
        if not tensors:
            return
        flat = torch.cat([g.reshape(-1) for g in tensors])
        dist.all_reduce(flat, group=self.data_group)
        flat /= dist.get_world_size(self.data_group)
        offset = 0
        for g in tensors:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def _complete_updates(self, up_to_version: int | None) -> None:
        """Apply pending updates that produce a version ``<= up_to_version`` (all if ``None``)."""
        while self._pending and (up_to_version is None or self._pending[0].step + 1 <= up_to_version):
            pending = self._pending.pop(0)
            if pending.work is not None:
                pending.work.wait()
            if pending.finish is not None:
                norm_sq = pending.finish()
                if norm_sq is not None:
                    pending.norm_sq = norm_sq
            self._apply_update(pending)

    @torch.no_grad()
    def _apply_update(self, pending: _PendingUpdate) -> None:
        step = pending.step
        current = self.buffers[step % self.num_buffers]
        target = self.buffers[(step + 1) % self.num_buffers]
        scale = None
        if pending.norm_sq is not None:
            total = pending.norm_sq.sqrt()
            scale = torch.clamp(self.clip_grad_norm / (total + 1e-6), max=1.0)
        for name, param in self.params.items():
            if target is not current:
                target[name].copy_(current[name])
            param.data = target[name].data
            grad = pending.grads[name]
            param.grad = grad.mul_(scale.to(grad.dtype)) if scale is not None else grad
        with self._hyperparameters_of(step):
            self.optimizer.step()
        self._last_seen = self._current_hyperparameters()
        for param in self.params.values():
            param.grad = None
        self.update_log.append((step, self.versions_used.get(step, step), step + 1))
        self.newest_version = step + 1

    def _current_hyperparameters(self) -> list[dict[str, Any]]:
        return [{k: v for k, v in g.items() if k not in _NOT_HYPERPARAMETERS} for g in self.optimizer.param_groups]

    def _observe_hyperparameters(self) -> list[dict[str, Any]]:
        """This step's hyperparameters; a key whose value changed since the optimizer last stepped was set from
        outside it (by a scheduler or the user), and is versioned from now on."""
        current = self._current_hyperparameters()
        if self._last_seen is not None:
            for group, seen in zip(current, self._last_seen):
                self._external_keys.update(k for k, v in group.items() if k not in seen or not _same(v, seen[k]))
        self._last_seen = current
        return current

    @contextlib.contextmanager
    def _hyperparameters_of(self, step: int):
        """Step ``step``'s update uses the learning rate (etc.) the trainer had set for that step.

        Only keys set from outside the optimizer are swapped in and restored afterwards; what the optimizer
        writes into its param groups during the step stays.
        """
        saved = self._hyperparameters.pop(step, None)
        if saved is None:
            yield
            return
        groups = self.optimizer.param_groups
        saved = [{k: v for k, v in snapshot.items() if k in self._external_keys} for snapshot in saved]
        now = [{k: group[k] for k in snapshot} for group, snapshot in zip(groups, saved)]
        for group, snapshot in zip(groups, saved):
            group.update(snapshot)
        try:
            yield
        finally:
            for group, values in zip(groups, now):
                group.update(values)


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return False  # compared by identity: reading a device tensor's value would stall the host
    try:
        return bool(a == b)
    except Exception:  # values without a truth value for ==
        return False


class FiniteCheck:
    """Whether one step's losses are all finite, learnt without making the host wait for the device.

    The flag is computed on the device and copied into host memory (pinned on CUDA) without blocking;
    :meth:`ready` asks a CUDA event whether the copy has landed, and :meth:`raise_if_not_finite` waits for it
    (a no-op once ready) and raises :func:`check_finite_losses`'s error if a loss was NaN or infinite.

    Args:
        losses: The step's per-micro-batch losses (on the stage's device).
        step: The step, for the error message.
        stage: The stage that computed them, for the error message.
    """

    def __init__(self, losses: Tensor, step: int, stage: int) -> None:
        self.losses, self.step, self.stage = losses, step, stage
        self._not_finite = HostFlag(~torch.isfinite(losses).all())

    def ready(self) -> bool:
        return self._not_finite.ready()

    def raise_if_not_finite(self) -> None:
        if self._not_finite.get():
            check_finite_losses(self.losses, self.step, self.stage)


def check_finite_losses(losses: Tensor, step: int, stage: int) -> None:
    """Raise ``FloatingPointError`` naming the step, stage and first micro-batch whose loss is NaN or infinite."""
    finite = torch.isfinite(losses)
    if bool(finite.all()):
        return
    microbatch = int((~finite).nonzero()[0])
    raise FloatingPointError(
        f"The loss of step {step}, micro-batch {microbatch} is {float(losses[microbatch])} (computed on pipeline "
        f"stage {stage}). Training stops here so that no stage applies a broken update. Lower the learning rate, "
        "set `gradient_clip_val`, or check the data of that step."
    )
