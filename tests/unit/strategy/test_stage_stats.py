"""Rank 0's record of the stages' statistics stays bounded, and reaches the logger every log_every_n_steps."""

from types import SimpleNamespace

from lightning_async_pp import AsyncPipelineStrategy
from lightning_async_pp.runtime.timing import StepStats
from lightning_async_pp.strategy.stage_stats import STAGE_STATS_HISTORY, StageStatistics


class Logger:
    def __init__(self) -> None:
        self.steps: list[int] = []
        self.metrics: list[dict] = []

    def log_metrics(self, metrics, step) -> None:
        self.steps.append(step)
        self.metrics.append(metrics)


def trainer_with(logger: Logger, log_every_n_steps: int) -> SimpleNamespace:
    return SimpleNamespace(loggers=[logger], log_every_n_steps=log_every_n_steps)


def test_stage_stats_keep_the_latest_steps_only():
    stats, trainer = StageStatistics(num_stages=2), trainer_with(Logger(), 1)
    steps = 2 * STAGE_STATS_HISTORY + 3
    for step in range(steps):
        for stage in (0, 1):
            stats.record(stage, StepStats(step=step, wall=1.0), trainer)
    for stage in (0, 1):
        kept = [record.step for record in stats.records[stage]]
        assert kept == list(range(steps - STAGE_STATS_HISTORY, steps))
    assert stats.waiting_steps == 0


def test_stage_metrics_follow_log_every_n_steps():
    logger = Logger()
    stats, trainer = StageStatistics(num_stages=2), trainer_with(logger, 5)
    for step in range(20):
        for stage in (1, 0):
            stats.record(stage, StepStats(step=step, wall=1.0, forward=0.25, wait=0.5), trainer)
    # Lightning logs train/loss after steps 4, 9, 14, 19 (0-based) with log_every_n_steps=5; each stage once there.
    assert logger.steps == [4, 4, 9, 9, 14, 14, 19, 19]
    assert len(stats.records[0]) == 20 and stats.waiting_steps == 0
    # The mean bubble goes out with the record that completes a step, not before.
    assert "pipeline/bubble_fraction" not in logger.metrics[0]
    assert logger.metrics[1]["pipeline/bubble_fraction"] == StepStats(step=0, wall=1.0, wait=0.5).bubble_fraction
    assert logger.metrics[1]["pipeline/stage0/forward_sec"] == 0.25


def test_a_single_rank_reports_its_own_records():
    logger = Logger()
    stats, trainer = StageStatistics(num_stages=1), trainer_with(logger, 2)
    for step in range(3):
        stats.report(StepStats(step=step, wall=1.0), trainer)
    stats.report(None, trainer)  # a step without a record (evaluation) changes nothing
    stats.finish([StepStats(step=3, wall=1.0)], trainer)
    assert [r.step for r in stats.records[0]] == [0, 1, 2, 3]
    assert logger.steps == [1, 3]


def test_the_strategy_exposes_rank_zeros_records():
    strategy = AsyncPipelineStrategy(pipeline_parallel_size=2)
    assert strategy.stage_stats == {}
    stats = StageStatistics(num_stages=2)
    strategy._stage = SimpleNamespace(stats=stats)  # what the strategy reads of its placed PipelineStage
    stats.record(1, StepStats(step=0, wall=1.0), trainer_with(Logger(), 1))
    assert list(strategy.stage_stats) == [1]


def test_the_auxiliary_loss_is_summed_over_the_stages_that_have_one():
    logger = Logger()
    stats, trainer = StageStatistics(num_stages=3), trainer_with(logger, 1)
    for stage, aux in ((0, 0.5), (1, float("nan")), (2, 0.25)):
        stats.record(stage, StepStats(step=0, wall=1.0, aux_loss=aux), trainer)
    stats.record(0, StepStats(step=1, wall=1.0), trainer)  # no stage attached one: nothing logged
    stats.record(1, StepStats(step=1, wall=1.0), trainer)
    stats.record(2, StepStats(step=1, wall=1.0), trainer)
    assert [m.get("train/aux_loss") for m in logger.metrics] == [None, None, 0.75, None, None, None]
