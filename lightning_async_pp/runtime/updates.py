"""A stage's weight updates: the step's gradient, averaged over replicas, summed over tied copies, clipped by
the global norm, and applied with the hyperparameters the trainer had set for that step.

``UPDATE(t)`` runs as soon as the stage's last backward of step ``t`` is done. What it needs from other
processes it posts as non-blocking collectives, and it waits for each, steps the optimizer and publishes version
``t + 1`` as late as it may without a process waiting for another: the average over data-parallel replicas
(bucketed, :mod:`~lightning_async_pp.runtime.replicas`), or with the optimizer state sharded a reduce-scatter
to each tensor's owner and an all-gather of the owners' new weights
(:mod:`~lightning_async_pp.runtime.sharding`), the sums of tied gradients
(:mod:`~lightning_async_pp.runtime.ties`), and with gradient clipping the global norm, which needs every stage's
share. Which is posted and waited for where is the update's plan,
:class:`~lightning_async_pp.schedule.UpdatePlan` (its docstring lists the order per mode), the same plan the
deadlock model checks: :class:`UpdateDriver` executes its entries, each by the operation of
:attr:`UpdateDriver.OPERATIONS` for it, at the points the runtime calls it at (:meth:`UpdateDriver.start` at
``UPDATE``, :meth:`~UpdateDriver.advance` after each backward, :meth:`~UpdateDriver.settle` and
:meth:`~UpdateDriver.complete` at each forward, ``complete`` again at the drain). With sharded state the owner
steps at the next backward or where the update settles, so the all-gather overlaps the rest of step ``t + 1``:
2BW keeps its zero bubble.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_async_pp.runtime.replicas import ReplicaAverage
from lightning_async_pp.runtime.sharding import ReplicaShards, keep_owned, plan_owners
from lightning_async_pp.runtime.ties import TiedGradients
from lightning_async_pp.runtime.weights import WeightVersions
from lightning_async_pp.schedule import POINTS, PlanEntry, UpdatePlan, updates_settled_by, weight_version

NOT_HYPERPARAMETERS = ("params", "param_names")
"""Keys of an optimizer's param group that are not hyperparameters."""

_NORM_INPUTS = (torch.float32, torch.bfloat16, torch.float16)  # widened to float32 inside `_foreach_norm`


@dataclass
class PendingUpdate:
    """One step's update, from its gradient to its application.

    Args:
        step: The step whose gradient this is; applying it produces version ``step + 1``.
        grads: The gradient, by parameter name (with sharded state, once averaged: the owned and the tied ones).
        later: The plan's entries still to run, at each point after ``"update"``.
        norm_sq: The squared global gradient norm (this stage's share until the norm's all-reduce is waited for).
        norms: Sharded state: every untied tensor's norm, this replica's own filled in, until summed over the
            replicas.
        posted: The collectives in flight, by name (and tie): what their wait needs.
    """

    step: int
    grads: dict[str, Tensor]
    later: dict[str, list[PlanEntry]]
    norm_sq: Tensor | None = None
    norms: Tensor | None = None
    posted: dict[tuple[str, int], Any] = field(default_factory=dict)


class StepHyperparameters:
    """Versions an optimizer's hyperparameters per step, so that step ``t``'s update uses the learning rate
    (etc.) the trainer had set for step ``t``, however late it is applied.

    Args:
        optimizer: The optimizer whose param groups are versioned.
    """

    def __init__(self, optimizer: Optimizer) -> None:
        self.optimizer = optimizer
        self._saved: dict[int, list[dict[str, Any]]] = {}
        # Param-group keys set from outside the optimizer (a scheduler, the user): only those are versioned per
        # step. Keys the optimizer writes itself (schedule-free's `k`, Prodigy's `d`) are its own state.
        self._external_keys: set[str] = set()
        self._last_seen: list[dict[str, Any]] | None = None

    def _current(self) -> list[dict[str, Any]]:
        return [{k: v for k, v in g.items() if k not in NOT_HYPERPARAMETERS} for g in self.optimizer.param_groups]

    def observe(self, step: int) -> None:
        """Record step ``step``'s hyperparameters; a key whose value changed since the optimizer last stepped was
        set from outside it (by a scheduler or the user), and is versioned from now on."""
        current = self._current()
        if self._last_seen is not None:
            for group, seen in zip(current, self._last_seen):
                self._external_keys.update(k for k, v in group.items() if k not in seen or not _same(v, seen[k]))
        self._last_seen = current
        self._saved[step] = current

    def stepped(self) -> None:
        """The optimizer has stepped: what it wrote into its param groups is its own."""
        self._last_seen = self._current()

    def clear(self) -> None:
        self._saved.clear()

    @contextlib.contextmanager
    def of(self, step: int) -> Iterator[None]:
        """Swap in the keys set from outside the optimizer as they were for step ``step``, and restore them
        afterwards; what the optimizer writes into its param groups during the step stays."""
        saved = self._saved.pop(step, None)
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


def _wait_for(name: str) -> Callable[[UpdateDriver, PendingUpdate, int], None]:
    """The operation that waits for the collective ``name``, whose result its finish leaves in place."""

    def wait(driver: UpdateDriver, pending: PendingUpdate, index: int) -> None:
        pending.posted.pop((name, 0))()

    return wait


class UpdateDriver:
    """Turns each step's gradient into the next weight version by executing the update's plan
    (:class:`~lightning_async_pp.schedule.UpdatePlan`, built from the settings below; see the module docstring).

    Args:
        optimizer: Optimizer over exactly the stage's trainable parameters.
        weights: The stage's weight versions (their ``params`` are the optimizer's).
        kind: The schedule's name: which version a step's gradient was computed on, where an update settles.
        num_stages: Number of stages (one stage clips without communication).
        device: The stage's device.
        clip_grad_norm: Clip the gradient of each step to this global norm (across all stages).
        norm_group: Process group of all stages of this pipeline, for the clipping norm.
        data_group: Process group of this stage's replicas, whose gradients are averaged; ``None`` without.
        before_update: Called with the complete gradient in the parameters' ``.grad`` (averaged over the
            replicas, not yet clipped, a tied parameter's still this stage's share); it may change them in place.
        ties: Sums the gradients of parameters this stage shares with other stages (tied weights).
        shard: Shard the optimizer state over the replicas of ``data_group``: ``optimizer`` keeps only the
            parameters this replica owns (it is changed in place). ``before_update`` sees the owned gradients
            (and the tied ones) only. Only for an optimizer whose update of a parameter reads nothing but that
            parameter's gradient and state: the caller checks (the strategy with
            :func:`~lightning_async_pp.optim.updates_per_parameter`).
        stage: This stage (which ties it holds; with ties, the stage ``ties`` was built for).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        weights: WeightVersions,
        kind: str,
        num_stages: int,
        device: torch.device,
        clip_grad_norm: float | None = None,
        norm_group: Any = None,
        data_group: Any = None,
        before_update: Callable[[], None] | None = None,
        ties: TiedGradients | None = None,
        shard: bool = False,
        stage: int = 0,
    ) -> None:
        if ties is not None and ties.stage != stage:
            raise ValueError(f"The tied gradients are stage {ties.stage}'s, the update is stage {stage}'s.")
        self.optimizer, self.weights = optimizer, weights
        self.params: dict[str, nn.Parameter] = weights.params
        self.kind, self.num_stages, self.device, self.stage = kind, num_stages, device, stage
        self.clip_grad_norm, self.norm_group, self.data_group = clip_grad_norm, norm_group, data_group
        self.before_update, self.ties = before_update, ties
        self.replicas = ReplicaAverage(data_group) if data_group is not None and not shard else None
        self.shards: ReplicaShards | None = None
        self._tied: list[str] = []
        self._norm_slots: Tensor | None = None  # where this replica's norms go among the stage's untied tensors
        self.stepped = list(self.params)
        """Names of the parameters this stage's optimizer steps (this replica's own, with sharded state)."""
        if shard and data_group is not None:
            self.shards = self._shard(data_group)
            self.stepped = self.shards.owned
        self.plan = UpdatePlan(
            num_stages,
            replicas=dist.get_world_size(data_group) if data_group is not None else 1,
            clip=clip_grad_norm is not None,
            ties=ties.holders if ties is not None else (),
            shard=self.shards is not None,
            hook=before_update is not None,
        )
        """What each update posts and waits for where: the entries this driver executes."""
        self._settle_at = updates_settled_by(kind, num_stages)
        self.hyperparameters = StepHyperparameters(optimizer)
        self.pending: list[PendingUpdate] = []
        self.log: collections.deque[tuple[int, int, int]] = collections.deque(maxlen=1024)
        """Recent updates as (step, version the gradient was computed on, version produced)."""

    def _shard(self, data_group: Any) -> ReplicaShards:
        replicas = dist.get_world_size(data_group)
        sizes = {name: p.numel() * p.element_size() for name, p in self.params.items()}
        shards = ReplicaShards(self.params, plan_owners(sizes, replicas), dist.get_rank(data_group), data_group)
        keep_owned(self.optimizer, [self.params[name] for name in shards.owned])
        if self.ties is not None:
            # Every replica sums its copies of a tie over the stages, as without sharding, so every replica needs
            # the tied gradients averaged: an all-reduce, besides the reduce-scatter (only the owner steps them).
            self._tied = [name for name in self.params if name in self.ties.local_names]
            self.replicas = ReplicaAverage(data_group)
        return shards

    def start(self, step: int) -> None:
        """``UPDATE(step)``: take step ``step``'s gradient off its buffer and run the plan's ``"update"`` entries
        (first completing the pending updates whose buffers they reuse); apply at once if nothing is left."""
        grads = self.weights.take_gradients(weight_version(self.kind, step))
        entries = self.plan.entries(self.stage)
        if self.plan.completes_at_update:
            self.complete(up_to_version=step)
        pending = PendingUpdate(step, grads, {point: list(entries[point]) for point in POINTS[1:]})
        self._run(pending, entries["update"])
        if any(pending.later.values()):
            self.pending.append(pending)
        else:
            self.apply(pending)

    def settle(self, step: int, microbatch: int) -> None:
        """At the forward of micro-batch :func:`~lightning_async_pp.schedule.updates_settled_by` of step
        ``step``, every stage has posted what the update of step ``step - 1`` exchanges over the pipeline (its
        norm, its tied sums): run that update's ``"settle"`` entries (with sharded state: wait for those, step the
        owned tensors and post the all-gather, which then overlaps the rest of the step)."""
        if microbatch != self._settle_at:
            return
        for pending in self.pending:
            if pending.step == step - 1:
                self._run_point(pending, "settle")

    def advance(self) -> None:
        """After each backward: run the pending updates' ``"backward"`` entries (with sharded state and nothing
        to exchange over the pipeline: wait for the reduce-scatter, step, post the all-gather)."""
        for pending in self.pending:
            self._run_point(pending, "backward")

    def complete(self, up_to_version: int | None) -> None:
        """Apply pending updates that produce a version ``<= up_to_version`` (all if ``None``)."""
        while self.pending and (up_to_version is None or self.pending[0].step + 1 <= up_to_version):
            self.apply(self.pending.pop(0))

    def apply(self, pending: PendingUpdate) -> None:
        """Write version ``pending.step + 1``: run what is left of its plan, earlier points first (the optimizer
        step among it, unless that ran already), and make it the newest version."""
        for point in POINTS[1:]:
            self._run_point(pending, point)
        self._publish(pending)

    def _run_point(self, pending: PendingUpdate, point: str) -> None:
        entries, pending.later[point] = pending.later[point], []
        self._run(pending, entries)

    def _run(self, pending: PendingUpdate, entries: Iterable[PlanEntry]) -> None:
        for entry in entries:
            self.OPERATIONS[entry.action, entry.name](self, pending, entry.index)

    # --- the plan's entries, each one operation

    def _post_average(self, pending: PendingUpdate, index: int) -> None:
        # Where the average stays in flight, the gradient may live in the buckets: the next UPDATE, which
        # reuses them, completes this update first. Waited for at once, it is copied back.
        views = PlanEntry("wait", "average") in (entry for entries in pending.later.values() for entry in entries)
        pending.posted["average", 0] = self.replicas.start(pending.grads, views=views)

    def _post_tied_average(self, pending: PendingUpdate, index: int) -> None:
        pending.posted["tied average", 0] = self.replicas.start(pending.grads, views=False)  # the tied ones

    def _post_reduce_scatter(self, pending: PendingUpdate, index: int) -> None:
        pending.posted["reduce-scatter", 0] = self.shards.reduce(pending.grads)
        # Only the tied gradients are needed besides the owned ones (summed over the stages by every replica).
        pending.grads = {name: pending.grads[name] for name in self._tied}

    def _wait_reduce_scatter(self, pending: PendingUpdate, index: int) -> None:
        pending.grads = {**pending.posted.pop(("reduce-scatter", 0))(), **pending.grads}

    def _post_all_gather(self, pending: PendingUpdate, index: int) -> None:
        pending.posted["all-gather", 0] = self.shards.gather(self.weights.of(pending.step + 1))

    def _post_tie(self, pending: PendingUpdate, index: int) -> None:
        widen = self.clip_grad_norm is not None  # the norm adds the sum's squared norm in float32
        pending.posted["tie", index] = self.ties.post_sum(index, pending.grads, widen)

    def _wait_tie(self, pending: PendingUpdate, index: int) -> None:
        self.ties.wait_sum(pending.posted["tie", index])  # kept: the norm reads the lowest holder's sums

    def _post_norm(self, pending: PendingUpdate, index: int) -> None:
        if self.ties is None:
            pending.posted["norm", 0] = dist.all_reduce(pending.norm_sq, group=self.norm_group, async_op=True)
            return
        sums = {i: posted for (name, i), posted in pending.posted.items() if name == "tie"}
        pending.posted["norm", 0] = self.ties.post_norm(pending.norm_sq, sums, self.norm_group)

    def _wait_norm(self, pending: PendingUpdate, index: int) -> None:
        posted = pending.posted.pop(("norm", 0))
        if self.ties is None:
            posted.wait()
        else:
            pending.norm_sq = self.ties.wait_norm(*posted)

    def _local_norm(self, pending: PendingUpdate, index: int) -> None:
        # A tied parameter's norm is that of its summed gradient, counted once (added by `ties`).
        tied = self.ties.local_names if self.ties is not None else set()
        # In float32 whatever the gradients' dtype, as `torch.linalg.vector_norm(g.float())` per gradient: a
        # narrower dtype is widened inside the kernel, a wider one (float64) is cast first, as before.
        names = [n for n in self.params if n not in tied]
        mine = [n for n in names if n in pending.grads]  # all of them, unless the state is sharded
        untied = [pending.grads[n] for n in mine]
        untied = [g if g.dtype in _NORM_INPUTS else g.float() for g in untied]
        norms = torch.stack(torch._foreach_norm(untied, dtype=torch.float32)) if untied else None
        if self.shards is None:
            pending.norm_sq = self._squared_sum(norms)
            return
        # Each replica holds its own tensors' norms: the others' come as exact sums with zeros, so the stage's
        # norm is summed in the same order and to the same bits as without sharding.
        pending.norms = torch.zeros(len(names), dtype=torch.float32, device=self.device)
        if norms is not None:
            if self._norm_slots is None:  # made once: a tensor from host data is a host-to-device copy
                self._norm_slots = torch.tensor([names.index(n) for n in mine], device=self.device)
            pending.norms.index_copy_(0, self._norm_slots, norms)

    def _post_norms(self, pending: PendingUpdate, index: int) -> None:
        pending.posted["norms", 0] = dist.all_reduce(pending.norms, group=self.data_group, async_op=True)

    def _wait_norms(self, pending: PendingUpdate, index: int) -> None:
        pending.posted.pop(("norms", 0)).wait()
        norms, pending.norms = pending.norms, None
        pending.norm_sq = self._squared_sum(norms if norms.numel() else None)

    def _squared_sum(self, norms: Tensor | None) -> Tensor:
        local = norms.pow(2).sum() if norms is not None else torch.zeros((), device=self.device)
        return local.reshape(1)

    def _hook(self, pending: PendingUpdate, index: int) -> None:
        grads = pending.grads
        for name, param in self.params.items():
            param.grad = grads.get(name)
        self.before_update()
        for name, param in self.params.items():
            if param.grad is not None and name in grads:  # the hook may have replaced a gradient
                grads[name] = param.grad
            param.grad = None

    @torch.no_grad()
    def _step(self, pending: PendingUpdate, index: int) -> None:
        """Step the optimizer on the (clipped) gradient into version ``pending.step + 1``'s buffer."""
        step = pending.step
        scale = None
        if pending.norm_sq is not None:
            total = pending.norm_sq.sqrt()
            scale = torch.clamp(self.clip_grad_norm / (total + 1e-6), max=1.0)
        self.weights.prepare(step + 1)
        grads = [pending.grads[name] for name in self.stepped]
        if scale is not None:
            # Per dtype, as `grad.mul_(scale.to(grad.dtype))` does one gradient at a time.
            for dtype in dict.fromkeys(g.dtype for g in grads):
                torch._foreach_mul_([g for g in grads if g.dtype == dtype], scale.reshape(()).to(dtype))
        for name, grad in zip(self.stepped, grads):
            self.params[name].grad = grad
        with self.hyperparameters.of(step):
            self.optimizer.step()
        self.hyperparameters.stepped()
        for name in self.stepped:
            self.params[name].grad = None
        pending.grads = {}

    OPERATIONS: ClassVar[dict[tuple[str, str], Callable[[UpdateDriver, PendingUpdate, int], None]]] = {
        ("post", "average"): _post_average,
        ("wait", "average"): _wait_for("average"),
        ("post", "reduce-scatter"): _post_reduce_scatter,
        ("wait", "reduce-scatter"): _wait_reduce_scatter,
        ("post", "all-gather"): _post_all_gather,
        ("wait", "all-gather"): _wait_for("all-gather"),
        ("post", "tied average"): _post_tied_average,
        ("wait", "tied average"): _wait_for("tied average"),
        ("post", "norms"): _post_norms,
        ("wait", "norms"): _wait_norms,
        ("post", "tie"): _post_tie,
        ("wait", "tie"): _wait_tie,
        ("post", "norm"): _post_norm,
        ("wait", "norm"): _wait_norm,
        ("run", "hook"): _hook,
        ("run", "local norm"): _local_norm,
        ("run", "step"): _step,
    }
    """The runtime's operation for each kind of the plan's entries, called with the update and the entry's
    index (a tie's)."""

    def version_lag(self) -> int:
        """How many versions the newest update's gradient was behind the version it produced, less one."""
        if not self.log:
            return 0
        _, gradient_version, produced = self.log[-1]
        return (produced - 1) - max(gradient_version, 0)

    def _publish(self, pending: PendingUpdate) -> None:
        step = pending.step
        self.log.append((step, self.weights.used.get(step, step), step + 1))
        self.weights.newest = step + 1
