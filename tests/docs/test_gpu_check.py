"""scripts/gpu_check.py: which checks fit which machine, --only/--skip, the report written row by row (default
tier), and --cpu end to end without jsonargparse, as on a GPU machine's image, so the script cannot rot (slow
tier)."""

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
SINGLE = {"one_device", "no_sync", "plain", "runtime", "runtime_compiled", "lightning", "mfu", "optimizers", "memory"}


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


def test_only_and_skip_select_by_name_or_first_word(gpu_check):
    checks, _ = gpu_check.plan(4, False, 1e-3, gpu_check.GPU_MODEL, 1)
    names = lambda only, skip: [c.name for c in gpu_check.select(checks, only, skip)]  # noqa: E731
    assert names(["plain", "memory"], None) == ["plain", "memory"]  # in the plan's order
    exact = [c.name for c in checks if c.name.startswith("exactness ")]
    assert len(exact) == 8 and names(["exactness"], None) == exact
    assert names(["exactness"], ["exactness P2 resumed"]) == [n for n in exact if n != "exactness P2 resumed"]
    assert names(None, ["runtime_compiled"]) == [c.name for c in checks if c.name != "runtime_compiled"]
    with pytest.raises(SystemExit, match=r"Unknown check\(s\) \['runtime_compile'\]; the checks are: one_device"):
        gpu_check.select(checks, None, ["runtime_compile"])


def test_the_report_is_whole_json_after_every_row_and_a_failed_check_does_not_stop_the_next(gpu_check, tmp_path):
    out = tmp_path / "report.json"
    report = gpu_check.Report(out, {"device": "test"})
    seen = []

    def rows():
        for i in range(2):
            yield {"check": "first", "i": i, "ok": True}
            seen.append(json.loads(out.read_text()))  # read while the check still runs
        raise RuntimeError("broken after two rows")

    gpu_check.run_check(gpu_check.Planned("first", 1, rows), report)
    gpu_check.run_check(gpu_check.Planned("second", 1, lambda: iter([{"check": "second", "ok": True}])), report)
    assert [[r["i"] for r in s["results"]] for s in seen] == [[0], [0, 1]]
    assert all(not s["finished"] and s["ok"] and s["device"] == "test" for s in seen)
    final = json.loads(out.read_text())
    assert [r["check"] for r in final["results"]] == ["first", "first", "first", "second"]
    assert not final["ok"] and "broken after two rows" in final["results"][2]["error"]
    report.write(finished=True)
    assert json.loads(out.read_text())["finished"] and list(tmp_path.iterdir()) == [out]


# The GPU machines' image has no jsonargparse: Lightning's CLI module then skips it, and any import of it fails.
WITHOUT_JSONARGPARSE = """
import runpy, sys
from lightning_utilities.core.imports import RequirementCache
available = RequirementCache.__bool__
RequirementCache.__bool__ = lambda self: "jsonargparse" not in str(self.requirement) and available(self)
sys.modules["jsonargparse"] = None
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.multiprocess
@pytest.mark.slow
def test_gpu_check_cpu_mode_passes_and_reports_every_check(gpu_check, tmp_path):
    out = tmp_path / "check.json"
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    script = ROOT / "scripts" / "gpu_check.py"
    # Every one-device check, and one pipeline job (the several-device checks' machinery; their cases are the
    # multiprocess tier's own tests).
    only = ["--only", *sorted(SINGLE), "exactness P2 2bw"]
    command = [sys.executable, "-c", WITHOUT_JSONARGPARSE, script, "--cpu", "--devices", "2", "--out", out, *only]
    done = run_group(command, 600, cwd=ROOT, env=env)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    report = json.loads(out.read_text())
    rows = report["results"]
    assert report["finished"] and report["ok"] and all(row["ok"] for row in rows)
    assert report["checks"] == [*gpu_check.ONE_DEVICE, "exactness P2 2bw"]
    by_check = {}
    for row in rows:
        by_check.setdefault(row["check"], []).append(row)
    assert set(by_check) == SINGLE | {"bf16", "exactness"}
    assert by_check["exactness"][0]["weight_error_over_tolerance"] <= 1
    assert by_check["no_sync"][0]["syncs_per_step"] == [0] * 4
    assert [r["microbatches"] for r in by_check["plain"]] == [1, 2, 4]
    for check in ("runtime", "runtime_compiled"):
        assert [r["schedule"] for r in by_check[check]] == ["2bw", "1f1b"]
        assert all(r["tokens_per_sec"] > 0 for r in by_check[check])
    assert all(r["vs_plain_microbatched"] > 0 and r["syncs_per_step"] == 0 for r in by_check["runtime"])
    compiled = by_check["runtime_compiled"]
    assert all(r["vs_eager"] > 0 and r["eager_tokens_per_sec"] > 0 for r in compiled)
    # Both weight versions and both schedules run one graph: nothing compiles once the blocks are traced.
    first = compiled[0]["dynamo_after_warmup"]
    assert first["unique_graphs"] >= 1 and all(r["dynamo_at_end"] == first for r in compiled)
    assert first["recompiles"] == first["graph_breaks"] == 0
    assert [r["case"] for r in by_check["lightning"]] == ["plain Lightning", "async_pp 1f1b M=1"]
    (mfu,) = by_check["mfu"]
    assert mfu["flops_ratio"] == pytest.approx(1, rel=0.02) and mfu["logged_mfu"] > 0
    names = {r["optimizer"] for r in by_check["optimizers"]}
    assert {"AdamW fused", "Muon", "DelayCorrected(AdamW foreach)", "DelayCorrected(Muon)"} <= names
    assert [r["microbatches"] for r in by_check["memory"]] == [4, 8]
    assert "running: mfu" in done.stdout and "all checks passed" in done.stdout
