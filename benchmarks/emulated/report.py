"""From the ranks' records to the report: medians per cell, the simulator's prediction, Markdown and the plot.

Per repetition of a cell, the step time is the slowest rank's timed window over the timed steps (every
rank's window ends with its share of the last step); its efficiency is the schedule's ideal step time
(:func:`~benchmarks.emulated.grid.ideal_step_seconds`) over it. Per rank:

* ``bubble``: 1 - emulated busy time (the layers' sleeps) / the rank's window;
* ``cpu_ms_per_step``: the process's CPU time per step (the host work: the schedule's bookkeeping, autograd,
  transfers); ``cpu_load``: all ranks' CPU time over the step time and the machine's cores;
* ``host_in_calls_ms_per_microbatch``: time inside the forward, backward, weight-gradient and update calls
  beyond their sleeps, per micro-batch: the runtime's own work around each action (``host_ms_by_call``
  splits it into forwards, backwards and the update);
* ``outside_calls_ms_per_step``: the rest of the window (waits for neighbours, transfers, the schedule's
  bookkeeping between actions);
* ``peak_stashed``: the most micro-batches held between their forward and their last backward part.

A cell's figure is the median over its repetitions.

The simulator (:func:`lightning_async_pp.schedule.simulate.simulate`) runs our action lists for
``ours_2bw``, ``ours_1f1b`` and ``torch_1f1b`` (torch's 1F1B is the same order) with each rank's measured
sleep time per micro-batch as its cost, no transfer time and no host time, over the same steps and window
as the measurement: what these schedules would give with nothing but the emulated devices' work. A second
prediction feeds it each rank's measured calls instead (sleeps plus the runtime's host work inside each forward,
backward and update): what remains between it and the measurement is transfer latency and the work between
actions.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from . import grid

SIMULATED = {"ours_2bw": "2bw", "ours_1f1b": "1f1b", "torch_1f1b": "1f1b"}


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _per_rank(reps: list[list[dict]], key) -> list[float]:
    return [statistics.median(key(rep[r]) for rep in reps) for r in range(len(reps[0]))]


def simulated_step_seconds(
    kind: str,
    P: int,
    M: int,
    forward: Sequence[float],
    backward: Sequence[float],
    spec,
    update: Sequence[float] | None = None,
) -> float:
    """Step time the simulator gives for our action lists with these per-stage costs, measured as the benchmark
    measures: from the end of each stage's last warm-up step to the end of its last step, the slowest stage."""
    from lightning_async_pp.schedule import build_schedule
    from lightning_async_pp.schedule.simulate import StageCosts, simulate

    warmup, steps = spec["warmup"], spec["steps"]
    schedule = build_schedule(kind, P, M, warmup + steps)
    updates = update if update is not None else [0.0] * len(forward)
    result = simulate(schedule, [StageCosts(f, b, u) for f, b, u in zip(forward, backward, updates)])
    windows = []
    for s in range(P):
        ends, index, end = [], 0, 0.0
        for segment in schedule.segments(s)[: warmup + steps]:
            index += len(segment)
            end = result.timelines[s][index - 1].end if segment else end
            ends.append(end)
        windows.append(ends[-1] - ends[warmup - 1])
    return max(windows) / steps


def aggregate(records: list[dict], spec: dict[str, Any]) -> tuple[list[dict], dict[str, str]]:
    """One entry per ``(P, M, schedule)`` that ran; and, per cell not run, why."""
    by_cell: dict[tuple[int, int, str], dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    skipped: dict[str, str] = {}
    for r in records:
        key = (r["num_stages"], r["num_microbatches"], r["name"])
        if "skipped" in r:
            skipped[f"{r['name']} P={key[0]} M={key[1]}"] = r["skipped"]
        else:
            by_cell[key][r["rep"]].append(r)
    costs = grid.Costs(**spec["costs"])
    results = []
    for (P, M, name), per_rep in sorted(by_cell.items(), key=lambda kv: (kv[0][0], kv[0][1], _order(kv[0][2]))):
        reps = [sorted(ranks, key=lambda r: r["rank"]) for _, ranks in sorted(per_rep.items()) if len(ranks) == P]
        if reps:
            results.append(_cell(P, M, name, reps, costs, spec))
    return results, skipped


def _order(name: str) -> int:
    return grid.SCHEDULES.index(name) if name in grid.SCHEDULES else len(grid.SCHEDULES)


def _cell(P: int, M: int, name: str, reps: list[list[dict]], costs: grid.Costs, spec: dict[str, Any]) -> dict:
    steps = spec["steps"]
    ideal = grid.ideal_step_seconds(name, P, M, spec["layers_per_stage"], costs)
    step_s = [max(r["window_s"] for r in rep) / steps for rep in reps]
    entry: dict[str, Any] = {
        "name": name,
        "num_stages": P,
        "num_microbatches": M,
        "repetitions": len(reps),
        "step_ms": 1e3 * statistics.median(step_s),
        "step_ms_all": [1e3 * s for s in step_s],
        "ideal_step_ms": 1e3 * ideal,
        "efficiency": statistics.median(ideal / s for s in step_s),
        "bubble_per_stage": _per_rank(reps, lambda r: 1.0 - sum(r["busy_s"].values()) / r["window_s"]),
        "busy_ms_per_step": _per_rank(reps, lambda r: 1e3 * sum(r["busy_s"].values()) / steps),
        "cpu_ms_per_step": _per_rank(reps, lambda r: 1e3 * r["cpu_s"] / steps),
        # The share of the machine's cores the ranks kept busy: near 1, the cell measures CPU contention too.
        "cpu_load": statistics.median(
            sum(r["cpu_s"] for r in rep) / (max(r["window_s"] for r in rep) * spec["cores"]) for rep in reps
        ),
        "host_in_calls_ms_per_microbatch": _per_rank(
            reps, lambda r: 1e3 * (sum(r["calls_s"].values()) - sum(r["busy_s"].values())) / (steps * M)
        ),
        "outside_calls_ms_per_step": _per_rank(
            reps, lambda r: 1e3 * (r["window_s"] - sum(r["calls_s"].values())) / steps
        ),
        "host_ms_by_call": {
            "forward_per_microbatch": _per_rank(
                reps, lambda r: 1e3 * (r["calls_s"]["F"] - r["busy_s"]["forward"]) / (steps * M)
            ),
            "backward_per_microbatch": _per_rank(
                reps,
                lambda r: (
                    1e3
                    * (r["calls_s"]["B"] + r["calls_s"]["W"] - r["busy_s"]["input"] - r["busy_s"]["weight"])
                    / (steps * M)
                ),
            ),
            "update_per_step": _per_rank(reps, lambda r: 1e3 * r["calls_s"]["U"] / steps),
        },
        "peak_stashed_per_stage": [max(rep[r]["peak_stashed"] for rep in reps) for r in range(P)],
    }
    kind = SIMULATED.get(name)
    if kind is not None:
        per_mb = steps * M
        forward = _per_rank(reps, lambda r: r["busy_s"]["forward"] / per_mb)
        backward = _per_rank(reps, lambda r: (r["busy_s"]["input"] + r["busy_s"]["weight"]) / per_mb)
        simulated = simulated_step_seconds(kind, P, M, forward, backward, spec)
        entry["simulated_step_ms"] = 1e3 * simulated
        entry["simulated_efficiency"] = ideal / simulated
        entry["simulator_error"] = simulated / statistics.median(step_s) - 1.0
        # The same schedule fed each rank's measured calls (sleeps plus the runtime's host work inside them):
        # what is left of the error is transfer latency and the work between actions.
        forward = _per_rank(reps, lambda r: r["calls_s"]["F"] / per_mb)
        backward = _per_rank(reps, lambda r: (r["calls_s"]["B"] + r["calls_s"]["W"]) / per_mb)
        update = _per_rank(reps, lambda r: r["calls_s"]["U"] / steps)
        with_host = simulated_step_seconds(kind, P, M, forward, backward, spec, update)
        entry["simulated_with_host_step_ms"] = 1e3 * with_host
        entry["simulator_with_host_error"] = with_host / statistics.median(step_s) - 1.0
    return entry


def _find(results: list[dict], name: str, P: int, M: int) -> dict | None:
    return next((r for r in results if (r["name"], r["num_stages"], r["num_microbatches"]) == (name, P, M)), None)


def _cells(results: list[dict]) -> list[tuple[int, int]]:
    return sorted({(r["num_stages"], r["num_microbatches"]) for r in results})


def _names(results: list[dict]) -> list[str]:
    return sorted({r["name"] for r in results}, key=_order)


def efficiency_table(results: list[dict]) -> str:
    """Markdown: one row per ``(P, M)``, one column per schedule, each cell's median efficiency."""
    names = _names(results)
    lines = ["| P | M | " + " | ".join(f"`{n}`" for n in names) + " |", "|---|---|" + "---|" * len(names)]
    for P, M in _cells(results):
        shown = []
        for n in names:
            r = _find(results, n, P, M)
            shown.append("-" if r is None else f"{r['efficiency']:.2f}")
        lines.append(f"| {P} | {M} | " + " | ".join(shown) + " |")
    return "\n".join(lines)


def _stages(values: Sequence[float], spec: str) -> str:
    return "/".join(format(v, spec) for v in values)


def detail_table(results: list[dict]) -> str:
    """Markdown: every cell and schedule with its step time, bubble, CPU time and stash per stage."""
    lines = [
        "| P | M | schedule | step ms | ideal ms | efficiency | simulated ms (error) | with host time (error) "
        "| bubble per stage "
        "| CPU ms/step per stage | CPU load | host ms/micro-batch in calls per stage | peak stashed micro-batches "
        "per stage |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        sim = r.get("simulated_step_ms")
        shown = "-" if sim is None else f"{sim:.1f} ({100 * r['simulator_error']:+.1f}%)"
        host = r.get("simulated_with_host_step_ms")
        shown += " | " + ("-" if host is None else f"{host:.1f} ({100 * r['simulator_with_host_error']:+.1f}%)")
        lines.append(
            f"| {r['num_stages']} | {r['num_microbatches']} | `{r['name']}` | {r['step_ms']:.1f} | "
            f"{r['ideal_step_ms']:.1f} | {r['efficiency']:.3f} | {shown} | {_stages(r['bubble_per_stage'], '.2f')} | "
            f"{_stages(r['cpu_ms_per_step'], '.0f')} | {r['cpu_load']:.2f} | "
            f"{_stages(r['host_in_calls_ms_per_microbatch'], '.2f')} | {_stages(r['peak_stashed_per_stage'], 'd')} |"
        )
    return "\n".join(lines)


def markdown(report: dict[str, Any]) -> str:
    cfg = report["config"]
    c = cfg["costs"]
    head = (
        f"Per stage and micro-batch: forward {1e3 * c['forward']:g} ms, input gradient {1e3 * c['input']:g} ms, "
        f"weight gradient {1e3 * c['weight']:g} ms (last stage x{c['last_stage_factor']:g}"
        + (f", stage factors {c['stage_factors']}" if c.get("stage_factors") else "")
        + f"), {cfg['layers_per_stage']} layers per stage, activations {cfg['activation_kib']:g} KiB per micro-batch; "
        f"{cfg['warmup']} warm-up + {cfg['steps']} timed steps, median of {cfg['repeats']} interleaved repetitions."
    )
    parts = [head, "", "Efficiency (ideal step time / measured):", "", efficiency_table(report["results"])]
    parts += ["", detail_table(report["results"])]
    if report["skipped"]:
        parts += ["", "Not run: " + "; ".join(f"{k}: {v}" for k, v in sorted(report["skipped"].items()))]
    return "\n".join(parts)


def plot(results: list[dict], path: str) -> str | None:
    """Efficiency against ``P``, one line per schedule and ``M / P``; returns why not when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install matplotlib)"
    ratios = sorted({r["num_microbatches"] // r["num_stages"] for r in results})
    fig, axes = plt.subplots(1, len(ratios), figsize=(5 * len(ratios), 4), sharey=True, squeeze=False)
    for ax, k in zip(axes[0], ratios):
        for name in _names(results):
            points = sorted(
                (r["num_stages"], r["efficiency"])
                for r in results
                if r["name"] == name and r["num_microbatches"] == k * r["num_stages"]
            )
            if points:
                ax.plot(*zip(*points), marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("P (stages = emulated devices)")
        ax.set_title(f"M = {k} P")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("efficiency (ideal / measured step time)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return None
