"""Smoke test of benchmarks/index_read.py at a tiny size (no timing assertions)."""

from __future__ import annotations

import json

from tests.fixtures.helpers import load_benchmark


def test_writes_all_fields(tmp_path):
    bench = load_benchmark("index_read")
    out = tmp_path / "result.json"
    returned = bench.main(["--entries", "20", "--rounds", "2", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report == json.loads(json.dumps(returned))
    assert report["entries"] == 20 and report["index_bytes"] > 0
    assert report["read_index_median_s"] > 0 and report["pickle_loads_median_s"] > 0
