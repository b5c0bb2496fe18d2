"""The conformance runner's bookkeeping: the list of differences and the selection it counts."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("conformance_run", Path(__file__).with_name("run.py"))
run = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run)

NODE = "suite/trainer/test_trainer.py::test_fit"


def record(nodeid: str, outcome: str, exercised: bool = True, pipeline: bool = False) -> dict:
    return {"nodeid": nodeid, "outcome": outcome, "exercised": exercised, "pipeline": pipeline, "message": "E: x"}


def test_a_listed_reason_covers_the_test_its_parameters_and_a_file(tmp_path):
    path = tmp_path / "differences.txt"
    path.write_text(f"# comment\nasync_pp {NODE} -- why\nboth suite/a.py -- file\n")
    differences = run.read_differences(path)
    assert run.reason_for(NODE, "async_pp", differences) == "why"
    assert run.reason_for(NODE + "[1-2]", "async_pp", differences) == "why"
    assert run.reason_for(NODE + "_other", "async_pp", differences) is None
    assert run.reason_for(NODE, "microbatches", differences) is None
    assert run.reason_for("suite/a.py::test_b", "microbatches", differences) == "file"
    path.write_text(f"sometimes {NODE} -- why\n")
    with pytest.raises(ValueError, match="a line must read"):
        run.read_differences(path)


def test_the_selection_passes_as_is_and_exercises_the_strategy():
    records = {
        n: r
        for n, r in (
            ("a", record("a", "passed")),
            ("b", record("b", "failed")),
            ("c", record("c", "failed", exercised=False)),  # not run under the strategy
            ("d", record("d", "failed")),  # fails as it is too
        )
    }
    baseline = {n: record(n, "failed" if n == "d" else "passed", exercised=False) for n in records}
    summary = run.summarise("async_pp", records, baseline, [("async_pp", "b", "known")])
    assert (summary["selected"], summary["passed"]) == (2, 1)
    assert summary["listed"] == {"b": "known"} and summary["unexplained"] == {}
    # With two micro-batches only pipeline modules count.
    summary = run.summarise("microbatches", records, baseline, [])
    assert summary["selected"] == 0 and summary["refused_plain_modules"] == ["a", "b", "d"]
