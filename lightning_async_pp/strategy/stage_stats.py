"""Every stage's step statistics on global rank 0: a bounded history, logged where Lightning logs the loss.

The strategy hands each step's :class:`~lightning_async_pp.runtime.stage.StepStats` to :meth:`StageStatistics.report`
on every rank; the records travel to rank 0 on a :class:`~lightning_async_pp.runtime.timing.StatsRelay` without
blocking, and rank 0 keeps and logs them.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning_async_pp.runtime.timing import StatsRelay, StepStats

if TYPE_CHECKING:
    from lightning_async_pp.strategy.topology import PipelineDims

# Steps of per-stage statistics rank 0 keeps (older ones are dropped; the logger has them).
STAGE_STATS_HISTORY = 1000


class StageStatistics:
    """Collects the stages' step statistics on global rank 0 and logs them every ``log_every_n_steps``.

    Logged per stage: ``pipeline/stage{s}/bubble_fraction``, ``forward_sec``, ``backward_sec``, ``wait_sec``,
    ``update_sec`` and ``version_lag``; once every stage reported a logged step, ``pipeline/bubble_fraction``
    (their mean), and ``train/aux_loss`` (the sum over stages of their auxiliary losses, when a layer attaches
    any: :mod:`~lightning_async_pp.runtime.auxiliary`). With the strategy's ``stage_timing=False`` the runtime
    times steps, not actions: only ``version_lag`` (and ``train/aux_loss``) is logged then.

    Args:
        num_stages: Stages of one pipeline.
        stage: This rank's stage.
        is_global_zero: Whether this rank keeps and logs the records (the others only send theirs).
        relay: Carries the other stages' records to rank 0; ``None`` records this rank's only.
        stage_of_rank: The stage of a global rank that reports through ``relay``.
        history: Steps kept per stage in :attr:`records`.
    """

    def __init__(
        self,
        num_stages: int,
        stage: int = 0,
        is_global_zero: bool = True,
        relay: StatsRelay | None = None,
        stage_of_rank: Callable[[int], int] | None = None,
        history: int = STAGE_STATS_HISTORY,
    ) -> None:
        self.num_stages = num_stages
        self.stage = stage
        self.is_global_zero = is_global_zero
        self.relay = relay
        self.stage_of_rank = stage_of_rank or (lambda rank: rank)
        self.history = history
        self.records: dict[int, deque[StepStats]] = {}
        """Global rank 0: every stage's records of the last ``history`` steps, per stage, in step order."""
        self._pending: dict[int, dict[int, StepStats]] = {}  # step -> stage -> record, until every stage reported
        self._reported = 0

    @classmethod
    def for_pipeline(cls, dims: PipelineDims, rank: int, group: Any) -> StageStatistics:
        """The statistics of global rank ``rank``: replica 0's stages report to rank 0 over ``group`` (gloo)."""
        peers = [r for r in dims.pipeline(0) if r != 0]
        relay = StatsRelay(rank, peers, group)
        return cls(dims.num_stages, dims.stage_of(rank), rank == 0, relay, stage_of_rank=dims.stage_of)

    def report(self, stats: StepStats | None, trainer: Any) -> None:
        """Every rank, once per step: send this stage's record; on rank 0 also take what has arrived."""
        if stats is None:
            return
        self._reported += 1
        if self.relay is not None:
            self.relay.publish(stats)
        if self.is_global_zero:
            self.record(self.stage, stats, trainer)
            self._poll(trainer, block=False)

    def finish(self, remaining: list[StepStats], trainer: Any) -> None:
        """Every rank, at the end of training: report ``remaining``, then rank 0 waits for every stage's records
        and the others for rank 0 to have taken theirs."""
        for stats in remaining:
            self.report(stats, trainer)
        if self.relay is None:
            return
        if self.is_global_zero:
            self._poll(trainer, block=True)
        else:
            self.relay.close()

    def _poll(self, trainer: Any, block: bool) -> None:
        if self.relay is not None:
            self.relay.poll(
                lambda rank, s: self.record(self.stage_of_rank(rank), s, trainer), self._reported, block=block
            )

    def record(self, stage: int, stats: StepStats, trainer: Any) -> None:
        """Rank 0: keep one stage's record and log it at the steps Lightning logs ``train/loss`` at."""
        self.records.setdefault(stage, deque(maxlen=self.history)).append(stats)
        every = trainer.log_every_n_steps
        if not trainer.loggers or every == 0 or (stats.step + 1) % every != 0:
            return
        prefix = f"pipeline/stage{stage}"
        metrics = {
            f"{prefix}/bubble_fraction": stats.bubble_fraction,
            f"{prefix}/forward_sec": stats.forward,
            f"{prefix}/backward_sec": stats.backward,
            f"{prefix}/wait_sec": stats.wait,
            f"{prefix}/update_sec": stats.update,
            f"{prefix}/version_lag": float(stats.version_lag),
        }
        step_records = self._pending.setdefault(stats.step, {})
        step_records[stage] = stats
        if len(step_records) == self.num_stages:
            del self._pending[stats.step]
            metrics["pipeline/bubble_fraction"] = (
                sum(r.bubble_fraction for r in step_records.values()) / self.num_stages
            )
            aux = [r.aux_loss for r in step_records.values() if not math.isnan(r.aux_loss)]
            if aux:  # the routers' load-balancing losses of every stage (runtime.auxiliary)
                metrics["train/aux_loss"] = sum(aux)
        metrics = {name: value for name, value in metrics.items() if not math.isnan(value)}  # stage_timing=False
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=stats.step)

    @property
    def waiting_steps(self) -> int:
        """Logged steps some stage has not reported yet (0 once every record arrived)."""
        return len(self._pending)
