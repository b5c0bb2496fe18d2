"""Smoke test of benchmarks/evaluation.py at tiny sizes (no timing assertions): both ways give the same outputs."""

from __future__ import annotations

import json

import pytest

from tests.fixtures.helpers import load_benchmark


@pytest.mark.multiprocess  # starts two ranks
@pytest.mark.parametrize("model", ["gpt", "emulated"])
def test_writes_all_fields(tmp_path, model):
    bench = load_benchmark("evaluation")
    out = tmp_path / "result.json"
    returned = bench.main(["--quick", "--model", model, "--out", str(out)])
    report = json.loads(out.read_text())
    assert report == json.loads(json.dumps(returned))
    assert report["config"]["microbatches"] == 4 and report["config"]["quick"]
    for pattern in ("stream", "isolated"):
        assert set(report[pattern]["batches_per_second"]) == {"whole", "microbatched"}
        assert all(value > 0 for value in report[pattern]["batches_per_second"].values())
        assert report[pattern]["speedup"] > 0
        assert all(len(seconds) == 2 for seconds in report["block_seconds"][pattern].values())
    # Per-sample layers: the micro-batches' outputs joined are the whole batch's output.
    assert report["max_abs_difference"] < 1e-5
