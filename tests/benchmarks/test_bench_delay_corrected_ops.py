"""Smoke test of benchmarks/delay_corrected_ops.py at tiny sizes (no timing assertions)."""

from __future__ import annotations

import json

import torch

from tests.fixtures.helpers import load_benchmark


def test_counts_and_times_every_variant(tmp_path):
    bench = load_benchmark("delay_corrected_ops")
    threads = torch.get_num_threads()
    out = tmp_path / "result.json"
    try:
        returned = bench.main(
            ["--blocks", "1", "--width", "8", "--ops-width", "8", "--rounds", "2", "--warmup", "1", "--out", str(out)]
        )
    finally:
        torch.set_num_threads(threads)
    report = json.loads(out.read_text())
    assert report == json.loads(json.dumps(returned))
    assert set(report["ops"]) == set(report["time"]) == {"adamw", "corrected", "corrected_auto"}
    adamw = report["ops"]["adamw"]["total"]
    for name, ops in report["ops"].items():
        assert ops["added"] == ops["total"] - adamw == sum(ops["added_by_op"].values())
        assert report["time"][name]["median_ms"] > 0
    # The fixed correction: its snapshot and three more multi-tensor ops, and the wrapper's profiler range.
    assert report["ops"]["corrected"]["added_by_op"]["aten._foreach_sub_.List"] == 2
    assert set(report["targets_met"]) == {"corrected", "corrected_auto"}
    assert "| corrected_auto |" in out.with_suffix(".md").read_text()
