"""scripts/gpu_check.py: which checks fit which machine (default tier), and --cpu end to end, so the script cannot
rot (slow tier)."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.fixtures.helpers import ROOT, load_module, run_group

MULTI = {
    "exactness P2 2bw",
    "exactness P2 1f1b",
    "exactness P3 2bw (middle stage)",
    "exactness P2 clipping",
    "exactness P2 tied weights",
    "exactness P2 bf16-mixed",
    "exactness P2 resumed",
    "exactness P2 x D2",
    "deadlock_probe",
    "failure (P=3, middle stage killed)",
    "throughput",
}
SINGLE = {"one_device + bf16", "no_sync", "overhead"}


@pytest.fixture(scope="module")
def gpu_check():
    return load_module(ROOT / "scripts" / "gpu_check.py", "gpu_check")


@pytest.mark.parametrize("count", [1, 2, 3, 4, 8])
def test_the_plan_runs_what_the_gpus_allow_and_names_the_rest(gpu_check, count):
    checks, skipped = gpu_check.plan(count, False, 1e-3, gpu_check.GPU_MODEL, 1)
    names = {c.name for c in checks}
    assert names | {s["check"] for s in skipped} == SINGLE | MULTI and not names & {s["check"] for s in skipped}
    assert SINGLE <= names and all(c.devices <= count for c in checks)
    for row in skipped:
        assert row["needs"] > count and f"needs {row['needs']} GPUs, {count} available" in row["reason"]
        assert "NCCL cannot put two ranks on one GPU" in row["reason"]
    if count == 1:
        assert names == SINGLE
    if count >= 4:
        assert not skipped


def test_the_cpu_plan_skips_only_what_needs_more_processes(gpu_check):
    checks, skipped = gpu_check.plan(3, True, 1e-5, gpu_check.CPU_MODEL, 1)
    assert [s["check"] for s in skipped] == ["exactness P2 x D2"]
    assert "--devices" in skipped[0]["reason"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_gpu_check_cpu_mode_passes_and_reports_every_check(tmp_path):
    out = tmp_path / "check.json"
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    done = run_group(
        [sys.executable, ROOT / "scripts" / "gpu_check.py", "--cpu", "--out", out], 2400, cwd=ROOT, env=env
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    report = json.loads(out.read_text())
    rows = report["results"]
    checks = {row["check"] for row in rows}
    assert checks == {
        "one_device",
        "bf16",
        "no_sync",
        "overhead",
        "exactness",
        "deadlock_probe",
        "failure",
        "throughput",
    }
    assert report["ok"] and all(row["ok"] for row in rows)
    assert [s["check"] for s in report["skipped"]] == ["exactness P2 x D2"]
    exact = [row for row in rows if row["check"] == "exactness"]
    assert len(exact) == 7 and all(row["weight_error_over_tolerance"] <= 1 for row in exact)
    probes = [row for row in rows if row["check"] == "deadlock_probe"]
    assert {(row["stages"], row["schedule"]) for row in probes} == {(2, "2bw"), (3, "2bw"), (3, "1f1b")}
    speed = [row for row in rows if row["check"] == "throughput"]
    assert {(row["variant"], row["microbatches"]) for row in speed} == {
        (v, m) for v in ("async_pp_2bw", "torch_1f1b") for m in (2, 4, 8)
    }
    assert all(row["tokens_per_sec"] > 0 and len(row["bubble_fraction"]) == 2 for row in speed)
    assert next(row for row in rows if row["check"] == "no_sync")["syncs_per_step"] == [0] * 4
    assert "exactness" in done.stdout and "skipped" in done.stdout  # the printed table
