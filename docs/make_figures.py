"""Draw the schedule timelines used in docs/concepts.md from the schedule simulator.

    python docs/make_figures.py                # writes docs/images/schedules.png and prints the text charts

Both pictures are simulated, not measured: every stage costs 1 time unit per micro-batch forward and 2 per
backward, transfers are free, and the optimizer update costs 0.5. They show the *order* of work that the
runtime executes (the same action lists, from ``build_schedule``) and where stages sit idle.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lightning_async_pp.schedule import build_schedule
from lightning_async_pp.schedule.simulate import StageCosts, plot_gantt, simulate

STAGES, MICROBATCHES, STEPS = 4, 4, 3
COSTS = StageCosts(forward=1.0, backward=2.0, update=0.5)


def results():
    """The two simulated runs: 1F1B first, then 2BW, same stages, micro-batches, steps and costs."""
    return [
        simulate(build_schedule(kind, STAGES, MICROBATCHES, STEPS, with_comm=False), COSTS) for kind in ("1f1b", "2bw")
    ]


def draw(path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    runs = results()
    longest = max(r.makespan for r in runs)
    fig, axes = plt.subplots(2, 1, figsize=(12, 4.6), sharex=True)
    for ax, result in zip(axes, runs):
        plot_gantt(result, ax=ax)
        ax.set_xlim(0, longest)
        name = {"1f1b": "1F1B (synchronous: flush before every update)", "2bw": "PipeDream-2BW (no flush)"}
        ax.set_title(
            f"{name[result.schedule.kind]}: {STEPS} steps in {result.makespan:g} time units, "
            f"idle {100 * result.mean_bubble_fraction:.0f}% of stage time",
            fontsize=10,
        )
    axes[0].set_xlabel("")
    axes[-1].set_xlabel(
        "time (forward = 1, backward = 2, update = 0.5); "
        f"P = {STAGES} stages, M = {MICROBATCHES} micro-batches per step"
    )
    legend = [
        Patch(facecolor="tab:blue", edgecolor="k", label="F<i>: forward of micro-batch i"),
        Patch(facecolor="tab:green", edgecolor="k", label="B<i>: backward of micro-batch i"),
        Patch(facecolor="tab:red", edgecolor="k", label="U<t>: update with step t's gradient"),
    ]
    axes[1].legend(handles=legend, loc="center right", fontsize=8, framealpha=0.95)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "images" / "schedules.png")
    args = parser.parse_args()
    for result in results():
        print(result.gantt())
        print()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    draw(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
