"""The data-order check between neighbouring stages: one small message per step and link.

At the start of each step a stage computes the fingerprints of its micro-batches
(:func:`~lightning_async_pp.runtime.fingerprint.step_fingerprints`, one pass over the batch), posts their send
to the next stage and the receive of the previous stage's. Before its first forward of the step it compares
the two (:class:`~lightning_async_pp.runtime.fingerprint.FingerprintCheck`): on a CPU at once, so a mismatch
stops the step before any micro-batch of it runs; on a GPU on the device, read by the host later.

The messages travel on a process group of their own, so they never queue behind activations or meet the
transfers' ordering (see :mod:`lightning_async_pp.runtime.comm`): per link they are posted in step order on
both ends, and a stage waits for step ``t``'s only where it already needs step ``t``'s first activation from
the same peer, which that peer sends after it posted the fingerprints. A send is let go once the schedule
implies the peer has it (a gradient of that step came back), like the activations' sends.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_async_pp.runtime.fingerprint import FingerprintCheck, step_fingerprints


class DataOrderLink:
    """One stage's end of the per-step fingerprint exchange with its neighbours.

    Args:
        stage: This stage's index (named in errors).
        prev_rank: Global rank of the previous stage (``None`` on the first stage).
        next_rank: Global rank of the next stage (``None`` on the last stage).
        group: A process group of the pipeline's stages used for these messages only.
        num_microbatches: Micro-batches per batch (a step's fingerprints have a row per micro-batch of each of its
            batches).
    """

    def __init__(
        self,
        stage: int,
        prev_rank: int | None,
        next_rank: int | None,
        group: Any,
        num_microbatches: int,
    ) -> None:
        self.stage, self.prev_rank, self.next_rank, self.group = stage, prev_rank, next_rank, group
        self.num_microbatches = num_microbatches
        self._mine: dict[int, Tensor] = {}
        self._receives: dict[int, tuple[Tensor, dist.Work]] = {}
        self._sends: collections.deque[tuple[int, dist.Work, Tensor]] = collections.deque()
        self._checks: collections.deque[FingerprintCheck] = collections.deque()

    def start_step(self, step: int, batches: Sequence[Any]) -> None:
        """Fingerprint the step's ``batches``, send the fingerprints on and post the receive of the previous stage's."""
        rows = [step_fingerprints(batch, self.num_microbatches) for batch in batches]
        mine = rows[0] if len(rows) == 1 else torch.cat(rows)
        if self.next_rank is not None:
            self._sends.append((step, dist.isend(mine, self.next_rank, group=self.group), mine))
        if self.prev_rank is not None:
            received = torch.empty(mine.shape[0], 2, dtype=torch.int64, device=mine.device)
            self._receives[step] = (received, dist.irecv(received, self.prev_rank, group=self.group))
            self._mine[step] = mine

    def check(self, step: int) -> None:
        """Before ``step``'s first forward: compare its fingerprints with the previous stage's (nothing on the first
        stage). On CPU a mismatch raises here; on a GPU the flag is read later (:meth:`read_checks`)."""
        if step not in self._receives:
            return
        received, work = self._receives.pop(step)
        work.wait()  # on NCCL the device waits, not the host
        self._checks.append(FingerprintCheck(self._mine.pop(step), received, step, self.stage))
        self.read_checks(oldest_step=step - 2)

    def read_checks(self, oldest_step: int | None) -> None:
        """Raise for a mismatch the device has reported; wait for the checks of steps before ``oldest_step`` (all if
        ``None``)."""
        checks = self._checks
        while checks and (oldest_step is None or checks[0].step < oldest_step or checks[0].ready()):
            checks.popleft().raise_if_different()

    def peer_received(self, step: int) -> None:
        """The next stage has run a forward of ``step``, so it has received every step's fingerprints up to it."""
        sends = self._sends
        while sends and sends[0][0] <= step:
            sends.popleft()[1].wait()

    def wait_sends(self) -> None:
        """Wait for every posted send (at a drain, when the pipeline empties)."""
        while self._sends:
            self._sends.popleft()[1].wait()
