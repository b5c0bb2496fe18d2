"""What a pipeline does when something fails: no drain, the real error first, every rank gone within the timeout.

After an exception (a ``DataOrderError``, a NaN loss, an out-of-memory, Ctrl+C) Lightning calls the strategy's
``on_exception`` and then ``teardown``. A normal teardown drains the pipeline, which waits on peers that are not
draining: on gloo that fails fast, on NCCL the host blocks behind a receive that never comes. So
:class:`FailureGuard`, the strategy's part of it,

- records the exception in ``on_exception``, prints ``rank 1 (stage 1 of 3) failed: <Type>: <message>`` on
  stderr before anything else can (the root cause comes first in the job's output), and reports it to the other
  ranks through the :class:`~lightning_async_pp.strategy.watchdog.PeerWatchdog`. An error that follows a peer's
  failure (a closed connection, a timed-out transfer) is said to be one: ``rank 0 (stage 2 of 3) stops: stage 1
  (rank 1) failed: ...``;
- in ``teardown`` skips the drain and Lightning's teardown (which moves the model to the CPU: a device
  synchronisation), aborts the process groups, and makes sure the process ends: the exception then leaves
  ``fit`` as usual, and a process still alive ``EXIT_GRACE_S`` seconds later (a hang at interpreter exit, or
  code after ``fit``, which can no longer use the aborted groups) exits with status 1;
- on the other ranks, the watchdog's thread learns of the failure (or of a rank that died without a word),
  prints which stage failed or died, aborts the process groups and exits with status 1, even while the main
  thread is blocked in the device.

The strategy's launcher of ``python -m ...`` children waits ``SELF_EXIT_S`` after a child's error before it ends
the processes still running, so a job whose ranks all refused something ends with status 1, not killed.

A ``SIGTERMException`` from :mod:`~lightning_async_pp.strategy.signals` is not a failure: every rank stops at
the same step, so the drain is safe and the teardown normal.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_async_pp.strategy.topology import PipelineDims
from lightning_async_pp.strategy.watchdog import PeerWatchdog

__all__ = ["EXIT_GRACE_S", "SELF_EXIT_S", "FailureGuard", "abort_process_groups"]

EXIT_GRACE_S = 15.0
"""Seconds a failed rank's process may live after its teardown before it is ended."""
ABORT_S = 10.0
"""Seconds the process groups' abort may take (NCCL's abort can hang) before the process exits anyway."""
EXIT_CODE = 1
SELF_EXIT_S = 45.0
"""Seconds within which every rank of a failed job ends by itself: the report (at most 10 s, rank 0 holding the
store until the others have read it), the abort of the groups (``ABORT_S``), then ``EXIT_GRACE_S``. A process of the
job still running after that is stuck, and the launcher ends it."""


class FailureGuard:
    """The failure handling of one strategy (see the module docstring); inert on one device.

    Attributes:
        exception: The exception ``on_exception`` recorded (``None``: nothing failed).
        watchdog: The heartbeat of the current ``fit``/``validate``/... (multi-process only).
    """

    def __init__(self) -> None:
        self.exception: BaseException | None = None
        self.watchdog: PeerWatchdog | None = None
        self._name = "this rank"

    def start(self, group: dist.ProcessGroup, dims: PipelineDims, rank: int, timeout: timedelta) -> None:
        """Start the watchdog on ``group`` (every rank, right after the groups exist).

        Args:
            group: Every rank's heartbeat group (``ProcessGroups.watchdog``).
            dims: The job's stages and replicas, to name the ranks.
            rank: This process's global rank.
            timeout: How long the heartbeat waits for a silent rank.
        """
        self.exception = None
        self._name = f"rank {rank} ({describe_stage(dims, rank, of=True)})"
        self.watchdog = PeerWatchdog(
            group,
            rank,
            dims.world_size,
            lambda r: f"{describe_stage(dims, r)} (rank {r})",
            timeout,
            self._peer_failed,
        )
        self.watchdog.start()

    def on_exception(self, exception: BaseException) -> None:
        """Record ``exception``, print it first (or that it follows a peer's failure), and report it."""
        if isinstance(exception, SIGTERMException) or self.exception is not None:
            return
        self.exception = exception
        if not dist.is_available() or not dist.is_initialized():
            return  # one process: Lightning's own handling is right
        watchdog = self.watchdog
        # A communication error may be the consequence of a peer's failure the watchdog is about to learn.
        wait = 2 * watchdog.period if watchdog is not None and isinstance(exception, RuntimeError) else 0.0
        peer = watchdog.claim(wait) if watchdog is not None else None
        error = f"{type(exception).__name__}: {exception}"
        if peer is not None:
            _say(f"{self._name} stops: {peer}")
            watchdog.hold_store()
            return
        _say(f"{self._name} failed: {error}")
        if watchdog is not None:
            watchdog.report_failure(error, wait=min(watchdog.timeout / 2, 10.0))

    def teardown(self, flush: Callable[[], None]) -> bool:
        """After a failure: abort the process groups and make sure the process ends, without ``flush``. After a
        normal end: ``flush``, then wait for every rank to finish (at most the timeout).

        Args:
            flush: Drains the pipeline (waits on the peers).

        Returns:
            Whether this rank failed (the caller then skips Lightning's teardown too).
        """
        if self.exception is None or not dist.is_available() or not dist.is_initialized():
            flush()
            if self.watchdog is not None:
                self.watchdog.finish()
            self.watchdog = None
            return False
        abort_process_groups()
        _exit_later(EXIT_GRACE_S)
        return True

    def _peer_failed(self, message: str) -> None:
        # On the watchdog's thread: the main thread may be blocked in the device for good.
        _say(f"{self._name} stops: {message}. Aborting its process groups and exiting.")
        if self.watchdog is not None:
            self.watchdog.hold_store()
        abort_process_groups()
        _exit_now()


def describe_stage(dims: PipelineDims, rank: int, of: bool = False) -> str:
    """``"stage 1"`` (``"stage 1 of 3"``), with the replica when there are several."""
    text = f"stage {dims.stage_of(rank)}" + (f" of {dims.num_stages}" if of else "")
    if dims.data_parallel_size > 1:
        text += f", replica {dims.replica_of(rank)}"
    return text


def abort_process_groups(limit: float = ABORT_S) -> None:
    """Abort every process group of this process (pending operations fail, communicators are freed), in a thread:
    a NCCL abort that hangs holds the process at most ``limit`` seconds."""

    def abort() -> None:
        try:
            dist.distributed_c10d._abort_process_group()  # every group, NCCL's aborts batched as torch needs
        except Exception:  # noqa: BLE001 - an abort the backend lacks: destroy instead
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - nothing left to free; the process ends next
                pass

    thread = threading.Thread(target=abort, name="async_pp abort", daemon=True)
    thread.start()
    thread.join(limit)


def _say(line: str) -> None:
    sys.stdout.flush()
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _exit_now() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_CODE)


def _exit_later(seconds: float) -> None:
    def end() -> None:
        time.sleep(seconds)
        _exit_now()

    threading.Thread(target=end, name="async_pp exit", daemon=True).start()
