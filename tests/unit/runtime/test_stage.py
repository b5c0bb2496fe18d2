"""The stage interpreter (:mod:`~lightning_async_pp.runtime.stage`): what it does around each action (profiler
labels, observers) and a runtime built for evaluation only. Its actions against the schedule and the deadlock
model: tests/unit/schedule/test_transfers.py; its exactness against one device: tests/multiprocess/."""

from __future__ import annotations

import pytest
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


def test_no_profiler_labels_while_no_profiler_records(monkeypatch):
    calls: list = []
    monkeypatch.setattr(torch.profiler, "record_function", lambda name: calls.append(name))
    middle_stage().run_step(0, torch.randn(6, 4))
    assert calls == []


def test_observers_see_every_action_with_its_host_times():
    seen: list = []
    runtime = middle_stage(observers=[lambda action, begin, end: seen.append(("init", str(action), begin, end))])
    handle = runtime.add_observer(lambda action, begin, end: seen.append(("added", str(action), begin, end)))
    runtime.run_step(0, torch.randn(6, 4))
    labels = [label for who, label, _, _ in seen if who == "init"]
    assert labels == [label for who, label, _, _ in seen if who == "added"]
    assert labels[:3] == ["1RF0", "1F0", "1SF0"] and "1F2" in labels
    assert all(begin <= end for _, _, begin, end in seen)
    handle.remove()
    seen.clear()
    runtime.run_step(1, torch.randn(6, 4))
    assert seen and {who for who, _, _, _ in seen} == {"init"}


def test_observers_registered_for_the_process():
    from lightning_async_pp.runtime import register_action_observer
    from lightning_async_pp.schedule import Op

    ops: list = []
    handle = register_action_observer(lambda action, begin, end: ops.append(action.op))
    try:
        middle_stage().run_step(0, torch.randn(6, 4))
    finally:
        handle.remove()
    assert {Op.RECV_F, Op.FORWARD, Op.SEND_F} <= set(ops)
    seen = len(ops)
    middle_stage().run_step(0, torch.randn(6, 4))
    assert len(ops) == seen


def test_evaluation_only_runtime_has_no_update_machinery():
    runtime = StageRuntime(
        kind="1f1b",
        stage=0,
        num_stages=1,
        num_microbatches=1,
        layers=[nn.Linear(4, 2)],
        optimizer=None,
        inputs_fn=lambda mb: mb,
        loss_fn=lambda out, mb: out.sum(),
        device=torch.device("cpu"),
    )
    assert runtime.updates is None
    assert runtime.evaluate(torch.ones(3, 4)).shape == (3, 2)
    with pytest.raises(RuntimeError, match="without an optimizer"):
        runtime.run_step(0, torch.ones(3, 4))
    runtime.drain()
    runtime.restore_version(2)
    assert runtime.newest_version == 2
