"""Smoke test of benchmarks/throughput.py at tiny sizes (no timing assertions).

The default suite checks the bookkeeping on made-up records and runs one real (single-process) job; the
multi-process variants run end to end in the slow test.
"""

from __future__ import annotations

import json

import pytest

from tests.fixtures.helpers import load_benchmark

TINY = [
    "--width",
    "16",
    "--layers",
    "2",
    "--heads",
    "2",
    "--seq",
    "8",
    "--batch-size",
    "4",
    "--warmup",
    "1",
    "--steps",
    "2",
]


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("throughput")


def test_defaults_and_quick(bench):
    full, quick = bench.parse_args([]), bench.parse_args(["--quick"])
    assert (full.repeats, full.warmup, full.steps, full.with_corrected) == (5, 5, 20, True)
    assert (quick.repeats, quick.warmup, quick.steps, quick.with_corrected) == (2, 3, 10, False)
    assert bench.configurations(quick) == [(2, 4)]
    assert bench.configurations(full) == [(p, m) for p in (2, 4) for m in (2, 4, 8)]


def test_variants_that_cannot_run_are_named(bench):
    args = bench.parse_args(["--no-with-corrected"])
    names, skipped = bench.variants_for(4, 2, args)
    assert "async_pp_2bw" in skipped and "torch_1f1b" in skipped
    assert names == ["async_pp_1f1b", "torch_gpipe", "single_process"]
    names, skipped = bench.variants_for(2, 4, bench.parse_args([]))
    assert not skipped and set(bench.PIPELINE_VARIANTS) <= set(names)
    assert bench.CORRECTED_VARIANT in names


def _records(with_stats: bool):
    ends = [0.1 * (i + 1) for i in range(4)]  # warm-up 1, timed 2: window = ends[2] - ends[0] = 0.2 s
    records = []
    for rank, stage in ((0, 1), (1, 0)):
        record = {"rank": rank, "stage": stage, "ends": ends, "peak_rss_mb": 100.0 + stage, "stage_weight_mb": 1.0}
        if not with_stats:
            record["busy"] = [0.05] * 4
        records.append(record)
    if with_stats:
        step = {"wall": 0.09, "forward": 0.02, "backward": 0.04, "wait": 0.01, "update": 0.01, "version_lag": 1}
        records[0]["stage_stats"] = {str(s): [dict(step, step=t) for t in range(4)] for s in (0, 1)}
    return records


@pytest.mark.parametrize("with_stats", [True, False], ids=["engine_stats", "timed_calls"])
def test_summarize_job(bench, with_stats):
    args = bench.parse_args(TINY + ["--steps", "2"])
    measured = bench.summarize_job("x", _records(with_stats), args, num_microbatches=2)
    assert measured["tokens_per_sec"] == pytest.approx(4 * 8 * 2 / 0.2)
    assert [s["stage"] for s in measured["stages"]] == [0, 1]
    busy = 2 * (0.07 if with_stats else 0.05)
    for s in measured["stages"]:
        assert s["busy_s"] == pytest.approx(busy)
        assert s["bubble_fraction"] == pytest.approx(1 - busy / 0.2)
    if with_stats:
        assert measured["stages"][0]["forward_s_per_mb"] == pytest.approx(0.01)
        assert bench.simulate_job("async_pp_2bw", measured, 2, 2, args, transfer=0.0) > 0


def test_transfer_latency_from_trace(bench, tmp_path):
    events = [
        {"name": "0SF4", "ph": "X", "tid": 0, "ts": 1000.0, "dur": 10.0},
        {"name": "1RF4", "ph": "X", "tid": 1, "ts": 900.0, "dur": 600.0},  # waited: latency 0.5 ms
        {"name": "1SB3", "ph": "X", "tid": 1, "ts": 2000.0, "dur": 10.0},
        {"name": "0RB3", "ph": "X", "tid": 0, "ts": 2500.0, "dur": 1.0},  # posted after the send: not counted
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    assert bench.trace_transfer_seconds(path) == pytest.approx(0.5e-3)


def test_report_from_made_up_runs(bench):
    args = bench.parse_args(TINY + ["--no-simulate"])
    raw = {}
    for rep in range(2):
        for name, speed in (("async_pp_2bw", 1.3), ("async_pp_1f1b", 1.0), ("torch_1f1b", 1.0)):
            records = _records(with_stats=name.startswith("async"))
            measured = bench.summarize_job(name, records, args, 4)
            measured["tokens_per_sec"] *= speed
            raw.setdefault((name, 2, 4), []).append(dict(measured, rep=rep))
        raw.setdefault((bench.OVERHEAD_JOB, 1, 1), []).append(
            {"rep": rep, "tokens_per_sec": {"p1_async_pp_1f1b": [99.0, 99.0], "p1_lightning": [100.0, 100.0]}}
        )
    results = bench.aggregate(raw, args)
    names = {r["name"] for r in results}
    assert {"async_pp_2bw", "torch_1f1b", "p1_lightning", "p1_async_pp_1f1b"} <= names
    for r in results:
        assert {"name", "tokens_per_sec"} <= set(r)
        if r["num_stages"] > 1:
            assert len(r["peak_rss_mb"]) == len(r["bubble_fraction"]) == 2
    report = {
        "config": {
            "model": {"width": 16, "blocks": 2, "seq": 8},
            "batch_size": 4,
            "warmup_steps": 1,
            "timed_steps": 2,
            "repeats": 2,
        },
        "machine": {"before": {"cpu": "x", "cores": 2, "loadavg": None}, "after": {"loadavg": None}},
        "oversubscribed_stage_counts": [4],
        "skipped": {},
        "results": results,
        "ratios_vs_torch_1f1b": bench.ratios(results, raw),
        "errors": [],
        "seconds": 1.0,
    }
    report["targets"] = bench.check_targets(report)
    assert report["targets"]["async_pp_2bw_vs_torch_1f1b"]["value"] == pytest.approx(1.3)
    assert report["targets"]["async_pp_2bw_vs_torch_1f1b"]["met"]
    assert report["targets"]["p1_overhead"]["met"]
    text = bench.format_report(report)
    assert "oversubscribes" in text and "async_pp_2bw" in text and "P=1 overhead" in text
    markdown = bench.markdown_report(report)
    assert "| 2 | 4 | `async_pp_2bw` |" in markdown and "| 2 | 4 | `torch_1f1b` |" in markdown


def test_one_real_job(bench, tmp_path):
    args = bench.parse_args(TINY)
    measured = bench.run_job("single_process", 1, 1, args, [], tmp_path, timeout=120)
    assert "error" not in measured, measured.get("error")
    assert measured["tokens_per_sec"] > 0 and measured["stages"][0]["peak_rss_mb"] > 0


@pytest.mark.slow
def test_quick_run_of_every_variant(bench, tmp_path):
    out = tmp_path / "throughput.json"
    argv = [
        *TINY,
        "--repeats",
        "1",
        "--stage-counts",
        "2",
        "--microbatch-counts",
        "2",
        "--with-corrected",
        "--out",
        str(out),
        "--timeout",
        "240",
    ]
    report = bench.main(argv)
    assert json.loads(out.read_text())["results"] == json.loads(json.dumps(report["results"]))
    assert not report["errors"], report["errors"]
    names = {r["name"] for r in report["results"]}
    assert set(bench.PIPELINE_VARIANTS) | {bench.CORRECTED_VARIANT} | set(bench.OVERHEAD_VARIANTS) <= names
    for r in report["results"]:
        if r["num_stages"] == 2 and r["name"] != "single_process":
            assert len(r["peak_rss_mb"]) == 2 and r["tokens_per_sec"] > 0
    assert {s["name"] for s in report["simulator"]} == {"async_pp_2bw", "async_pp_1f1b", bench.CORRECTED_VARIANT}


# --- the simulator features the benchmark feeds with measured numbers ---------------------------------------


def test_step_overhead_adds_host_time_per_step():
    from lightning_async_pp.schedule import build_schedule
    from lightning_async_pp.schedule.simulate import StageCosts, simulate

    costs = StageCosts(forward=1.0, backward=2.0)
    single = simulate(build_schedule("1f1b", 1, 4, 5), costs, step_overhead=0.5)
    assert single.makespan == pytest.approx(5 * (4 * 3.0 + 0.5))
    # A flushed 1F1B step: the stages start their share of a step one after the other, each after its overhead.
    flushed = simulate(build_schedule("1f1b", 3, 4, 6), costs, step_overhead=0.5)
    assert flushed.makespan == pytest.approx(6 * ((4 + 3 - 1) * 3.0 + 0.5))
    with pytest.raises(ValueError, match="step_overhead"):
        simulate(build_schedule("1f1b", 3, 4, 1), costs, step_overhead=[0.1, 0.2])


def test_step_sync_costs_2bw_but_not_1f1b():
    from lightning_async_pp.schedule import build_schedule
    from lightning_async_pp.schedule.simulate import StageCosts, simulate

    costs = StageCosts(forward=1.0, backward=2.0, update=0.5)
    for P, M in ((2, 4), (4, 4), (3, 6)):
        flushed = [simulate(build_schedule("1f1b", P, M, 8), costs, 0.1, 0.2, step_sync=sync) for sync in (False, True)]
        assert flushed[0].makespan == pytest.approx(flushed[1].makespan)  # already synchronous every step
        free, synced = (simulate(build_schedule("2bw", P, M, 8), costs, 0.1, 0.2, step_sync=s) for s in (False, True))
        assert free.steady_throughput > synced.steady_throughput >= flushed[0].steady_throughput
        assert max(free.steady_bubble_fraction) < max(synced.steady_bubble_fraction)


def test_replay_of_a_trace_gives_back_its_run(bench, tmp_path):
    """A trace written from a simulated run replays to that run's tokens/s; a slower action in it, to less."""
    from lightning_async_pp.schedule import Op, build_schedule
    from lightning_async_pp.schedule.simulate import StageCosts, simulate

    args = bench.parse_args(TINY + ["--warmup", "2", "--steps", "3"])  # batch 4 x seq 8
    P, M = 2, 2
    run = simulate(
        build_schedule("2bw", P, M, 5), [StageCosts(0.01, 0.02, 0.005), StageCosts(0.012, 0.025, 0.004)], transfer=0.001
    )
    events = [
        {"name": str(ev.action), "ph": "X", "tid": s, "ts": 1e6 * ev.start, "dur": 1e6 * (ev.end - ev.start)}
        for s, timeline in enumerate(run.timelines)
        for ev in timeline
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    updates = {ev.action.step: ev.end for ev in run.timelines[-1] if ev.action.op is Op.UPDATE}
    expected = 4 * 8 * 3 / (updates[4] - updates[1])
    assert bench.replay_job("async_pp_2bw", path, P, M, args, 0.001, [0.0, 0.0]) == pytest.approx(expected, rel=1e-6)
    for e in events:
        if e["name"] == "1B6":  # step 3, inside the timed window
            e["dur"] += 10_000.0
    path.write_text(json.dumps({"traceEvents": events}))
    assert bench.replay_job("async_pp_2bw", path, P, M, args, 0.001, [0.0, 0.0]) < expected
