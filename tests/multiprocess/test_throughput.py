"""Throughput and MFU logged by a 2-stage pipeline: the values exist in TensorBoard and the MFU relation holds."""

from __future__ import annotations

import json
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.fixtures.helpers import run_script
from tests.multiprocess.scripts.throughput_run import BATCH, BLOCK, EVERY, PEAK

pytestmark = pytest.mark.multiprocess


def test_two_stages_log_tokens_per_second_and_mfu(tmp_path):
    steps = 6
    command = [sys.executable, "-m", "tests.multiprocess.scripts.throughput_run", "--devices", "2"]
    command += ["--steps", str(steps), "--recompute", "--out", str(tmp_path)]
    returncode, output = run_script(command, timeout=300)
    assert returncode == 0, output[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    # Counted once per stage on rank 0; recomputation (activation_checkpointing) is not model FLOPs.
    assert len(result["stage_flops"]) == 2 and all(f > 0 for f in result["stage_flops"])
    assert result["flops_per_token"] == result["by_hand"]
    events = EventAccumulator(str(tmp_path / "tb" / "version_0"))
    events.Reload()
    logged = {tag: events.Scalars(tag) for tag in events.Tags()["scalars"]}
    expected_steps = list(range(EVERY - 1, steps, EVERY))
    for tag in ("tokens_per_sec", "tokens_per_sec_per_replica", "sec_per_step", "flops_per_sec", "mfu"):
        assert [e.step for e in logged[f"throughput/{tag}"]] == expected_steps, tag
    devices = 2  # P = 2 stages x D = 1 replica
    for tokens, seconds, mfu in zip(*(logged[f"throughput/{t}"] for t in ("tokens_per_sec", "sec_per_step", "mfu"))):
        # Not P times one process's rate: one replica's batch per step.
        assert tokens.value * seconds.value == pytest.approx(BATCH * BLOCK)
        assert mfu.value == pytest.approx(result["by_hand"] * tokens.value / (PEAK * devices), rel=0.01)
