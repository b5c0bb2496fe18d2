"""Averaging a stage's gradient over its data-parallel replicas: bucketed all-reduces, posted without waiting.

A stage's gradient is copied into flat buckets (at most ``bucket_bytes`` each, per device), allocated once and
reused at every update, and each bucket's all-reduce is posted at once (``async_op=True``). The gradient
tensors can then be views of the buckets, so the averaged values need no copy back. Whoever needs the averaged
gradient calls the function :meth:`ReplicaAverage.start` returns; the all-reduces overlap everything until
then.

The result is bit-identical to one all-reduce of the concatenated gradient followed by a division by the
number of replicas: a bucket holds the gradient in the dtype ``torch.cat`` would promote it to, each element
is the backend's sum of the same values (with two replicas, in the same order; with more, in the order the
backend's algorithm takes for the element's position in the buffer), divided by the number of replicas
in the same dtype. NCCL's ``ReduceOp.AVG`` scales every input by ``1 / D`` before summing; for a power of
two ``D`` that is exact, so it is used there and saves the division (gloo has no ``AVG``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

BUCKET_BYTES = 25 * 2**20
"""Default size bound of one bucket (as DDP's ``bucket_cap_mb=25``)."""

# Dtypes whose scaling by a power of two is exact (outside the subnormal range), so that NCCL's AVG, which
# scales each input by 1 / D before summing, equals a sum divided by D.
_AVG_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


@dataclass
class _Bucket:
    """One flat buffer and the gradients it holds: ``(name, offset, numel, shape)`` each."""

    flat: Tensor
    entries: list[tuple[str, int, int, torch.Size]]


class ReplicaAverage:
    """Averages a stage's gradients over its replicas in flat buckets, each bucket one all-reduce in flight.

    One average may be in flight at a time: the buckets are reused by the next one.

    Args:
        group: Process group of this stage's replicas.
        bucket_bytes: Size bound of one bucket; a larger gradient gets a bucket of its own.
    """

    def __init__(self, group: Any, bucket_bytes: int = BUCKET_BYTES) -> None:
        self.group = group
        self.bucket_bytes = bucket_bytes
        self._buckets: list[_Bucket] = []
        self._layout: tuple | None = None
        self._avg: dict[tuple[torch.device, torch.dtype], bool] = {}
        self.posted = 0
        """Number of all-reduces posted so far (one per bucket and update)."""

    def start(self, grads: dict[str, Tensor], views: bool = True) -> Callable[[], None]:
        """Copy ``grads`` into the buckets and post their all-reduces (non-blocking).

        The returned function waits for the all-reduces and leaves the average in ``grads``. Call it before
        the next :meth:`start`.

        Args:
            grads: The stage's gradients, by parameter name, updated in place.
            views: Make ``grads[name]`` a view of its bucket where the bucket has the gradient's dtype (the
                original tensor is released, no copy back); the gradient then lives in the buckets until the
                next :meth:`start`. Otherwise the average is copied back into the original tensors.
        """
        if not grads:
            return _nothing
        buckets = self._buckets_for(grads)
        back: list[tuple[Tensor, Tensor]] = []  # (gradient, its view in the bucket) to copy the average into
        for bucket in buckets:
            parts = [bucket.flat[o : o + n].view(shape) for _, o, n, shape in bucket.entries]
            torch._foreach_copy_(parts, [grads[name] for name, _, _, _ in bucket.entries])
            for (name, _, _, _), view in zip(bucket.entries, parts):
                if views and view.dtype == grads[name].dtype:
                    grads[name] = view
                else:
                    back.append((grads[name], view))
        world_size = dist.get_world_size(self.group)
        works = []
        for bucket in buckets:
            average = self._averages(bucket.flat, world_size)
            op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
            works.append((dist.all_reduce(bucket.flat, op=op, group=self.group, async_op=True), average))
            self.posted += 1

        def finish() -> None:
            for bucket, (work, average) in zip(buckets, works):
                work.wait()
                if not average:
                    bucket.flat /= world_size
            if back:
                torch._foreach_copy_([g for g, _ in back], [v for _, v in back])

        return finish

    def _buckets_for(self, grads: dict[str, Tensor]) -> list[_Bucket]:
        layout = tuple((name, g.shape, g.dtype, g.device) for name, g in grads.items())
        if layout != self._layout:
            self._buckets = _make_buckets(grads, self.bucket_bytes)
            self._layout = layout
        return self._buckets

    def _averages(self, flat: Tensor, world_size: int) -> bool:
        key = (flat.device, flat.dtype)
        if key not in self._avg:
            self._avg[key] = averages_exactly(self.group, flat, world_size)
        return self._avg[key]


def averages_exactly(group: Any, flat: Tensor, world_size: int) -> bool:
    """Whether the backend's ``ReduceOp.AVG`` over ``group`` gives exactly the sum divided by ``world_size`` for
    ``flat``: on NCCL, for a power-of-two ``world_size`` and a dtype whose scaling by it is exact (gloo has no
    ``AVG``)."""
    backend = str(dist.get_backend(group))
    nccl = backend == "nccl" or (flat.device.type == "cuda" and "cuda:nccl" in backend)
    power_of_two = world_size & (world_size - 1) == 0
    return nccl and power_of_two and flat.dtype in _AVG_DTYPES


def _nothing() -> None:
    pass


def _make_buckets(grads: dict[str, Tensor], bucket_bytes: int) -> list[_Bucket]:
    """Buckets in the order of ``grads``, per device, in the dtype all of that device's gradients promote to."""
    by_device: dict[torch.device, list[str]] = {}
    for name, g in grads.items():
        by_device.setdefault(g.device, []).append(name)
    buckets = []
    for device, names in by_device.items():
        dtype = functools.reduce(torch.promote_types, (grads[n].dtype for n in names))
        limit = max(1, bucket_bytes // torch.empty((), dtype=dtype).element_size())
        for group in _fill(names, [grads[n].numel() for n in names], limit):
            entries, offset = [], 0
            for name in group:
                entries.append((name, offset, grads[name].numel(), grads[name].shape))
                offset += grads[name].numel()
            buckets.append(_Bucket(torch.empty(offset, dtype=dtype, device=device), entries))
    return buckets


def _fill(names: Sequence[str], sizes: Sequence[int], limit: int) -> list[list[str]]:
    """Consecutive groups of ``names`` of at most ``limit`` elements each (a larger one alone)."""
    groups: list[list[str]] = []
    current: list[str] = []
    total = 0
    for name, size in zip(names, sizes):
        if current and total + size > limit:
            groups.append(current)
            current, total = [], 0
        current.append(name)
        total += size
    if current:
        groups.append(current)
    return groups
