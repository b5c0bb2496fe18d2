"""Smoke test of the emulated-device benchmark (``python -m benchmarks.emulated``): the layers' split backward
against torch's own split, the placement of the layers, the report on made-up records, and the quick run end
to end (in the default suite). No assertion on a speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from benchmarks.emulated import grid, report
from benchmarks.emulated.layers import CLOCK, LayerCost, build_layers

ROOT = Path(__file__).resolve().parents[2]
TINY = LayerCost(forward=1e-4, input=2e-4, weight=3e-4)


def test_torch_split_backward_runs_input_and_weight_parts_apart():
    """torch's input pass sleeps the input gradients only, its weight pass the weight gradients only, and
    together they give the gradients of y = x * w1 * w2 (w = ones) computed by hand."""
    module = nn.Sequential(*build_layers(3, [TINY, TINY]))
    x = torch.randn(4, 3, requires_grad=True)
    g = torch.randn(4, 3)
    before = dict(CLOCK.counts)
    y = module(x)
    counted = lambda: {k: CLOCK.counts[k] - before[k] for k in CLOCK.counts}  # noqa: E731
    assert counted() == {"forward": 2, "input": 0, "weight": 0}
    (dx,), groups = stage_backward_input([y], [g], [x], module.parameters())
    assert counted() == {"forward": 2, "input": 2, "weight": 0}
    assert all(p.grad is None for p in module.parameters())
    torch.testing.assert_close(dx, g)
    stage_backward_weight(module.parameters(), groups)
    assert counted() == {"forward": 2, "input": 2, "weight": 2}
    for p in module.parameters():
        torch.testing.assert_close(p.grad, (x.detach() * g).sum(0))


def test_full_backward_runs_every_part():
    module = nn.Sequential(*build_layers(3, [TINY]))
    before = dict(CLOCK.counts)
    module(torch.randn(2, 3)).sum().backward()  # an input without grad: the first stage
    assert {k: CLOCK.counts[k] - before[k] for k in CLOCK.counts} == {"forward": 1, "input": 1, "weight": 1}
    torch.testing.assert_close(module[0].weight.grad.shape, torch.Size([3]))


@pytest.mark.parametrize("name", grid.SCHEDULES)
@pytest.mark.parametrize("P", [2, 4])
def test_every_layer_is_held_once(name, P):
    L = 4
    held = sorted(i for r in range(P) for s in grid.rank_stages(name, r, P) for i in grid.stage_layers(name, s, P, L))
    assert held == list(range(P * L))
    assert sorted(s for r in range(P) for s in grid.rank_stages(name, r, P)) == list(
        range(grid.num_model_stages(name, P))
    )


def test_ideal_step_time_follows_the_placement():
    costs = grid.Costs(forward=1.0, input=1.0, weight=2.0, last_stage_factor=3.0)
    # One stage per rank: the last rank carries the heavy head alone, 3 x 4 per micro-batch.
    assert grid.ideal_step_seconds("torch_1f1b", 4, 8, 2, costs) == pytest.approx(8 * 12.0)
    # 8 chunks of half a stage. Looped: rank r holds chunks r and r + 4, so ranks 2 and 3 each hold half of
    # stage 1 and half of the head: (4 + 12) / 2.
    assert [c.total for c in grid.rank_costs("torch_interleaved_1f1b", 4, 2, costs)] == [4.0, 4.0, 8.0, 8.0]
    # V-shaped: rank r holds chunks r and 7 - r, so ranks 0 and 1 hold the halves of the head.
    assert [c.total for c in grid.rank_costs("torch_zbv", 4, 2, costs)] == [8.0, 8.0, 4.0, 4.0]
    assert grid.ideal_step_seconds("torch_zbv", 4, 8, 2, costs) == pytest.approx(8 * 8.0)
    with pytest.raises(ValueError, match="one per stage"):
        grid.Costs(1.0, 1.0, 1.0, stage_factors=(1.0, 2.0)).stage(0, 4)
    with pytest.raises(ValueError, match="multiple of 2"):
        grid.check_layers_per_stage(3)


@pytest.mark.parametrize(("kind", "bubble_steps"), [("2bw", 0), ("1f1b", 1)])
def test_simulated_step_time_is_the_bubble_model(kind, bubble_steps):
    P, M = 4, 8
    spec = {"warmup": 1, "steps": 2}
    step = report.simulated_step_seconds(kind, P, M, [1.0] * P, [2.0] * P, spec)
    assert step == pytest.approx((M + bubble_steps * (P - 1)) * 3.0)


def _records(P: int, M: int, name: str, window: float, rep: int) -> list[dict]:
    busy = {"forward": 0.01 * M, "input": 0.005 * M, "weight": 0.005 * M}  # 2 steps x 2 micro-batches of 5 + 5 ms
    return [
        {
            "rank": r,
            "num_stages": P,
            "num_microbatches": M,
            "name": name,
            "rep": rep,
            "window_s": window + 0.001 * r,
            "busy_s": busy,
            "calls_s": {"F": 0.0105 * M, "B": 0.0105 * M, "W": 0.0, "U": 0.001},
            "cpu_s": 0.002,
            "peak_stashed": P - r,
        }
        for r in range(P)
    ]


def test_report_on_made_up_records():
    spec = {
        "warmup": 1,
        "cores": 2,
        "steps": 2,
        "layers_per_stage": 2,
        "costs": {"forward": 0.005, "input": 0.0025, "weight": 0.0025},
    }
    records = (
        _records(2, 2, "ours_2bw", 0.05, 0) + _records(2, 2, "ours_2bw", 0.03, 1) + _records(2, 2, "ours_2bw", 0.04, 2)
    )
    records.append(
        {"rank": 0, "num_stages": 2, "num_microbatches": 2, "name": "torch_dualpipev", "rep": 0, "skipped": "M"}
    )
    results, skipped = report.aggregate(records, spec)
    assert skipped == {"torch_dualpipev P=2 M=2": "M"}
    (cell,) = results
    # Step time: the slowest rank's window (rank 1: +1 ms) over the 2 timed steps, median over repetitions.
    assert cell["step_ms"] == pytest.approx(1e3 * 0.041 / 2)
    assert cell["ideal_step_ms"] == pytest.approx(2 * 10.0)
    assert cell["efficiency"] == pytest.approx(0.020 / 0.0205)
    assert cell["bubble_per_stage"] == pytest.approx([1 - 0.04 / 0.04, 1 - 0.04 / 0.041])
    assert cell["peak_stashed_per_stage"] == [2, 1]
    # Calls of 21 + 21 + 1 ms around 40 ms of sleeps, over 4 micro-batches; 0.002 s CPU x 2 ranks, 2 cores.
    assert cell["host_in_calls_ms_per_microbatch"] == pytest.approx([0.75, 0.75])
    by_call = cell["host_ms_by_call"]
    assert by_call["forward_per_microbatch"] == by_call["backward_per_microbatch"] == pytest.approx([0.25, 0.25])
    assert by_call["update_per_step"] == pytest.approx([0.5, 0.5])
    assert cell["cpu_load"] == pytest.approx(0.004 / (0.041 * 2))
    # Measured sleeps of 10 ms forward and 10 ms backward per micro-batch over the 2 x 2 micro-batches.
    assert cell["simulated_step_ms"] == pytest.approx(2 * (5.0 + 5.0))
    # Fed the measured calls instead: 5.25 ms forward and backward per micro-batch, a 0.5 ms update per step.
    assert cell["simulated_with_host_step_ms"] == pytest.approx(2 * (5.25 + 5.25) + 0.5)
    text = report.markdown(
        {
            "config": dict(spec, repeats=3, activation_kib=64, costs=dict(spec["costs"], last_stage_factor=1.0)),
            "results": results,
            "skipped": skipped,
        }
    )
    assert "| 2 | 2 | 0.98 |" in text and "torch_dualpipev P=2 M=2: M" in text


def test_quick_run_end_to_end(tmp_path):
    """The `--quick` grid end to end (about 30 s on 2 cores): part of the default suite's smoke tests."""
    out = tmp_path / "emulated.json"
    command = [
        sys.executable,
        "-m",
        "benchmarks.emulated",
        "--quick",
        "--out",
        str(out),
        "--png",
        str(tmp_path / "e.png"),
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    saved = json.loads(out.read_text())
    assert not saved["errors"]
    ran = {(r["name"], r["num_stages"], r["num_microbatches"]) for r in saved["results"]}
    refused = set(saved["skipped"])
    for name in grid.SCHEDULES:
        for P in (2, 4):
            assert (name, P, P) in ran or f"{name} P={P} M={P}" in refused
    assert ("ours_2bw", 4, 4) in ran and ("torch_zbv", 4, 4) in ran
    assert "torch_dualpipev P=2 M=2" in refused  # DualPipeV needs M >= 2 P
    for r in saved["results"]:
        assert r["repetitions"] == 2 and len(r["bubble_per_stage"]) == r["num_stages"]
        assert all(n >= 1 for n in r["peak_stashed_per_stage"])
