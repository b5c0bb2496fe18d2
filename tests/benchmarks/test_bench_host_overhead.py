"""Smoke test of benchmarks/host_overhead.py (no timing assertions): every piece is timed both ways and saved."""

from __future__ import annotations

import json

import torch

from tests.fixtures.helpers import load_benchmark


def test_every_piece_is_timed_before_and_after(tmp_path):
    bench = load_benchmark("host_overhead")
    threads = torch.get_num_threads()
    out = tmp_path / "result.json"
    try:
        returned = bench.main(["--rounds", "1", "--block-size", "16", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    saved = json.loads(out.read_text())
    assert saved["us_per_microbatch"] == returned["us_per_microbatch"]
    pieces = set(saved["us_per_microbatch"])
    assert pieces == {"version_swap", "data_order", "profiler_label", "action_label", "payload_spec", "layout_check"}
    for piece in saved["us_per_microbatch"].values():
        assert piece["before"] > 0 and piece["after"] >= 0
    total = saved["total_us_per_microbatch"]
    assert total["before"] == sum(p["before"] for p in saved["us_per_microbatch"].values())
