"""Executes one stage's schedule: forwards, backwards, transfers and weight updates.

The runtime is an interpreter for the action lists of :mod:`lightning_async_pp.schedule`; it
knows nothing of Lightning. One process runs one :class:`StageRuntime`, which looks each action's
:class:`~lightning_async_pp.schedule.Op` up in a table of handlers. What it keeps is split by concern:

- :class:`~lightning_async_pp.runtime.weights.WeightVersions`: the copies of the trainable parameters each
  in-flight micro-batch runs on. The layers run with the copy of the version a micro-batch was pinned to in
  place of their parameters (:class:`~lightning_async_pp.runtime.versions_swap.ParameterSwap`).
- :class:`~lightning_async_pp.runtime.updates.UpdateDriver`: each step's gradient, averaged over replicas,
  summed over tied copies, clipped, and applied with that step's hyperparameters, at the points the update's
  plan (:class:`~lightning_async_pp.schedule.UpdatePlan`) names (none on an evaluation-only runtime, built
  with ``optimizer=None``).
- :class:`~lightning_async_pp.runtime.timing.StepTimer`: per-step statistics and the action trace.

Recomputation. A layer that recomputes its forward in backward (``torch.utils.checkpoint``) reads its
parameters again then, so every backward runs under the same re-parametrization as its forward: the
recompute sees the micro-batch's version, never the newest one.

Tied weights. A parameter that layers of several stages share has a copy on each of them; ``ties`` sums
their gradients before each update (see :mod:`lightning_async_pp.runtime.ties`), so the copies stay equal.

Observers. :meth:`StageRuntime.add_observer` (one runtime) and :func:`register_action_observer` (every
runtime of the process) register ``fn(action, begin, end)``, called after each action with its start and
end on the host's ``time.perf_counter`` clock (on CUDA, the host's side of it: kernels may still run).
Each action is also labelled ``pipeline <action>`` for :mod:`torch.profiler`.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_async_pp.runtime import activations
from lightning_async_pp.runtime.activations import Spec
from lightning_async_pp.runtime.auxiliary import AuxiliaryLosses
from lightning_async_pp.runtime.casts import WeightCasts, autocast_dtype
from lightning_async_pp.runtime.comm import Channel
from lightning_async_pp.runtime.contract import StageModule
from lightning_async_pp.runtime.data_order import DataOrderLink
from lightning_async_pp.runtime.evaluation import PipelineEvaluation
from lightning_async_pp.runtime.finite import FiniteCheck, read_finite_checks
from lightning_async_pp.runtime.microbatch import StepMicrobatches
from lightning_async_pp.runtime.ties import TiedGradients
from lightning_async_pp.runtime.timing import StepStats, StepTimer
from lightning_async_pp.runtime.updates import UpdateDriver
from lightning_async_pp.runtime.versions_swap import ParameterSwap
from lightning_async_pp.runtime.weights import WeightVersions
from lightning_async_pp.schedule import (
    Action,
    Op,
    drain_actions,
    get_schedule,
    gradients_received_before_forward,
    posting_plan,
    step_actions,
    validate,
)

Key = tuple[int, int]  # (step, micro-batch)
StepResult = tuple[Tensor | None, StepStats | None]
Observer = Callable[[Action, float, float], None]
"""``fn(action, begin, end)``: called after each action, with its start and end (``time.perf_counter``)."""
_OBSERVERS: collections.OrderedDict[int, Observer] = collections.OrderedDict()  # weak-referable, for handles


def register_action_observer(fn: Observer) -> RemovableHandle:
    """Call ``fn(action, begin, end)`` after every action of every :class:`StageRuntime` of this process.

    Returns:
        A handle whose ``remove()`` unregisters ``fn``.
    """
    handle = RemovableHandle(_OBSERVERS)
    _OBSERVERS[handle.id] = fn
    return handle


@dataclass
class StageRuntime:
    """One pipeline stage.

    Args:
        kind: ``"2bw"`` or ``"1f1b"``.
        stage: This stage's index.
        num_stages: Number of stages.
        num_microbatches: Micro-batches per batch (a step of ``k`` accumulated batches has ``k`` times as many).
        layers: This stage's layers, in order.
        optimizer: Optimizer over exactly the trainable parameters of ``layers``; ``None`` for a runtime that
            only evaluates (:meth:`evaluate`), which builds no update machinery and refuses :meth:`run_step`.
        inputs_fn: First stage: turns a micro-batch into the first layer's input.
        loss_fn: Last stage: ``loss_fn(output, microbatch)``, a scalar mean over the micro-batch.
        device: Device of the stage.
        prev_rank: Global rank of the previous stage (``None`` on the first stage); one stage per process
            (:data:`~lightning_async_pp.schedule.STAGES_PER_PROCESS`).
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
        time_actions: Time every action for :class:`StepStats` (forward, backward, wait and update seconds);
            ``False``: only each step's wall time (the other fields are NaN), one clock mark per step boundary.
        start_version: Weight version the parameters hold (non-zero when resuming).
        check_data_order: Send the fingerprints of each step's micro-batches to the next stage and stop with
            :class:`~lightning_async_pp.runtime.fingerprint.DataOrderError` when a stage's own micro-batches do
            not match the previous stage's (:mod:`~lightning_async_pp.runtime.data_order`). On CPU the check
            stops the step before its first forward; on a GPU the result is read without waiting for the
            device, at the latest two steps later and at every :meth:`drain`. Every stage of a pipeline must
            agree on it; a training runtime of more than one stage needs ``order_group``.
        order_group: Process group of the pipeline's stages for the data-order messages only (one per step and
            link), so that they never queue behind activations.
        before_update: Called once per step when the stage's gradient of that step is complete (averaged over
            the replicas, not yet clipped), with the gradient in the parameters' ``.grad``, before the norm for
            clipping is taken and the update applied. It may read or change the gradients in place. A tied
            parameter's gradient is still this stage's share (the sum over its stages follows).
        check_finite: Stop with an error naming the step and micro-batch when a loss is NaN or infinite. The
            check never waits for the device: each step's flag is copied to the host without blocking and
            read once the device is done with that step, at the latest two steps later and at every
            :meth:`drain` (so before any validation, checkpoint or the end of training). See
            :class:`~lightning_async_pp.runtime.finite.FiniteCheck`.
        ties: Sums the gradients of parameters this stage shares with other stages (tied weights).
        shard_optimizer: Keep only this replica's part of the optimizer state (``data_group``'s replicas each own
            whole tensors, see :mod:`~lightning_async_pp.runtime.sharding`); for per-parameter optimizers only
            (:class:`~lightning_async_pp.runtime.updates.UpdateDriver`).
        observers: Called as ``fn(action, begin, end)`` after each action (see :meth:`add_observer`).
        cast_weights: Under an autocast ``forward_context``, cast the weights autocast would cast once per weight
            version, shared by the micro-batches in flight, instead of once per micro-batch
            (:mod:`~lightning_async_pp.runtime.casts`; the same bits, less memory). ``False`` for comparisons.
    """

    kind: str
    stage: int
    num_stages: int
    num_microbatches: int
    layers: Sequence[nn.Module]
    optimizer: Optimizer | None
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
    order_group: Any = None
    trace_window: int = 20_000
    time_actions: bool = True
    observers: Sequence[Observer] = ()
    shard_optimizer: bool = False
    cast_weights: bool = True

    def __post_init__(self) -> None:
        validate(self.kind, self.num_stages, self.num_microbatches)
        self.module = StageModule(*self.layers)
        self.params = {name: p for name, p in self.module.named_parameters() if p.requires_grad}
        self.weights = WeightVersions(self.params, get_schedule(self.kind).num_weight_versions, self.start_version)
        self._swap = ParameterSwap(self.module, self.params)
        cast_dtype = autocast_dtype(self.forward_context, self.device.type) if self.cast_weights else None
        self._casts = WeightCasts(self.module, list(self.params), cast_dtype, self.device.type)
        self.updates: UpdateDriver | None = None
        if self.optimizer is not None:
            self.updates = UpdateDriver(
                self.optimizer,
                self.weights,
                self.kind,
                self.num_stages,
                self.device,
                clip_grad_norm=self.clip_grad_norm,
                norm_group=self.norm_group,
                data_group=self.data_group,
                before_update=self.before_update,
                ties=self.ties,
                shard=self.shard_optimizer,
                stage=self.stage,
            )
        self.timer = StepTimer(self.device, self.trace, self.trace_window, self.time_actions)
        self._observers: collections.OrderedDict[int, Observer] = collections.OrderedDict()
        for fn in self.observers:
            self.add_observer(fn)
        self.run_start: int | None = None
        self.last_step: int | None = None
        self._evaluation = PipelineEvaluation(self)
        self.is_first = self.stage == 0
        self.is_last = self.stage == self.num_stages - 1
        self.prev = self._link(self.prev_rank, self.stage - 1)
        self.next = self._link(self.next_rank, self.stage + 1)
        self.steps = StepMicrobatches(self.num_microbatches)
        # What travels may be several tensors (see `activations`): a received input keeps its spec, and an
        # in-flight micro-batch keeps the specs of its input and output, so each gradient finds its tensor.
        self._inflight: dict[Key, tuple[Any, Spec | None, Any, Spec | None]] = {}
        self._pinned: dict[Key, dict[str, Tensor]] = {}  # the weights each in-flight micro-batch runs on
        self._received: dict[Key, tuple[Any, Spec]] = {}
        self._input_grads: dict[Key, list[Tensor]] = {}
        self._structures = activations.LinkStructures(self.stage)
        self._finite_checks: collections.deque[FiniteCheck] = collections.deque()
        self._order: DataOrderLink | None = None
        if self.check_data_order and self.num_stages > 1 and self.optimizer is not None:  # training only
            if self.order_group is None:
                raise ValueError(
                    "check_data_order=True needs `order_group`, a process group of this pipeline's stages for the "
                    "data-order messages only (or set check_data_order=False)."
                )
            self._order = DataOrderLink(
                self.stage, self.prev_rank, self.next_rank, self.order_group, self.num_microbatches
            )

    def _link(self, rank: int | None, peer: int) -> Channel | None:
        if rank is None:
            return None
        return Channel(rank, self.device, self.p2p_group, f"stage {self.stage} <- stage {peer}")

    # --- public API ------------------------------------------------------------------------------------

    @property
    def num_buffers(self) -> int:
        """How many weight versions the stage keeps (2 for ``"2bw"``, 1 for ``"1f1b"``)."""
        return self.weights.num_buffers

    @property
    def newest_version(self) -> int:
        return self.weights.newest

    @property
    def events(self) -> collections.deque[tuple[str, float, float]]:
        """The traced actions as ``(label, start, end)`` (with ``trace``; the last ``trace_window``)."""
        return self.timer.events

    def add_observer(self, fn: Observer) -> RemovableHandle:
        """Call ``fn(action, begin, end)`` after each action of this runtime; ``begin`` and ``end`` are the
        action's start and end on ``time.perf_counter``'s clock. Without observers nothing is measured.

        Returns:
            A handle whose ``remove()`` unregisters ``fn``.
        """
        handle = RemovableHandle(self._observers)
        self._observers[handle.id] = fn
        return handle

    def run_step(self, step: int, *batches: Any, accumulation: int | None = None) -> StepResult:
        """Execute this stage's share of ``step`` on its ``batches``: one, or several that accumulate into one update
        (``accumulation``: see :class:`StepMicrobatches`). A step of another micro-batch count drains the run first.

        Returns the step's mean loss (last stage, a device tensor) and the timings of the oldest step whose
        timings are known: on CPU this step's; on CUDA, where they are read from events once the device has
        run the step, usually an earlier step's (``StepStats.step`` says which), or ``None``. The rest come
        from :meth:`take_stats`.
        """
        if self.updates is None:
            raise RuntimeError(
                f"The runtime of pipeline stage {self.stage} was built without an optimizer (optimizer=None), for "
                "evaluation only, so it cannot train: `run_step` needs an optimizer over the stage's parameters."
            )
        count = self.steps.count(batches)
        if self.run_start is not None and count != self.steps.per_step:
            self.drain()  # every step of a run has the same micro-batches (the schedule's M)
        read_finite_checks(self._finite_checks, wait_beyond=2)
        if self._order is not None:
            self._order.read_checks(oldest_step=step - 2)
        if self.run_start is None:
            validate(self.kind, self.num_stages, count)
            self.run_start, self.steps.per_step = step, count
            self.forget_layouts()  # evaluation may have sent other shapes since the last run
        self.timer.begin_step(step)
        self.updates.hyperparameters.observe(step)
        self.steps.start(step, batches, accumulation)
        if self._order is not None:
            self._order.start_step(step, batches)
        self._execute(step_actions(self.kind, self.num_stages, count, self.stage, step, self.run_start))
        self.last_step = step
        self.steps.end(step)
        self.weights.used.pop(step - 3, None)
        loss = None
        if self.is_last:
            losses = self.steps.losses(step)
            if self.check_finite:
                self._finite_checks.append(FiniteCheck(losses, step, self.stage))
            loss = losses.mean()
        self.timer.end_step(self.updates.version_lag(), self.steps.aux_mean())
        return loss, self.timer.pop_ready()

    def take_stats(self) -> list[StepStats]:
        """The timings of every step run so far that :meth:`run_step` has not returned yet (waits for the device)."""
        return self.timer.take()

    def drain(self) -> None:
        """Finish every started micro-batch and apply every pending update (empties the pipeline)."""
        if self.run_start is not None and self.last_step is not None:
            self._execute(
                drain_actions(
                    self.kind, self.num_stages, self.steps.per_step, self.stage, self.last_step, self.run_start
                )
            )
        if self.updates is not None:
            self.updates.complete(up_to_version=None)
        for channel in (self.prev, self.next):
            if channel is not None:
                channel.wait_sends()
        if self._order is not None:
            self._order.wait_sends()
            self._order.read_checks(oldest_step=None)
        read_finite_checks(self._finite_checks, wait_beyond=0)
        self.timer.resolve(wait_beyond=0)
        self.run_start = None
        self.steps.clear()
        if self.updates is not None:
            self.updates.hyperparameters.clear()

    def evaluate(self, batch: Any, num_microbatches: int | None = None) -> Any:
        """Forward one batch through the stage on the newest weights, in up to ``num_microbatches`` micro-batches
        (default: the runtime's; see :mod:`~lightning_async_pp.runtime.evaluation`). Every stage of the pipeline
        must pass the same. Returns the whole batch's output on the last stage, ``None`` on the others."""
        return self._evaluation.run(batch, self.num_microbatches if num_microbatches is None else num_microbatches)

    def previous_weights(self) -> dict[str, Tensor]:
        """The version before the newest one (what step ``newest`` will run on), keyed like the parameters."""
        return self.weights.previous()

    def restore_version(self, version: int) -> None:
        """Make ``version`` the newest weight version (resuming, before the first step): the buffers are
        relabelled so that the parameters' copy holds it; load ``w[t-1]`` into :meth:`previous_weights` after."""
        if (self.updates is not None and self.updates.pending) or self.run_start is not None:
            raise RuntimeError("A weight version can only be restored on a drained runtime.")
        self.weights.restore(version)

    def load_previous_weights(self, state: dict[str, Tensor]) -> None:
        """Copy ``state`` into the version before the newest one (see :meth:`previous_weights`)."""
        self.weights.load_previous(state)

    # --- messages (also what evaluation sends and receives) ------------------------------------------------

    def forget_layouts(self) -> None:
        """Negotiate each link's transfer layout again with the next message (shapes may have changed)."""
        # The messages of the old layout go first: on gloo only a wait lets them go, and their tags start over.
        for channel in (self.prev, self.next):
            if channel is not None:
                channel.wait_sends()
                channel.forget_layout()
        self._structures.forget()
        self._evaluation.forget()

    def receive_input(self) -> tuple[Any, Spec]:
        """The previous stage's next message, as the value it sent, and its structure."""
        return self._structures.read(self.prev.recv())

    def output_message(self, y: Any) -> tuple[list[Tensor], Spec]:
        """``y`` as the tensors of a message to the next stage, after checking it has the run's structure."""
        return self._structures.message(y)

    # --- the interpreter -------------------------------------------------------------------------------

    def _execute(self, actions: list[Action]) -> None:
        # Receives are posted ahead of the compute that needs them, but never ahead of an earlier send on
        # their link (see `posting_plan`: that order cannot deadlock on NCCL), and never past the segment.
        plan = posting_plan(actions)
        for op in plan.start:
            self._channel(op).prefetch()
        timer = self.timer
        observers = [*self._observers.values(), *_OBSERVERS.values()]
        # Labelling each action for torch.profiler costs a dispatcher call on enter and exit: only while one records.
        profiling = torch.autograd.profiler._is_profiler_enabled
        handlers = self._HANDLERS
        for index, action in enumerate(actions):
            begin = timer.clock.mark() if timer.active else None
            start = time.perf_counter() if observers else 0.0
            if profiling:
                with torch.profiler.record_function(f"pipeline {action}"):
                    handlers[action.op](self, action, plan.post_next[index])
            else:
                handlers[action.op](self, action, plan.post_next[index])
            if begin is not None:
                timer.record(action, begin, timer.clock.mark())
            if observers:
                end = time.perf_counter()
                for observer in observers:
                    observer(action, start, end)

    def _channel(self, op: Op) -> Channel:
        return self.prev if op in (Op.RECV_F, Op.SEND_B) else self.next

    def _forward(self, a: Action, post_next: bool) -> None:
        key = (a.step, a.microbatch)
        self.updates.settle(a.step, a.microbatch)
        self.updates.complete(up_to_version=a.version)
        microbatch = self.steps[a.step, a.microbatch]
        if a.microbatch == 0 and self._order is not None:
            self._order.check(a.step)  # before the step's first forward
        x_spec = None
        if self.is_first:
            x = self.inputs_fn(microbatch)
        else:
            x, x_spec = self._received.pop(key)
            activations.with_grad_inputs(x, x_spec)
        weights = self.weights.pin(a.step, a.version)
        with self.forward_context(), AuxiliaryLosses(1 / self.steps.divisor(a.step)) as aux:
            with self._swap(weights), self._casts(weights, a.version):
                y = self.module(x, microbatch)
            if self.is_last:
                y = self.loss_fn(y, microbatch)
                self.steps.add_loss(a.step, y)
        self.steps.add_aux(aux.total())
        y_spec = None if self.is_last else activations.flatten(y)[1]
        self._inflight[key] = (x, x_spec, y, y_spec)
        self._pinned[key] = weights

    def _backward(self, a: Action, post_next: bool) -> None:
        key = (a.step, a.microbatch)
        x, x_spec, y, y_spec = self._inflight.pop(key)
        # A layer that recomputes its forward here must see the weights the forward saw.
        with self._swap(self._pinned.pop(key)):
            if self.is_last:
                (y / self.steps.divisor(a.step)).backward()
            else:
                outputs = activations.differentiable(y, y_spec)
                grads = self._input_grads.pop(key)
                if outputs:
                    torch.autograd.backward(outputs, grads[: len(outputs)])
        if not self.is_first:
            self._input_grads[key] = activations.input_grads(x, x_spec)
        self.updates.advance()

    def _recv_forward(self, a: Action, post_next: bool) -> None:
        key = (a.step, a.microbatch)
        self._received[key] = self.receive_input()
        # The previous stage ran this forward after the receives its action list puts first: those gradients arrived.
        received = gradients_received_before_forward(
            self.kind, self.num_stages, self.steps.per_step, self.stage - 1, a.step, a.microbatch, self.run_start
        )
        if received is not None:
            self.prev.peer_received(received)
        if post_next:
            self.prev.prefetch()

    def _recv_backward(self, a: Action, post_next: bool) -> None:
        key = (a.step, a.microbatch)
        self._input_grads[key] = self.next.recv()
        # A gradient for this micro-batch means the next stage ran its forward: it received this stage's
        # activations for it and, a link being in order, all before them.
        self.next.peer_received(key)
        if self._order is not None:
            self._order.peer_received(a.step)
        if post_next:
            self.next.prefetch()

    def _send_forward(self, a: Action, post_next: bool) -> None:
        key = (a.step, a.microbatch)
        self.next.send(self.output_message(self._inflight[key][2])[0], post_recv=post_next, tag=key)

    def _send_backward(self, a: Action, post_next: bool) -> None:
        # A message holds at least one tensor: an input without gradients answers with an empty one.
        key = (a.step, a.microbatch)
        grads = self._input_grads.pop(key) or [torch.zeros(0, device=self.device)]
        self.prev.send(grads, post_recv=post_next, tag=key)

    def _update(self, a: Action, post_next: bool) -> None:
        self.updates.start(a.step)

    _HANDLERS = {
        Op.FORWARD: _forward,
        Op.BACKWARD: _backward,
        Op.RECV_F: _recv_forward,
        Op.RECV_B: _recv_backward,
        Op.SEND_F: _send_forward,
        Op.SEND_B: _send_backward,
        Op.UPDATE: _update,
    }
