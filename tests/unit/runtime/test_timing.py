"""Step timings and the trace: profiler annotations, a bounded trace window, one record per step."""

from __future__ import annotations

import torch
from torch import nn

from lightning_async_pp.runtime.stage import StageRuntime
from tests.unit.schedule.test_transfers import RecordingChannel


def middle_stage(**kwargs) -> StageRuntime:
    layer = nn.Linear(4, 4)
    runtime = StageRuntime(
        kind="2bw",
        stage=1,
        num_stages=3,
        num_microbatches=3,
        layers=[layer],
        optimizer=torch.optim.SGD(layer.parameters(), lr=0.1),
        inputs_fn=lambda mb: mb,
        loss_fn=lambda out, mb: out.sum(),
        device=torch.device("cpu"),
        prev_rank=0,
        next_rank=2,
        check_data_order=False,
        **kwargs,
    )
    log: list = []
    runtime.prev, runtime.next = RecordingChannel("prev", log, (2, 4)), RecordingChannel("next", log, (2, 4))
    return runtime


def test_actions_are_annotated_for_the_profiler():
    runtime = middle_stage()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        runtime.run_step(0, torch.randn(6, 4))
    names = {event.name for event in prof.events()}
    for expected in ("pipeline 1RF0", "pipeline 1F0", "pipeline 1SF0", "pipeline 1F2"):
        assert expected in names, sorted(n for n in names if n.startswith("pipeline"))


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
