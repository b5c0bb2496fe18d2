"""The report's outputs: the JSON layout, the Markdown tables and the figure."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from .spec import MODES, OPTIMIZERS

MODE_NAMES = {
    "sync": "sync",
    "delayed": "delayed (2BW)",
    "delayed_corrected": "delayed + correction",
    "delayed_auto": "delayed + auto correction",
}
MODE_COLORS = {"sync": "tab:blue", "delayed": "tab:red", "delayed_corrected": "tab:green", "delayed_auto": "tab:olive"}
OPTIMIZER_COLORS = {"adamw": "tab:orange", "muon": "tab:purple", "soap": "tab:brown", "adan": "tab:cyan"}
MUON_PART_NAMES = {
    "delayed": "everything (2BW)",
    "delayed_matrices_only": "only the Muon matrices",
    "delayed_adamw_only": "only the AdamW part (embeddings, head, norms, biases)",
}
GRID_HEADER = [
    "optimizer",
    "lr",
    "sync",
    "delayed (2BW)",
    "delayed + correction",
    "gap",
    "gap corrected",
    "recovered",
    "corrected vs sync",
]
PAPER_MOE = (
    "The paper's 10B mixture-of-experts model (Muon, 200B tokens), final validation loss: sync 1.906, delayed (2BW)"
    " 1.911 (gap +0.005), delayed + correction 1.906 (gap +0.000)."
)
AUTO_HEADER = ["delayed + auto", "gap auto", "recovered auto", "auto vs sync"]


def dump_report(report: dict[str, Any]) -> str:
    """JSON with the summaries indented and one line per run (the curves make the runs long)."""
    head = {k: v for k, v in report.items() if k != "runs"}
    text = json.dumps(head, indent=1)
    runs = ",\n  ".join(json.dumps(run, separators=(",", ":")) for run in report.get("runs", []))
    return text[:-2] + ',\n "runs": [\n  ' + runs + "\n ]\n}\n"


# --- Markdown ------------------------------------------------------------------------------------------------


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _fmt(value: float | None, digits: int = 3, signed: bool = False) -> str:
    if not _finite(value):
        return "diverged"
    return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"


def _pm(cell: dict[str, Any], digits: int = 3, signed: bool = False) -> str:
    if not cell.get("ran", True):
        return "not run"
    if not _finite(cell["mean"]):
        return "diverged"
    return f"{_fmt(cell['mean'], digits, signed)} ± {cell['std']:.{digits}f}"


def _signed(cell: dict[str, Any], digits: int = 3) -> str:
    return _pm(cell, digits, signed=True)


def _percent(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec) + "%"


def _share(value: float | None) -> str:
    return _percent(None if value is None else 100 * value, ".0f")


def _table(caption: str, header: list[str], rows: list[list[str]]) -> list[str]:
    """A caption and a Markdown table, as lines."""
    return [
        caption,
        "",
        "| " + " | ".join(header) + " |",
        "|" + " --- |" * len(header),
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def _grid_table(caption: str, table: dict[str, Any]) -> list[str]:
    """The main table (or the one at the delayed-best rate): one row per optimizer."""
    auto = any(cell.get("delayed_auto", {}).get("ran") for cell in table.values())
    rows = []
    for opt, cell in table.items():
        row = [
            opt,
            f"{cell['lr']:g}",
            _pm(cell["sync"]),
            _pm(cell["delayed"]),
            _pm(cell["delayed_corrected"]),
            _signed(cell["gap"]),
            _signed(cell["gap_corrected"]),
            _share(cell["recovered_share"]),
            _percent(cell["corrected_vs_sync_percent"], "+.2f"),
        ]
        if auto:
            row += [
                _pm(cell["delayed_auto"]),
                _signed(cell["gap_auto"]),
                _share(cell.get("recovered_share_auto")),
                _percent(cell.get("auto_vs_sync_percent"), "+.2f"),
            ]
        rows.append(row)
    return _table(caption, GRID_HEADER + (AUTO_HEADER if auto else []), rows)


def _main_tables(report: dict[str, Any]) -> list[str]:
    """The main table, the automatic coefficients and the table at the delayed-best learning rate."""
    cfg = report["config"]
    params = next((r["parameters"] for r in report["runs"]), 0)
    experts = cfg.get("n_experts", 0)
    model = f" with {cfg['experts_per_token']} of {experts} experts per token in each block" if experts else ""
    lines = _grid_table(
        f"Final validation loss (nats/byte) after {cfg['steps']} steps of {cfg['batch_size']}x{cfg['block_size']} "
        f"bytes, {params / 1e6:.2f}M-parameter GPT{model}, corpus {cfg['corpus']} (mean ± std over seeds "
        f"{cfg['seeds']}; gaps are per-seed paired differences to sync).",
        report["table"],
    )
    if experts:
        lines += ["", PAPER_MOE]
    if report.get("auto_coefficients"):
        spread = "; ".join(
            f"{opt} {row['min']:.2f} / {row['median']:.2f} / {row['max']:.2f}"
            for opt, row in report["auto_coefficients"].items()
        )
        lines += ["", f"Automatic coefficients after the last step, over tensors (min / median / max): {spread}."]
    if report.get("table_delayed_lr"):
        lines += [""] + _grid_table(
            "The same at the learning rate that is best for the *delayed* run (first seed, grid):",
            report["table_delayed_lr"],
        )
    return lines


def _corrections_table(report: dict[str, Any]) -> list[str]:
    return _table(
        f"Fixed coefficient c vs `auto` (seeds {report['config']['seeds']}; c = 0 is the delayed run, c = 1 the"
        " paper's):",
        ["optimizer", "c", "final val loss", "gap", "recovered"],
        [
            [
                opt,
                str(row["coefficient"]),
                _fmt(row["final_val_loss"]),
                _fmt(row["gap"], signed=True),
                _share(row["recovered_share"]),
            ]
            for opt, rows in report["corrections"].items()
            for row in rows
        ],
    )


def _lr_grid_table(report: dict[str, Any]) -> list[str]:
    edge = report.get("chosen_lr_at_grid_edge", {})

    def star(opt: str, lr: float) -> str:
        if lr != report["chosen_lr"][opt]:
            return ""
        return " * (edge of the grid)" if edge.get(opt) else " *"

    return _table(
        f"Learning-rate grid (seed {report['config']['seeds'][0]}; the best synchronous run decides, *):",
        ["optimizer", "lr", "sync", "delayed", "gap"],
        [
            [
                opt,
                f"{row['lr']:g}{star(opt, row['lr'])}",
                _fmt(row["final_val_loss"]),
                _fmt(row["delayed"]) if "delayed" in row else "",
                _fmt(row["gap"], signed=True) if "gap" in row else "",
            ]
            for opt, rows in report["lr_grid"].items()
            for row in rows
        ],
    )


def _muon_parts_table(report: dict[str, Any]) -> list[str]:
    return _table(
        f"Muon, which parameters are one step stale (seed {report['config']['seeds'][0]}):",
        ["delayed", "final val loss", "gap to sync"],
        [
            [MUON_PART_NAMES[mode], _fmt(row["loss"]), _fmt(row["gap"], signed=True)]
            for mode, row in report["muon_parts"].items()
        ],
    )


def _depth_table(report: dict[str, Any]) -> list[str]:
    return _table(
        f"Depth: gap to sync (seeds {report['config']['depth_seeds']}) under the original PipeDream profile (stage "
        "s of P is P-1-s steps stale) and under 2BW (one step for every stage, whatever P is).",
        ["optimizer", "P", "PipeDream loss", "PipeDream gap", "2BW gap"],
        [
            [opt, str(row["stages"]), _fmt(row["pipedream_loss"]), _fmt(row["pipedream_gap"]), _fmt(row["2bw_gap"])]
            for opt, rows in report["depth"].items()
            for row in rows
        ],
    )


def _momentum_table(report: dict[str, Any]) -> list[str]:
    return _table(
        f"Momentum (seed {report['config']['momentum_seed']}; AdamW beta1, Muon momentum):",
        ["optimizer", "momentum", "sync", "delayed", "gap"],
        [
            [opt, f"{row['momentum']:g}", _fmt(row["sync"]), _fmt(row["delayed"]), _fmt(row["gap"])]
            for opt, rows in report["momentum"].items()
            for row in rows
        ],
    )


def _pipeline_line(check: dict[str, Any]) -> str:
    return (
        f"Real 2-process pipeline ({check['optimizer']}, {check['mode']}, seed {check['seed']}) vs its one-device "
        f"simulation: max |Δ val loss| {_fmt(check['max_abs_val_loss_deviation'], 7)} over "
        f"{check['val_points']} points, max |Δ train loss| {_fmt(check['max_abs_train_loss_deviation'], 7)} over "
        f"{check['train_steps']} steps; final validation loss {_fmt(check['final_val_loss_pipeline'], 5)} "
        f"(pipeline) vs {_fmt(check['final_val_loss_simulated'], 5)} (simulation)."
    )


def markdown(report: dict[str, Any]) -> str:
    """The report's tables and notes as Markdown (the ``.md`` next to the JSON)."""
    lines = _main_tables(report)
    sections = (
        ("corrections", _corrections_table),
        ("lr_grid", _lr_grid_table),
        ("muon_parts", _muon_parts_table),
        ("depth", _depth_table),
        ("momentum", _momentum_table),
    )
    for key, section in sections:
        if report.get(key):
            lines += [""] + section(report)
    if report.get("pipeline_check"):
        lines += ["", _pipeline_line(report["pipeline_check"])]
    if "unique_runs" in report:
        cfg = report["config"]
        lines += [
            "",
            f"{report['unique_runs']} runs ({report['runs_from_cache']} of them from the cache), "
            f"{report['run_seconds']:.0f} s of run time in total, {report['wall_s_total']:.0f} s wall "
            f"({cfg['jobs']} at a time, {cfg['threads']} thread(s) each).",
        ]
    return "\n".join(lines) + "\n"


# --- figure --------------------------------------------------------------------------------------------------

_NAN = float("nan")


def _curves_panel(ax, report: dict[str, Any], opt: str) -> None:
    """The validation curves of one optimizer's main runs (every mode and seed), and the real pipeline's."""
    runs = report["runs"]
    upper, lower = [], []
    for mode in MODES:
        curves = [r["val_curve"] for r in runs if r["optimizer"] == opt and r["kind"] == "main" and r["mode"] == mode]
        for i, curve in enumerate(curves):
            steps = [s for s, v in curve if v is not None]
            values = [v for s, v in curve if v is not None]
            upper += values[1:2]
            lower += values[-1:]
            label = f"{MODE_NAMES[mode]} ({len(curves)} seeds)" if i == 0 else None
            ax.plot(steps, values, color=MODE_COLORS[mode], alpha=0.75, lw=1.2, label=label)
    for r in runs:
        if r["optimizer"] == opt and r["kind"] == "pipeline":
            ax.plot(
                [s for s, v in r["val_curve"]],
                [_NAN if v is None else v for s, v in r["val_curve"]],
                "k+",
                ms=10,
                mew=1.6,
                label=f"{MODE_NAMES[r['mode']]}, real 2-process pipeline (seed {r['seed']})",
            )
    if upper and lower:
        ax.set_ylim(min(lower) - 0.05, max(upper) + 0.05)
    ax.set_title(f"{opt}, lr {report['chosen_lr'][opt]:g}: validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats/byte)")


def _depth_panel(ax, report: dict[str, Any]) -> None:
    """The gap to sync against the pipeline depth, original PipeDream and 2BW."""
    for opt, rows in report["depth"].items():
        ps = [row["stages"] for row in rows]
        color = OPTIMIZER_COLORS[opt]
        pipedream = [_NAN if row["pipedream_gap"] is None else row["pipedream_gap"] for row in rows]
        two_bw = [_NAN if row["2bw_gap"] is None else row["2bw_gap"] for row in rows]
        ax.plot(ps, pipedream, "o-", color=color, label=f"{opt}: original PipeDream (stage s: P-1-s steps)")
        ax.plot(ps, two_bw, "s--", color=color, alpha=0.7, label=f"{opt}: 2BW (1 step, any P)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ps, [str(p) for p in ps])
    ax.set_xlabel("pipeline stages P")
    ax.set_ylabel("final validation loss - sync")
    ax.set_title(f"gap vs depth (seeds {report['config']['depth_seeds']})")


def _lr_panel(ax, report: dict[str, Any], lr_rows: dict[str, list[dict[str, Any]]]) -> None:
    """The gap against the learning rate of the grid, with the rate chosen on sync starred."""
    for opt, rows in lr_rows.items():
        color = OPTIMIZER_COLORS[opt]
        gaps = [_NAN if row["gap"] is None else row["gap"] for row in rows]
        ax.plot([row["lr"] for row in rows], gaps, "o-", color=color, label=f"{opt}: delayed - sync")
        chosen = report["chosen_lr"][opt]
        gap = next((row["gap"] for row in rows if row["lr"] == chosen), None)
        if gap is not None:
            ax.plot([chosen], [gap], "*", ms=14, color=color, label=f"{opt}: lr chosen on sync")
    ax.set_xscale("log", base=2)
    ticks = sorted({row["lr"] for rows in lr_rows.values() for row in rows})
    ax.set_xticks(ticks, [f"{lr:g}" for lr in ticks])
    ax.minorticks_off()
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel("final validation loss gap (delayed - sync)")
    ax.set_title(f"gap vs learning rate (seed {report['config']['seeds'][0]})")


def plot(report: dict[str, Any], path: Path) -> bool:
    """Draw the validation curves, the gap against depth and against the learning rate into ``path``.

    Returns:
        Whether a figure was written (``False`` without matplotlib).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e '.[bench]').", flush=True)
        return False
    runs = report["runs"]
    panels = [opt for opt in OPTIMIZERS if any(r["optimizer"] == opt and r["kind"] == "main" for r in runs)]
    lr_rows = {opt: [row for row in rows if "gap" in row] for opt, rows in (report.get("lr_grid") or {}).items()}
    lr_rows = {opt: rows for opt, rows in lr_rows.items() if rows}
    extras = [name for name, present in (("depth", report.get("depth")), ("lr", lr_rows)) if present]
    count = len(panels) + len(extras)
    cols = 2 if count > 2 else count
    rows_n = math.ceil(count / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(6.2 * cols, 4.4 * rows_n), squeeze=False)
    axes = list(axes.flat)
    for ax, opt in zip(axes, panels):
        _curves_panel(ax, report, opt)
    extra_axes = axes[len(panels) :]
    for name, ax in zip(extras, extra_axes):
        if name == "depth":
            _depth_panel(ax, report)
        else:
            _lr_panel(ax, report, lr_rows)
    for ax in axes[: len(panels) + len(extras)]:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in extra_axes[len(extras) :]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True
