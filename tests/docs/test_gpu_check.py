"""scripts/gpu_check.py --cpu: the GPU machine's first-run checks, on CPU, so the script cannot rot."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.fixtures.helpers import ROOT, run_group

pytestmark = pytest.mark.multiprocess


@pytest.mark.slow
def test_gpu_check_cpu_mode_passes_and_reports_every_check(tmp_path):
    out = tmp_path / "check.json"
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    done = run_group(
        [sys.executable, ROOT / "scripts" / "gpu_check.py", "--cpu", "--out", out], 1200, cwd=ROOT, env=env
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    report = json.loads(out.read_text())
    rows = report["results"]
    checks = {row["check"] for row in rows}
    assert checks == {"exactness", "deadlock_probe", "throughput"}, checks
    assert report["ok"] and all(row["ok"] for row in rows)
    exact = [row for row in rows if row["check"] == "exactness"]
    assert {row["schedule"] for row in exact} == {"2bw", "1f1b"}
    assert all(row["max_rel_loss_diff"] <= 1e-5 and row["weight_error_over_tolerance"] <= 1 for row in exact)
    probes = [row for row in rows if row["check"] == "deadlock_probe"]
    assert {(row["stages"], row["schedule"]) for row in probes} == {(2, "2bw"), (3, "2bw"), (3, "1f1b")}
    speed = [row for row in rows if row["check"] == "throughput"]
    assert {(row["variant"], row["microbatches"]) for row in speed} == {
        (v, m) for v in ("async_pp_2bw", "torch_1f1b") for m in (2, 4, 8)
    }
    assert all(row["tokens_per_sec"] > 0 and len(row["bubble_fraction"]) == 2 for row in speed)
    assert "exactness" in done.stdout and "throughput" in done.stdout  # the printed table
