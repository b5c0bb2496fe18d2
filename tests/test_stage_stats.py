"""Rank 0's record of the stages' statistics stays bounded, and reaches the logger every log_every_n_steps."""

from types import SimpleNamespace

from lightning_async_pp import AsyncPipelineStrategy
from lightning_async_pp.pipeline.runtime import StepStats
from lightning_async_pp import strategy as strategy_module

STAGE_STATS_HISTORY = getattr(strategy_module, "STAGE_STATS_HISTORY", 1000)


class Logger:
    def __init__(self) -> None:
        self.steps: list[int] = []

    def log_metrics(self, metrics, step) -> None:
        self.steps.append(step)


def strategy_with(logger: Logger, log_every_n_steps: int) -> AsyncPipelineStrategy:
    strategy = AsyncPipelineStrategy(pipeline_parallel_size=2)
    trainer = SimpleNamespace(loggers=[logger], log_every_n_steps=log_every_n_steps)
    strategy._lightning_module = SimpleNamespace(trainer=trainer)
    return strategy


def test_stage_stats_keep_the_latest_steps_only():
    strategy = strategy_with(Logger(), 1)
    steps = 2 * STAGE_STATS_HISTORY + 3
    for step in range(steps):
        for stage in (0, 1):
            strategy._record_stats(stage, StepStats(step=step, wall=1.0))
    for stage in (0, 1):
        kept = [record.step for record in strategy.stage_stats[stage]]
        assert kept == list(range(steps - STAGE_STATS_HISTORY, steps))
    assert not strategy._pending_stage_stats


def test_stage_metrics_follow_log_every_n_steps():
    logger = Logger()
    strategy = strategy_with(logger, 5)
    for step in range(20):
        for stage in (1, 0):
            strategy._record_stats(stage, StepStats(step=step, wall=1.0))
    # Lightning logs train/loss after steps 4, 9, 14, 19 (0-based) with log_every_n_steps=5; each stage once there.
    assert logger.steps == [4, 4, 9, 9, 14, 14, 19, 19]
    assert len(strategy.stage_stats[0]) == 20 and not strategy._pending_stage_stats
