"""A stage's optimizer state split over its data-parallel replicas: each replica owns whole tensors.

Every replica of a stage holds the stage's weights, but only the optimizer state of the tensors it owns, as
torch's ``ZeroRedundancyOptimizer`` and distributed Muon do: a tensor's owner steps it (Muon's owner runs
Newton-Schulz on the full matrix), and the new weights reach the other replicas. Whole tensors suit every
optimizer whose update of a parameter reads only that parameter's gradient and state
(:func:`~lightning_async_pp.optim.updates_per_parameter`).

One update, for the stage's gradients of one step:

1. :meth:`ReplicaShards.reduce` copies every gradient into one flat buffer (per device and dtype) laid out
   replica by replica, each replica's segment holding the tensors it owns, padded to the longest segment, and
   posts a reduce-scatter: each owner receives the average of its tensors' gradients over the replicas, in its
   own small buffer. The sum is the backend's sum of the same values an all-reduce would add, divided by
   ``D`` in the same dtype (NCCL's ``AVG`` for a power-of-two ``D``, see
   :mod:`~lightning_async_pp.runtime.replicas`).
2. The owner steps its tensors (an optimizer that holds only them, :func:`keep_owned`).
3. :meth:`ReplicaShards.gather` copies the owned new weights into their segment of the same flat buffer, which
   the reduce-scatter no longer needs, and posts an all-gather in place; its finish copies the other replicas'
   tensors into the new weight version. Besides the flat buffer (the size of the gradient, as the unsharded
   average's buckets) only the owner's ``1/D`` of it is allocated.

When each step runs (at ``UPDATE``, the next backward, or where the update settles) is the update's plan
(:class:`~lightning_async_pp.schedule.UpdatePlan`), which :class:`~lightning_async_pp.runtime.updates.UpdateDriver`
executes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from lightning_async_pp.runtime.replicas import averages_exactly

__all__ = ["ReplicaShards", "keep_owned", "plan_owners"]


def plan_owners(sizes: Mapping[str, int], replicas: int) -> dict[str, int]:
    """Which replica owns each tensor: largest first, each to the replica with the fewest bytes so far.

    Every replica of a stage computes the same plan from the same names and sizes. The heaviest replica holds
    at most one tensor more than an even split (the largest one, in the worst case).

    Args:
        sizes: Bytes of each tensor, by name, in the stage's order (ties broken by that order).
        replicas: Number of replicas ``D``.

    Returns:
        The owner of each tensor, by name, in the order of ``sizes``.
    """
    load = [0] * replicas
    owners: dict[str, int] = {}
    for name in sorted(sizes, key=lambda n: -sizes[n]):  # stable: the stage's order breaks ties
        owner = min(range(replicas), key=lambda r: (load[r], r))
        owners[name] = owner
        load[owner] += sizes[name]
    return {name: owners[name] for name in sizes}


def keep_owned(optimizer: Optimizer, owned: Sequence[Tensor]) -> None:
    """Remove every parameter but ``owned`` from ``optimizer``'s groups, and their state, in place.

    The groups stay (possibly empty), with their hyperparameters, so that learning-rate schedulers, which hold
    the optimizer and edit ``param_groups[i]``, keep working.
    """
    keep = {id(p) for p in owned}
    for group in optimizer.param_groups:
        if "param_names" in group:
            pairs = zip(group["params"], group["param_names"])
            group["param_names"] = [name for p, name in pairs if id(p) in keep]
        for p in group["params"]:
            if id(p) not in keep:
                optimizer.state.pop(p, None)
        group["params"] = [p for p in group["params"] if id(p) in keep]


@dataclass
class _Flat:
    """One flat buffer of ``D`` segments of ``length`` elements, and the tensors in each: per replica,
    ``(name, offset, numel, shape)`` with offsets within the segment."""

    flat: Tensor
    mine: Tensor
    length: int
    segments: list[list[tuple[str, int, int, torch.Size]]]

    def views(self, replica: int, source: Tensor | None = None) -> dict[str, Tensor]:
        """The tensors of ``replica``'s segment as views of ``flat`` (or of ``source``, one segment long)."""
        base = self.flat[replica * self.length : (replica + 1) * self.length] if source is None else source
        return {name: base[o : o + n].view(shape) for name, o, n, shape in self.segments[replica]}


class ReplicaShards:
    """Reduce-scatters a stage's gradients to their owners and all-gathers the owners' new weights.

    The buffers serve one update at a time: wait for a reduce-scatter before posting an all-gather, and step on
    the averaged gradients and wait for the all-gather before posting the next reduce-scatter.

    Args:
        params: The stage's trainable parameters, by name (their shapes, dtypes and devices).
        owners: The replica that owns each parameter (:func:`plan_owners`).
        replica: This replica.
        group: Process group of the stage's replicas, ranked by replica.
    """

    def __init__(self, params: Mapping[str, Tensor], owners: Mapping[str, int], replica: int, group: Any) -> None:
        self.group, self.replica = group, replica
        self.size = dist.get_world_size(group)
        self.owned = [name for name in params if owners[name] == replica]
        """Names of the parameters this replica owns, in the stage's order."""
        by_kind: dict[tuple[torch.device, torch.dtype], list[str]] = {}
        for name, p in params.items():
            by_kind.setdefault((p.device, p.dtype), []).append(name)
        self._flats: list[_Flat] = []
        for (device, dtype), names in by_kind.items():
            segments: list[list[tuple[str, int, int, torch.Size]]] = [[] for _ in range(self.size)]
            used = [0] * self.size
            for name in names:
                r = owners[name]
                segments[r].append((name, used[r], params[name].numel(), params[name].shape))
                used[r] += params[name].numel()
            length = max(used)
            flat = torch.zeros(length * self.size, dtype=dtype, device=device)
            self._flats.append(_Flat(flat, torch.zeros(length, dtype=dtype, device=device), length, segments))
        self._average = [averages_exactly(group, f.flat, self.size) for f in self._flats]

    @torch.no_grad()
    def reduce(self, grads: Mapping[str, Tensor]) -> Callable[[], dict[str, Tensor]]:
        """Copy ``grads`` into the flat buffers and post their reduce-scatters (non-blocking).

        Returns:
            A function that waits for them and returns this replica's gradients, averaged over the replicas:
            views of its own buffer, valid until the next :meth:`reduce`.
        """
        works = []
        for f, average in zip(self._flats, self._average):
            targets = [v for r in range(self.size) for v in f.views(r).values()]
            sources = [grads[name] for r in range(self.size) for name, _, _, _ in f.segments[r]]
            torch._foreach_copy_(targets, sources)
            op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
            works.append(dist.reduce_scatter_single(f.mine, f.flat, op=op, group=self.group, async_op=True))

        def finish() -> dict[str, Tensor]:
            owned: dict[str, Tensor] = {}
            for f, average, work in zip(self._flats, self._average, works):
                work.wait()
                if not average:
                    f.mine /= self.size
                owned.update(f.views(self.replica, f.mine))
            return {name: owned[name] for name in self.owned}

        return finish

    @torch.no_grad()
    def gather(self, weights: Mapping[str, Tensor]) -> Callable[[], None]:
        """Post the all-gathers of this replica's tensors of ``weights`` (non-blocking).

        Args:
            weights: The new weight version, by name: this replica's tensors hold their new values; the
                returned function writes the other replicas' into the others.
        """
        works = []
        for f in self._flats:
            mine = f.views(self.replica)
            if mine:
                torch._foreach_copy_(list(mine.values()), [weights[name] for name in mine])
            segment = f.flat[self.replica * f.length : (self.replica + 1) * f.length]
            works.append(dist.all_gather_single(f.flat, segment, group=self.group, async_op=True))

        @torch.no_grad()
        def finish() -> None:  # the weight versions are leaves that require grad
            for f, work in zip(self._flats, works):
                work.wait()
                others = {n: v for r in range(self.size) if r != self.replica for n, v in f.views(r).items()}
                if others:
                    torch._foreach_copy_([weights[name] for name in others], list(others.values()))

        return finish
