"""Smoke test of benchmarks/optimizer_ops.py at a tiny size (no timing assertions)."""

from __future__ import annotations

import json

import torch

from tests.fixtures.helpers import load_benchmark


def test_quick_writes_all_fields(tmp_path):
    bench = load_benchmark("optimizer_ops")
    threads = torch.get_num_threads()
    out = tmp_path / "optimizer_ops.json"
    try:
        returned = bench.main(["--quick", "--threads", "1", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    report = json.loads(out.read_text())
    assert report == json.loads(json.dumps(returned))
    assert (tmp_path / "optimizer_ops.md").read_text().count("\n| `") == len(bench.VARIANTS)

    ops = {name: result["operations"] for name, result in report["operations"].items()}
    assert set(ops) == set(bench.VARIANTS)
    # The batched step dispatches fewer operations than the per-matrix one, with or without the correction.
    for after, before in [("muon_matrices", "muon_matrices_per_matrix"), ("muon", "muon_per_matrix")]:
        assert 0 < ops[after] < ops[before]
    assert ops["muon_gpu_batches"] <= ops["muon"] and ops["muon_matrices_gpu_batches"] <= ops["muon_matrices"]
    assert report["measured"]["ops_correction_on_adamw"] == ops["adamw_corrected"] - ops["adamw"] > 0
    for name in bench.MUON_TIMED + bench.ADAMW_TIMED:
        assert report["times"][name]["rounds"] == 2 and report["times"][name]["median_ms"] > 0
    assert set(report["paired_ratios"]) == set(bench.PAIRS)
    assert set(report["targets_met"]) == set(report["targets"]) == set(report["measured"])
    assert "batched in 3 groups" in report["config"]["routing"]


def test_experts_counts_the_stacks_per_matrix_and_batched(tmp_path):
    bench = load_benchmark("optimizer_ops")
    out = tmp_path / "experts.json"
    arguments = ["--experts", "--layers", "2", "--experts-per-layer", "2", "--width", "16", "--out", str(out)]
    threads = torch.get_num_threads()
    try:
        report = json.loads(json.dumps(bench.main([*arguments, "--threads", "1"])))
    finally:
        torch.set_num_threads(threads)
    assert json.loads(out.read_text()) == report
    assert report["config"]["matrices"] == 2 * 2 * 3  # gate, up and down per expert
    ops = {name: result["operations"] for name, result in report["operations"].items()}
    assert set(ops) == set(bench.EXPERT_VARIANTS)
    assert 0 < ops["experts_gpu_batches"] <= ops["experts"] < ops["experts_per_matrix"]
