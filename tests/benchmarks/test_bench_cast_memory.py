"""Smoke test of benchmarks/cast_memory.py: ``--quick`` end to end at one pipeline size (no timing assertions)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.fixtures.helpers import ROOT


@pytest.mark.slow
@pytest.mark.multiprocess
def test_quick_run_writes_every_row(tmp_path):
    out = tmp_path / "cast_memory.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "cast_memory.py"), "--quick", "--stages", "2"]
    done = subprocess.run([*command, "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(r["setting"], r["stage"]) for r in rows} >= {
        ("one_device", 0),
        ("pipeline_2bw_P2", 0),
        ("pipeline_2bw_P2", 1),
    }
    assert all(r["same_weights"] for r in rows)  # both ways trained the same weights
    one_device = {r["microbatches"]: r for r in rows if r["setting"] == "one_device"}
    most = one_device[max(one_device)]
    assert most["per_version_compute_mib"] < most["per_microbatch_compute_mib"]  # the casts are shared
    assert (out.with_suffix(".md")).exists()
