"""Step timings and the trace (:mod:`~lightning_async_pp.runtime.timing`), measured on a stage: a bounded trace
window, one record per step, wall time only, CUDA events reused."""

from __future__ import annotations

import math
import time

import torch

from tests.unit.runtime.test_stage import middle_stage


def test_trace_keeps_a_bounded_window_of_the_latest_actions():
    runtime = middle_stage(trace=True, trace_window=10)
    for step in range(4):
        runtime.run_step(step, torch.randn(6, 4))
    runtime.drain()
    assert len(runtime.events) == 10
    labels = [label for label, _, _ in runtime.events]
    assert labels[-1] == "1U3"  # the drain's update: the newest action is kept
    starts = [start for _, start, _ in runtime.events]
    assert starts == sorted(starts) and all(end >= start for _, start, end in runtime.events)


def test_cpu_stage_reports_each_step_at_once():
    runtime = middle_stage()
    for step in range(3):
        _, stats = runtime.run_step(step, torch.randn(6, 4))
        assert stats is not None and stats.step == step
        assert 0 < stats.forward + stats.backward + stats.wait <= stats.wall
    assert runtime.take_stats() == []


def test_step_timing_only_measures_the_wall_time():
    runtime = middle_stage(time_actions=False)
    for step in range(2):
        _, stats = runtime.run_step(step, torch.randn(6, 4))
        assert stats is not None and stats.step == step and stats.wall > 0
        assert all(math.isnan(v) for v in (stats.forward, stats.backward, stats.wait, stats.update))
    traced = middle_stage(time_actions=False, trace=True)  # a trace times its actions regardless
    _, stats = traced.run_step(0, torch.randn(6, 4))
    assert traced.events and 0 < stats.forward + stats.backward + stats.wait <= stats.wall


class FakeEvent:
    """Stands in for ``torch.cuda.Event``: counts how many were created."""

    created = 0

    def __init__(self, enable_timing: bool = False) -> None:
        FakeEvent.created += 1
        self.at = None

    def record(self) -> None:
        self.at = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: FakeEvent) -> float:
        return (end.at - self.at) * 1e3


def test_cuda_timing_events_are_reused(monkeypatch):
    from lightning_async_pp.runtime.timing import StepTimer
    from lightning_async_pp.schedule import Action

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    timer = StepTimer(torch.device("cuda"), trace=True)
    actions = [Action.from_str(label, 2, kind="2bw") for label in ("0F0", "0SF0", "0F1")]
    created = []
    for step in range(6):
        timer.begin_step(step)
        for action in actions:
            timer.record(action, timer.clock.mark(), timer.clock.mark())
        timer.end_step(0)
        created.append(FakeEvent.created)
    timer.take()
    # Steps keep at most `wait_beyond` = 2 records unread; after that no step creates an event.
    assert created[3] == created[5], created
    assert len(timer.events) == 3 * 6
    assert all(end >= start for _, start, end in timer.events)
