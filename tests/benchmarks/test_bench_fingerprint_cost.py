"""Smoke test of benchmarks/fingerprint_cost.py at tiny sizes (no timing assertions)."""

from __future__ import annotations

import json

import torch

from tests.fixtures.helpers import load_benchmark


def test_writes_all_fields(tmp_path):
    bench = load_benchmark("fingerprint_cost")
    threads = torch.get_num_threads()
    out = tmp_path / "result.json"
    try:
        returned = bench.main(
            [
                "--rounds",
                "2",
                "--warmup",
                "1",
                "--batch-size",
                "4",
                "--block-size",
                "8",
                "--microbatches",
                "2",
                "--n-layer",
                "2",
                "--n-embd",
                "16",
                "--image-batch",
                "1",
                "--out",
                str(out),
            ]
        )
    finally:
        torch.set_num_threads(threads)
    report = json.loads(out.read_text())
    assert report == json.loads(json.dumps(returned))
    assert report["microbatch_shapes"] == [[2, 8], [2, 8]]
    assert report["fingerprint_per_step_ms"] > 0 and report["stage_step_ms"] > 0
    assert 0 < report["fingerprint_share_of_stage_step"]
