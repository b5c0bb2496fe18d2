"""Simulated scaling of 2BW against 1F1B and GPipe to pipelines deeper than one machine can run.

For every ``P`` in ``--stages`` and ``M`` in ``{P, 2P, 4P}`` (``--multipliers``), the schedule simulator
(:func:`lightning_async_pp.schedule.simulate.simulate`) times the action lists that the runtime executes
(:func:`~lightning_async_pp.schedule.build_schedule` for ``"2bw"`` and ``"1f1b"``) and the GPipe
lists of :func:`~lightning_async_pp.schedule.gpipe_schedule` (all forwards of a step, then all backwards,
then the update). Every stage costs ``forward`` per micro-batch forward and
``backward_ratio * forward`` per backward (default 2), plus ``transfer`` between stages.

Reported per ``(P, M)``: the steady-state throughput of 2BW relative to 1F1B and to GPipe (the bubble model
says ``(M + P - 1) / M`` for both), the 1F1B bubble, and memory per stage: weight versions alive and peak
micro-batches in flight (activations stashed) on the first stage, which holds the most.

``--png`` draws the timeline of one 2BW and one 1F1B step for P=4 (matplotlib, the optional ``bench``
extra); :func:`timeline_figure` returns the figure, so it can be logged with
``SummaryWriter.add_figure`` (see :func:`log_timeline`).

Usage::

    python benchmarks/scaling.py --out benchmarks/results/scaling/scaling.json \
        --png benchmarks/results/scaling/timeline_p4.png
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_async_pp.schedule import Op, Schedule, build_schedule, gpipe_schedule
from lightning_async_pp.schedule.simulate import SimulationResult, StageCosts, simulate

KINDS = ("2bw", "1f1b", "gpipe")


def schedule_of(kind: str, num_stages: int, num_microbatches: int, num_steps: int) -> Schedule:
    if kind == "gpipe":
        return gpipe_schedule(num_stages, num_microbatches, num_steps)
    return build_schedule(kind, num_stages, num_microbatches, num_steps, with_comm=False)


def simulate_kind(
    kind: str, num_stages: int, num_microbatches: int, costs: StageCosts, transfer: float = 0.0, num_steps: int = 8
) -> SimulationResult:
    return simulate(schedule_of(kind, num_stages, num_microbatches, num_steps), costs, transfer=transfer)


def scaling_table(
    stage_counts: Sequence[int] = (2, 4, 8, 16, 32, 64),
    multipliers: Sequence[int] = (1, 2, 4),
    costs: StageCosts = StageCosts(forward=1.0, backward=2.0),
    transfer: float = 0.0,
    num_steps: int = 8,
) -> list[dict[str, Any]]:
    """One row per ``(P, M = k P)``: relative throughput and per-stage memory of 2BW, 1F1B and GPipe."""
    rows = []
    for P in stage_counts:
        for k in multipliers:
            M = k * P
            results = {kind: simulate_kind(kind, P, M, costs, transfer, num_steps) for kind in KINDS}
            tput = {kind: r.steady_throughput for kind, r in results.items()}
            rows.append(
                {
                    "num_stages": P,
                    "num_microbatches": M,
                    "steady_microbatches_per_time": tput,
                    "2bw_vs_1f1b": tput["2bw"] / tput["1f1b"],
                    "2bw_vs_gpipe": tput["2bw"] / tput["gpipe"],
                    "bubble_model": (M + P - 1) / M,
                    "bubble_fraction": {kind: max(r.steady_bubble_fraction) for kind, r in results.items()},
                    # stage 0 stashes the most activations; every stage holds the same number of versions
                    "weight_versions": {kind: max(r.peak_versions_alive) for kind, r in results.items()},
                    "peak_in_flight_microbatches": {kind: max(r.peak_in_flight) for kind, r in results.items()},
                }
            )
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (
        "|  P |   M | 1F1B bubble | 2BW / 1F1B | 2BW / GPipe | (M+P-1)/M | weight versions 2BW / 1F1B / GPipe "
        "| in-flight micro-batches (stage 0) 2BW / 1F1B / GPipe |"
    )
    lines = [head, "|" + "|".join("---" for _ in range(8)) + "|"]
    for r in rows:
        v, a = r["weight_versions"], r["peak_in_flight_microbatches"]
        lines.append(
            f"| {r['num_stages']:>2} | {r['num_microbatches']:>3} | {r['bubble_fraction']['1f1b']:.3f} | "
            f"{r['2bw_vs_1f1b']:.3f} | {r['2bw_vs_gpipe']:.3f} | {r['bubble_model']:.3f} | "
            f"{v['2bw']} / {v['1f1b']} / {v['gpipe']} | {a['2bw']} / {a['1f1b']} / {a['gpipe']} |"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ timeline


def _step_window(result: SimulationResult, step: int) -> tuple[float, float]:
    """Start of ``step``'s first forward on stage 0 to the start of the next step's (or the end)."""
    starts = {}
    for ev in result.timelines[0]:
        if ev.action.op is Op.FORWARD and ev.action.step in (step, step + 1):
            starts.setdefault(ev.action.step, ev.start)
    return starts[step], starts.get(step + 1, result.makespan)


_COLORS = {Op.FORWARD: ("#9ecae1", "#3182bd"), Op.BACKWARD: ("#a1d99b", "#31a354"), Op.UPDATE: ("#fc9272", "#de2d26")}


def _draw_window(ax, result: SimulationResult, lo: float, span: float, step: int) -> None:
    """Compute actions inside ``[lo, lo + span]``, clipped; the actions of ``step`` dark, others light."""
    P = len(result.timelines)
    hi = lo + span
    for s, timeline in enumerate(result.timelines):
        for ev in timeline:
            if not ev.action.is_compute or ev.end <= lo or ev.start >= hi or ev.end <= ev.start:
                continue
            a, b = max(ev.start, lo), min(ev.end, hi)
            light, dark = _COLORS[ev.action.op]
            color = dark if ev.action.step == step else light
            ax.broken_barh([(a - lo, b - a)], (s - 0.4, 0.8), facecolors=color, edgecolor="k", linewidth=0.6)
            if b - a >= 0.6 * (ev.end - ev.start):
                label = (
                    f"U{ev.action.step}"
                    if ev.action.op is Op.UPDATE
                    else f"{ev.action.op.value}{ev.action.global_microbatch}"
                )
                ax.text((a + b) / 2 - lo, s, label, ha="center", va="center", fontsize=7)
    ax.set_xlim(0, span)
    ax.set_ylim(P - 0.5, -0.5)
    ax.set_yticks(range(P), [f"stage {s}" for s in range(P)])


def timeline_figure(
    num_stages: int = 4,
    num_microbatches: int = 8,
    costs: StageCosts = StageCosts(forward=1.0, backward=2.0),
    transfer: float = 0.0,
):
    """Matplotlib figure: one steady-state step of 1F1B (top) and of 2BW (bottom), on the same time scale.

    Both panels span the duration of one 1F1B step, from where a step starts on stage 0; the step's own
    micro-batches are dark, those of the neighbouring steps light (2BW overlaps them, 1F1B cannot). Log it
    with ``SummaryWriter.add_figure("pipeline/timeline", timeline_figure())`` (see :func:`log_timeline`).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as err:
        raise ImportError("the timeline needs matplotlib: pip install 'lightning-async-pp[bench]'") from err

    P, M = num_stages, num_microbatches
    sync = simulate_kind("1f1b", P, M, costs, transfer, num_steps=3)
    async_ = simulate_kind("2bw", P, M, costs, transfer, num_steps=5)
    lo1, hi1 = _step_window(sync, 1)
    lo2, hi2 = _step_window(async_, 2)
    span = hi1 - lo1
    fig, axes = plt.subplots(2, 1, figsize=(13, 0.9 * P + 2.8))
    work = M * (costs.forward + costs.backward) + costs.update
    for ax, result, lo, hi, step, name in (
        (axes[0], sync, lo1, hi1, 1, "1F1B (synchronous, flushed every step)"),
        (axes[1], async_, lo2, hi2, 2, "2BW (asynchronous, no flush)"),
    ):
        _draw_window(ax, result, lo, span, step)
        idle = 1.0 - work / (hi - lo)
        ax.set_title(
            f"{name}: P={P}, M={M}; one step every {hi - lo:g} time units, each stage idle {100 * idle:.0f}%",
            fontsize=10,
            loc="left",
        )
    axes[1].set_xlabel(
        f"time since the step started on stage 0 (forward = {costs.forward:g}, "
        f"backward = {costs.backward:g} per micro-batch)"
    )
    handles = [
        Patch(facecolor=_COLORS[op][1], edgecolor="k", label=label)
        for op, label in ((Op.FORWARD, "forward"), (Op.BACKWARD, "backward"), (Op.UPDATE, "update"))
    ]
    handles.append(Patch(facecolor="#dddddd", edgecolor="k", label="(light: other steps)"))
    fig.legend(handles=handles, loc="upper right", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return fig


def figure_to_array(fig):
    """The figure as an ``(H, W, 3)`` uint8 array, for ``SummaryWriter.add_image(..., dataformats="HWC")``."""
    import numpy as np

    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()


def log_timeline(writer, tag: str = "pipeline/timeline", global_step: int = 0, **kwargs) -> None:
    """Log :func:`timeline_figure` to a TensorBoard ``SummaryWriter`` as an image."""
    writer.add_figure(tag, timeline_figure(**kwargs), global_step=global_step)


# ------------------------------------------------------------------------------------------ entry point


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    parser.add_argument("--multipliers", type=int, nargs="+", default=[1, 2, 4], help="M = k * P for each k")
    parser.add_argument("--forward", type=float, default=1.0, help="forward cost per micro-batch and stage")
    parser.add_argument("--backward-ratio", type=float, default=2.0, help="backward cost / forward cost")
    parser.add_argument("--update", type=float, default=0.0, help="optimizer update cost per step and stage")
    parser.add_argument("--transfer", type=float, default=0.0, help="latency of a transfer between stages")
    parser.add_argument("--steps", type=int, default=8, help="simulated steps (steady state: the middle half)")
    parser.add_argument("--out", type=str, default=None, help="write the table as JSON")
    parser.add_argument("--png", type=str, default=None, help="draw the P=4 timeline into this PNG")
    parser.add_argument("--png-stages", type=int, default=4)
    parser.add_argument("--png-microbatches", type=int, default=8)
    args = parser.parse_args(argv)
    costs = StageCosts(forward=args.forward, backward=args.backward_ratio * args.forward, update=args.update)
    started = time.perf_counter()
    rows = scaling_table(args.stages, args.multipliers, costs, args.transfer, args.steps)
    report = {
        "costs": {
            "forward": costs.forward,
            "backward": costs.backward,
            "update": costs.update,
            "transfer": args.transfer,
        },
        "steps": args.steps,
        "rows": rows,
        "seconds": time.perf_counter() - started,
    }
    print(format_table(rows))
    if args.png:
        fig = timeline_figure(args.png_stages, args.png_microbatches, costs, args.transfer)
        Path(args.png).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.png, dpi=110, bbox_inches="tight")
        report["png"] = args.png
        print(f"timeline written to {args.png}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
