"""The plan-accuracy benchmark's step-time comparison and report, on a made-up emulated report (no runs)."""

from __future__ import annotations

import json

import pytest

from benchmarks import plan_accuracy


def cell(name: str, stages: int, microbatches: int, step_ms: float) -> dict:
    zeros = [0.0] * stages
    host = {"forward_per_microbatch": zeros, "backward_per_microbatch": zeros, "update_per_step": zeros}
    return {
        "name": name,
        "num_stages": stages,
        "num_microbatches": microbatches,
        "step_ms": step_ms,
        "host_ms_by_call": host,
    }


def test_step_times_follow_the_schedules_closed_forms(tmp_path):
    costs = {"forward": 0.001, "input": 0.001, "weight": 0.001}
    cells = [
        cell("ours_2bw", 2, 4, 15.0),
        cell("ours_1f1b", 2, 4, 15.0),
        cell("torch_1f1b", 2, 4, 1.0),
        cell("ours_2bw", 16, 16, 1.0),
    ]
    path = tmp_path / "emulated.json"
    path.write_text(json.dumps({"config": {"costs": costs}, "results": cells}))
    rows = plan_accuracy.time_rows(path)
    assert [(r["schedule"], r["P"]) for r in rows] == [("2bw", 2), ("1f1b", 2)]  # ours only, P <= 8
    two, one = rows
    assert two["predicted_ms"] == pytest.approx(4 * 3.0)  # M x (forward + backward): no bubble
    assert one["predicted_ms"] == pytest.approx((4 + 2 - 1) * 3.0)  # (M + P - 1) slots
    assert two["error"] == pytest.approx(12.0 / 15.0 - 1) and one["error"] == pytest.approx(0.0)
    report = {
        "memory_note": "n",
        "memory": [{"model": "gpt", "variant": "plain", "schedule": "2bw", "error": "x"}],
        "time": rows,
    }
    text = plan_accuracy.markdown(report)
    assert "| gpt | plain | 2bw | failed |" in text and "| 1f1b | 2 | 4 | 15.0 | 15.0 | +0.0% |" in text
