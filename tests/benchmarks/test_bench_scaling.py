"""Smoke test of benchmarks/scaling.py: the simulated table at small depths and the timeline picture."""

from __future__ import annotations

import json

import pytest

from lightning_async_pp.schedule.simulate import StageCosts, simulate
from tests.fixtures.helpers import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("scaling")


def test_table_matches_the_bubble_model(bench):
    rows = bench.scaling_table(stage_counts=(2, 4), multipliers=(1, 2), num_steps=6)
    assert [(r["num_stages"], r["num_microbatches"]) for r in rows] == [(2, 2), (2, 4), (4, 4), (4, 8)]
    for r in rows:
        P, M = r["num_stages"], r["num_microbatches"]
        assert r["2bw_vs_1f1b"] == pytest.approx((M + P - 1) / M)
        assert r["2bw_vs_gpipe"] == pytest.approx((M + P - 1) / M)
        assert r["bubble_fraction"]["1f1b"] == pytest.approx((P - 1) / (M + P - 1))
        assert r["bubble_fraction"]["2bw"] == pytest.approx(0.0, abs=1e-9)
        assert r["weight_versions"] == {"2bw": 2, "1f1b": 1, "gpipe": 1}
        assert r["peak_in_flight_microbatches"] == {"2bw": P, "1f1b": min(P, M), "gpipe": M}
    table = bench.format_table(rows)
    assert table.count("\n") == len(rows) + 1


def test_gpipe_schedule_runs_all_forwards_first(bench):
    sched = bench.gpipe_schedule(3, 4, 2)
    result = simulate(sched, StageCosts(1.0, 2.0))
    # One flushed GPipe step: (M + P - 1) forwards and as many backwards on the critical path.
    assert result.makespan == pytest.approx(2 * (4 + 3 - 1) * 3.0)
    first = [a.op.value for a in sched.stages[0][:9]]
    assert first == ["F"] * 4 + ["B"] * 4 + ["U"]


def test_main_writes_json(bench, tmp_path):
    out = tmp_path / "scaling.json"
    report = bench.main(["--stages", "2", "4", "--multipliers", "1", "--steps", "4", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert len(report["rows"]) == 2


def test_timeline_png_and_tensorboard(bench, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "timeline.png"
    bench.main(["--stages", "2", "--multipliers", "1", "--steps", "3", "--png", str(png)])
    assert png.stat().st_size > 0
    fig = bench.timeline_figure(num_stages=2, num_microbatches=2)
    image = bench.figure_to_array(fig)
    assert image.ndim == 3 and image.shape[2] == 3 and image.dtype.name == "uint8"
    tensorboard = pytest.importorskip("torch.utils.tensorboard")
    writer = tensorboard.SummaryWriter(str(tmp_path / "tb"))
    bench.log_timeline(writer, num_stages=2, num_microbatches=2)
    writer.close()
    assert any((tmp_path / "tb").iterdir())
