"""Smoke test of benchmarks/sharded_state.py: the bookkeeping on made-up jobs, and ``--quick`` end to end per
optimizer (no timing assertions)."""

from __future__ import annotations

import json

import pytest

from tests.fixtures.helpers import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("sharded_state")


def _job(optimizer, shard, repeat, state_bytes, step_s):
    stages = {
        str(stage): {
            "ranks": [2 * (1 - stage), 2 * (1 - stage) + 1],
            "state_bytes": list(state_bytes),
            "largest_tensor_state_bytes": 30,
            "tensors_stepped": [3, 3],
            "step_s": step_s,
        }
        for stage in range(2)
    }
    return {"optimizer": optimizer, "shard": shard, "repeat": repeat, "stages": stages}


def test_rows_from_made_up_jobs(bench):
    jobs = [
        _job("adamw", False, 0, (100, 100), 1.0),
        _job("adamw", True, 0, (60, 40), 1.5),
        _job("adamw", True, 1, (60, 40), 2.0),
        _job("adamw", False, 1, (100, 100), 4.0),
    ]
    rows = bench.aggregate(jobs, ["adamw"])
    assert [(r["optimizer"], r["stage"]) for r in rows] == [("adamw", 0), ("adamw", 1)]
    row = rows[0]
    assert (row["replicated_bytes"], row["sharded_max_bytes"], row["sharded_min_bytes"]) == (100, 60, 40)
    assert row["max_over_replicated"] == pytest.approx(0.6)
    assert row["step_s_unsharded"] == pytest.approx(2.5) and row["step_s_sharded"] == pytest.approx(1.75)
    assert row["step_ratio"] == pytest.approx(1.75 / 2.5)
    assert row["step_ratio_paired"] == pytest.approx((1.5 + 0.5) / 2)  # repetition by repetition
    report = {"machine": {"torch": "2", "cores": 2, "cpu": "x"}, "rows": rows}
    report["config"] = dict(P=2, D=2, layers=1, width=8, heads=1, parameters=1000, batch_size=2, seq=4)
    report["config"].update(microbatches=2, warmup=1, steps=2, repeats=2, ns_dtype="float32")
    table = bench.markdown(report)
    assert table.count("\n| adamw |") == 2 and "| 100 | 60 | 40 | 0.600 |" in table


@pytest.mark.multiprocess  # starts 2 jobs of 4 ranks
@pytest.mark.parametrize(
    "optimizer", ["muon"]
)  # the full benchmark runs the others; state checks are in tests/multiprocess
def test_quick_writes_all_fields(bench, tmp_path, optimizer):
    out = tmp_path / "sharded_state.json"
    returned = bench.main(["--quick", "--optimizers", optimizer, "--out", str(out)])
    report = json.loads(out.read_text())
    assert report == json.loads(json.dumps(returned))
    assert (tmp_path / "sharded_state.md").read_text().count(f"| {optimizer} |") == 2
    assert report["config"]["quick"] and report["config"]["P"] == 2 and report["config"]["D"] == 2
    assert len(report["jobs"]) == 2 and {j["shard"] for j in report["jobs"]} == {False, True}
    assert [(r["optimizer"], r["stage"]) for r in report["rows"]] == [(optimizer, 0), (optimizer, 1)]
    for row in report["rows"]:
        # Each replica holds part of the stage's state; together what each replica held (up to the per-tensor
        # step counts, a few bytes each).
        assert 0 < row["sharded_min_bytes"] <= row["sharded_max_bytes"] < row["replicated_bytes"]
        assert abs(row["sharded_max_bytes"] + row["sharded_min_bytes"] - row["replicated_bytes"]) <= 64 * 2
        assert 0 < row["largest_tensor_state_bytes"] < row["replicated_bytes"]
        assert row["step_s_unsharded"] > 0 and row["step_s_sharded"] > 0 and row["step_ratio"] > 0
    for job in report["jobs"]:
        for stage in job["stages"].values():
            stepped = stage["tensors_stepped"]
            assert len(stepped) == 2 and (all(n > 0 for n in stepped) if job["shard"] else stepped[0] == stepped[1])
