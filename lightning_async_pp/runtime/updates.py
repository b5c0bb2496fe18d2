"""A stage's weight updates: the step's gradient, averaged over replicas, summed over tied copies, clipped by
the global norm, and applied with the hyperparameters the trainer had set for that step.

Update timing. ``UPDATE(t)`` runs as soon as the stage's last backward of step ``t`` is done. What it
needs from other processes it posts as non-blocking collectives, and it applies the update only when the
new version is first needed (the first forward of step ``t + 2`` in 2BW), which keeps the pipeline free of
a barrier: the average over data-parallel replicas (bucketed, :mod:`~lightning_async_pp.runtime.replicas`),
the sums of tied gradients (:mod:`~lightning_async_pp.runtime.ties`), and with gradient clipping the
global norm, which needs every stage's share.

With the optimizer state sharded over the replicas (:mod:`~lightning_async_pp.runtime.sharding`), the average
is a reduce-scatter to each tensor's owner, the owner steps its tensors, and an all-gather brings the new
weights to every replica, waited for where the version is first needed (or at the next ``UPDATE``, which
reuses the buffers). The owner steps as early as it can without waiting for a peer that is still computing:

- without clipping and ties, at the stage's next backward after ``UPDATE(t)`` (:meth:`UpdateDriver.advance`):
  the reduce-scatter, posted at ``UPDATE(t)``, involves the stage's replicas alone;
- with clipping or ties (2BW), at the forward of micro-batch ``P - 1`` of step ``t + 1``
  (:meth:`UpdateDriver.settle`), which every stage runs after every stage's ``UPDATE(t)``
  (:func:`~lightning_async_pp.schedule.updates_settled_by`), so the norm and the tied sums are in.

Either way the all-gather overlaps the rest of step ``t + 1``: 2BW keeps its zero bubble.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_async_pp.runtime.replicas import ReplicaAverage
from lightning_async_pp.runtime.sharding import ReplicaShards, keep_owned, plan_owners
from lightning_async_pp.runtime.ties import TiedGradients
from lightning_async_pp.runtime.weights import WeightVersions
from lightning_async_pp.schedule import updates_settled_by, weight_version

NOT_HYPERPARAMETERS = ("params", "param_names")
"""Keys of an optimizer's param group that are not hyperparameters."""

_NORM_INPUTS = (torch.float32, torch.bfloat16, torch.float16)  # widened to float32 inside `_foreach_norm`


@dataclass
class PendingUpdate:
    """One step's update, from its gradient to its application.

    Args:
        step: The step whose gradient this is; applying it produces version ``step + 1``.
        grads: The gradient, by parameter name.
        norm_sq: The squared global gradient norm (or this stage's share until ``work`` or ``finish`` is done).
        work: The norm's all-reduce in flight.
        finish: Completes the tied-gradient sums (and the norm); returns the norm when it computed it.
        average: Completes the average over replicas (before ``finish``).
        reduce: Returns the owned gradients once their reduce-scatter has arrived (sharded state): set until the
            update is stepped, at the next backward (:meth:`UpdateDriver.advance`) or where the version is needed.
        gather: Completes the all-gather of the owners' new weights (sharded state, once stepped).
    """

    step: int
    grads: dict[str, Tensor]
    norm_sq: Tensor | None = None
    work: Any = None
    finish: Callable[[], Tensor | None] | None = None
    average: Callable[[], None] | None = None
    reduce: Callable[[], dict[str, Tensor]] | None = None
    gather: Callable[[], None] | None = None


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


class UpdateDriver:
    """Turns each step's gradient into the next weight version.

    The average over replicas is posted at ``UPDATE`` and waited for where the new version is first needed
    (:meth:`complete`), or at the next ``UPDATE``, which reuses its buckets. With a ``before_update`` hook,
    gradient clipping or tied parameters, it is waited for at once: the hook and the clipping norm need the
    averaged gradient at ``UPDATE``, and so do the tied sums, which are posted there in turn (a wait later
    would have to post them later, where another stage may already wait for them).

    With sharded state, see the module docstring: :meth:`advance` (at each backward) and :meth:`settle` (at each
    forward) step an update early, and :meth:`complete` waits for its all-gather.

    Args:
        optimizer: Optimizer over exactly the stage's trainable parameters.
        weights: The stage's weight versions (their ``params`` are the optimizer's).
        kind: ``"2bw"`` or ``"1f1b"``: which version a step's gradient was computed on.
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
    ) -> None:
        self.optimizer, self.weights = optimizer, weights
        self.params: dict[str, nn.Parameter] = weights.params
        self.kind, self.num_stages, self.device = kind, num_stages, device
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
        self._settle_at = updates_settled_by(kind, num_stages) if self.shards is not None else None
        self.defer_average = before_update is None and clip_grad_norm is None and ties is None
        """Whether the average over replicas stays in flight after ``UPDATE``."""
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
        """Take step ``step``'s gradient off its buffer; apply now, or once what it waits for has arrived."""
        grads = self.weights.take_gradients(weight_version(self.kind, step))
        pending = PendingUpdate(step, grads)
        if self.shards is not None:
            # The flat buffers are reused: the previous update's all-gather, which may still be in flight, lands
            # first. That update was stepped already (at a backward, or settled at a forward of this step), so
            # this waits for the replicas alone.
            self.complete(up_to_version=step)
            if self.defer_average:
                pending.grads, pending.reduce = {}, self.shards.reduce(grads)
                self.pending.append(pending)
                return
            reduce = self.shards.reduce(grads)
            tied = {name: grads[name] for name in self._tied}
            if tied:
                self.replicas.start(tied, views=False)()
            pending.grads = grads = {**reduce(), **tied}
        elif self.replicas is not None:
            if self.defer_average:
                # The buckets still hold an earlier step's gradient where its version was not needed yet
                # (2BW's last stage): apply it first, on its own buffer, which no micro-batch uses any more.
                self.complete(up_to_version=step)
                pending.average = self.replicas.start(grads)
                self.pending.append(pending)
                return
            self.replicas.start(grads, views=False)()
        if self.before_update is not None:
            self._call_before_update(grads)
        if self.clip_grad_norm is not None:
            self._start_norm(pending)
            self.pending.append(pending)
        elif self.ties is not None:
            pending.finish = self.ties.start(grads)
            self.pending.append(pending)
        elif self.shards is not None:
            pending.reduce = lambda: grads  # stepped at the next backward, as without the hook
            self.pending.append(pending)
        else:
            self.apply(pending)

    def settle(self, step: int, microbatch: int) -> None:
        """Sharded state with clipping or ties: at the forward of micro-batch
        :func:`~lightning_async_pp.schedule.updates_settled_by` of step ``step``, every stage has posted what the
        update of step ``step - 1`` exchanges over the pipeline (its norm, its tied sums): wait for it, step the
        owned tensors and post the all-gather, which then overlaps the rest of the step."""
        if microbatch != self._settle_at:
            return
        for pending in self.pending:
            if pending.step == step - 1 and pending.gather is None and pending.reduce is None:
                self._collect(pending)
                self._step(pending)

    def advance(self) -> None:
        """Step on the owned gradients whose reduce-scatter was posted at an earlier action (or waited for at
        once, for a hook), and post their all-gather (sharded state without clipping or ties; called at each
        backward)."""
        for pending in self.pending:
            if pending.reduce is not None:
                pending.grads, pending.reduce = pending.reduce(), None
                self._step(pending)

    def _start_norm(self, pending: PendingUpdate) -> None:
        # A tied parameter's norm is that of its summed gradient, counted once (added by `ties`).
        tied = self.ties.local_names if self.ties is not None else set()
        # In float32 whatever the gradients' dtype, as `torch.linalg.vector_norm(g.float())` per gradient: a
        # narrower dtype is widened inside the kernel, a wider one (float64) is cast first, as before.
        names = [n for n in self.params if n not in tied]
        mine = [n for n in names if n in pending.grads]  # all of them, unless the state is sharded
        untied = [pending.grads[n] for n in mine]
        untied = [g if g.dtype in _NORM_INPUTS else g.float() for g in untied]
        norms = torch.stack(torch._foreach_norm(untied, dtype=torch.float32)) if untied else None
        if self.shards is not None:
            # Each replica holds its own tensors' norms: the others' come as exact sums with zeros, so the stage's
            # norm is summed in the same order and to the same bits as without sharding.
            every = torch.zeros(len(names), dtype=torch.float32, device=self.device)
            if norms is not None:
                if self._norm_slots is None:  # made once: a tensor from host data is a host-to-device copy
                    self._norm_slots = torch.tensor([names.index(n) for n in mine], device=self.device)
                every.index_copy_(0, self._norm_slots, norms)
            dist.all_reduce(every, group=self.data_group)
            norms = every if names else None
        local = norms.pow(2).sum() if norms is not None else torch.zeros((), device=self.device)
        pending.norm_sq = local.reshape(1)
        if self.ties is not None:
            pending.finish = self.ties.start(pending.grads, pending.norm_sq, self.norm_group)
        elif self.num_stages > 1:
            pending.work = dist.all_reduce(pending.norm_sq, group=self.norm_group, async_op=True)

    def _call_before_update(self, grads: dict[str, Tensor]) -> None:
        for name, param in self.params.items():
            param.grad = grads.get(name)
        self.before_update()
        for name, param in self.params.items():
            if param.grad is not None and name in grads:  # the hook may have replaced a gradient
                grads[name] = param.grad
            param.grad = None

    def complete(self, up_to_version: int | None) -> None:
        """Apply pending updates that produce a version ``<= up_to_version`` (all if ``None``)."""
        while self.pending and (up_to_version is None or self.pending[0].step + 1 <= up_to_version):
            pending = self.pending.pop(0)
            self._collect(pending)
            self.apply(pending)

    def _collect(self, pending: PendingUpdate) -> None:
        """Wait for what ``pending`` still waits for: the average (or reduce-scatter), the norm, the tied sums."""
        if pending.average is not None:
            pending.average, average = None, pending.average
            average()
        if pending.reduce is not None:
            pending.grads, pending.reduce = pending.reduce(), None
        if pending.work is not None:
            pending.work, work = None, pending.work
            work.wait()
        if pending.finish is not None:
            pending.finish, finish = None, pending.finish
            norm_sq = finish()
            if norm_sq is not None:
                pending.norm_sq = norm_sq

    def apply(self, pending: PendingUpdate) -> None:
        """Write version ``pending.step + 1``: step the optimizer on the (clipped) gradient, unless that was done
        earlier (sharded state: then its all-gather is in flight), and make it the newest version."""
        if pending.gather is None:
            self._step(pending)
        if pending.gather is not None:
            pending.gather()
        self._publish(pending)

    @torch.no_grad()
    def _step(self, pending: PendingUpdate) -> None:
        """Step the optimizer on the (clipped) gradient into version ``pending.step + 1``'s buffer; with sharded
        state, post the all-gather of the owned tensors."""
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
        if self.shards is not None:
            pending.gather = self.shards.gather(self.weights.of(step + 1))

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
