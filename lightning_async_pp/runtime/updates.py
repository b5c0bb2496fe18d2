"""A stage's weight updates: the step's gradient, averaged over replicas, summed over tied copies, clipped by
the global norm, and applied with the hyperparameters the trainer had set for that step.

Update timing. ``UPDATE(t)`` runs as soon as the stage's last backward of step ``t`` is done. What it
needs from other processes it posts as non-blocking collectives, and it applies the update only when the
new version is first needed (the first forward of step ``t + 2`` in 2BW), which keeps the pipeline free of
a barrier: the average over data-parallel replicas (bucketed, :mod:`~lightning_async_pp.runtime.replicas`),
the sums of tied gradients (:mod:`~lightning_async_pp.runtime.ties`), and with gradient clipping the
global norm, which needs every stage's share.
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
from lightning_async_pp.runtime.ties import TiedGradients
from lightning_async_pp.runtime.weights import WeightVersions
from lightning_async_pp.schedule import weight_version

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
    """

    step: int
    grads: dict[str, Tensor]
    norm_sq: Tensor | None = None
    work: Any = None
    finish: Callable[[], Tensor | None] | None = None
    average: Callable[[], None] | None = None


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
    ) -> None:
        self.optimizer, self.weights = optimizer, weights
        self.params: dict[str, nn.Parameter] = weights.params
        self.kind, self.num_stages, self.device = kind, num_stages, device
        self.clip_grad_norm, self.norm_group, self.data_group = clip_grad_norm, norm_group, data_group
        self.before_update, self.ties = before_update, ties
        self.replicas = ReplicaAverage(data_group) if data_group is not None else None
        self.defer_average = before_update is None and clip_grad_norm is None and ties is None
        """Whether the average over replicas stays in flight after ``UPDATE``."""
        self.hyperparameters = StepHyperparameters(optimizer)
        self.pending: list[PendingUpdate] = []
        self.log: collections.deque[tuple[int, int, int]] = collections.deque(maxlen=1024)
        """Recent updates as (step, version the gradient was computed on, version produced)."""

    def start(self, step: int) -> None:
        """Take step ``step``'s gradient off its buffer; apply now, or once what it waits for has arrived."""
        grads = self.weights.take_gradients(weight_version(self.kind, step))
        pending = PendingUpdate(step, grads)
        if self.replicas is not None:
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
        else:
            self.apply(pending)

    def _start_norm(self, pending: PendingUpdate) -> None:
        # A tied parameter's norm is that of its summed gradient, counted once (added by `ties`).
        tied = self.ties.local_names if self.ties is not None else set()
        # In float32 whatever the gradients' dtype, as `torch.linalg.vector_norm(g.float())` per gradient: a
        # narrower dtype is widened inside the kernel, a wider one (float64) is cast first, as before.
        untied = [g if g.dtype in _NORM_INPUTS else g.float() for n, g in pending.grads.items() if n not in tied]
        norms = torch._foreach_norm(untied, dtype=torch.float32) if untied else ()
        local = torch.stack(norms).pow(2).sum() if norms else torch.zeros((), device=self.device)
        pending.norm_sq = local.reshape(1)
        if self.ties is not None:
            pending.finish = self.ties.start(pending.grads, pending.norm_sq, self.norm_group)
        elif self.num_stages > 1:
            pending.work = dist.all_reduce(pending.norm_sq, group=self.norm_group, async_op=True)

    def _call_before_update(self, grads: dict[str, Tensor]) -> None:
        for name, param in self.params.items():
            param.grad = grads[name]
        self.before_update()
        for name, param in self.params.items():
            if param.grad is not None:  # the hook may have replaced a gradient
                grads[name] = param.grad
            param.grad = None

    def complete(self, up_to_version: int | None) -> None:
        """Apply pending updates that produce a version ``<= up_to_version`` (all if ``None``)."""
        while self.pending and (up_to_version is None or self.pending[0].step + 1 <= up_to_version):
            pending = self.pending.pop(0)
            if pending.average is not None:
                pending.average()
            if pending.work is not None:
                pending.work.wait()
            if pending.finish is not None:
                norm_sq = pending.finish()
                if norm_sq is not None:
                    pending.norm_sq = norm_sq
            self.apply(pending)

    @torch.no_grad()
    def apply(self, pending: PendingUpdate) -> None:
        """Write version ``pending.step + 1``: step the optimizer on the (clipped) gradient."""
        step = pending.step
        scale = None
        if pending.norm_sq is not None:
            total = pending.norm_sq.sqrt()
            scale = torch.clamp(self.clip_grad_norm / (total + 1e-6), max=1.0)
        self.weights.prepare(step + 1)
        grads = [pending.grads[name] for name in self.params]
        if scale is not None:
            # Per dtype, as `grad.mul_(scale.to(grad.dtype))` does one gradient at a time.
            for dtype in dict.fromkeys(g.dtype for g in grads):
                torch._foreach_mul_([g for g in grads if g.dtype == dtype], scale.reshape(()).to(dtype))
        for param, grad in zip(self.params.values(), grads):
            param.grad = grad
        with self.hyperparameters.of(step):
            self.optimizer.step()
        self.hyperparameters.stepped()
        for param in self.params.values():
            param.grad = None
        self.log.append((step, self.weights.used.get(step, step), step + 1))
        self.weights.newest = step + 1
