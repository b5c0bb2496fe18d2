"""The report's summaries of the runs: the main table, the learning-rate grid, the c sweep, the automatic
coefficients, Muon's parts, depth, momentum and the real pipeline against its simulation."""

from __future__ import annotations

import math
import statistics
from typing import Any

from .spec import DEFAULT_MOMENTUM, MODES, OPTIMIZERS


def _loss(result: dict[str, Any]) -> float:
    value = result["final_val_loss"]
    return math.inf if value is None else value


def _mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and standard deviation; NaN when a value is missing (a run not made), inf when one diverged."""
    if not values or any(math.isnan(v) for v in values):
        return math.nan, math.nan
    if not all(math.isfinite(v) for v in values):
        return math.inf, math.nan
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summarize_grid(runs: list[dict[str, Any]], seeds: list[int], kind: str = "main") -> dict[str, Any]:
    """Per optimizer: mean/std of each mode, per-seed paired gaps, and the share of the gap recovered.

    Each corrected mode ``m`` (``delayed_corrected``, ``delayed_auto``) gets ``gap_<suffix>``,
    ``recovered_share[_<suffix>]`` and ``<...>_vs_sync_percent`` (suffix ``corrected`` / ``auto``; the
    ``delayed_corrected`` keys keep their historical names).
    """
    table: dict[str, Any] = {}
    for opt in OPTIMIZERS:
        by = {(r["mode"], r["seed"]): _loss(r) for r in runs if r["optimizer"] == opt and r["kind"] == kind}
        if not by:
            continue
        cell: dict[str, Any] = {"lr": next(r["lr"] for r in runs if r["optimizer"] == opt and r["kind"] == kind)}
        nan = [math.nan] * len(seeds)
        for mode in MODES:
            values = [by[(mode, s)] for s in seeds] if all((mode, s) in by for s in seeds) else None
            mean, std = _mean_std(values) if values else (math.nan, math.nan)
            cell[mode] = {"mean": mean, "std": std, "per_seed": values, "ran": values is not None}
        sync = cell["sync"]["per_seed"] or nan
        gap = [a - b for a, b in zip(cell["delayed"]["per_seed"] or nan, sync)]
        cell["gap"] = dict(zip(("mean", "std"), _mean_std(gap)), ran=cell["delayed"]["ran"] and cell["sync"]["ran"])
        g = cell["gap"]["mean"]
        for mode, suffix in (("delayed_corrected", "corrected"), ("delayed_auto", "auto")):
            share_key = "recovered_share" if suffix == "corrected" else "recovered_share_auto"
            gap_corr = [a - b for a, b in zip(cell[mode]["per_seed"] or nan, sync)]
            cell[f"gap_{suffix}"] = dict(
                zip(("mean", "std"), _mean_std(gap_corr)), ran=cell[mode]["ran"] and cell["sync"]["ran"]
            )
            gc = cell[f"gap_{suffix}"]["mean"]
            cell[share_key] = (g - gc) / g if math.isfinite(g) and math.isfinite(gc) and g > 0 else None
            cell[f"{share_key}_per_seed"] = [
                (a - b) / a for a, b in zip(gap, gap_corr) if math.isfinite(a) and math.isfinite(b) and a > 0
            ]
            mean_sync = cell["sync"]["mean"]
            cell[f"{suffix}_vs_sync_percent"] = (
                100 * gc / mean_sync if math.isfinite(gc) and math.isfinite(mean_sync) else None
            )
        table[opt] = cell
    return table


def _correction_row(coefficient: float | str, values: list[float], sync: list[float], delayed: list[float]) -> dict:
    """One row of the c sweep: the mean final loss of ``values``, its paired gap to sync, the share recovered."""
    gap = _mean_std([a - b for a, b in zip(values, sync)])[0]
    gap_delayed = _mean_std([a - b for a, b in zip(delayed, sync)])[0]
    return {
        "coefficient": coefficient,
        "final_val_loss": _mean_std(values)[0],
        "gap": gap,
        "recovered_share": (gap_delayed - gap) / gap_delayed
        if math.isfinite(gap) and math.isfinite(gap_delayed) and gap_delayed > 0
        else None,
    }


def summarize_corrections(runs: list[dict[str, Any]], seeds: list[int]) -> dict[str, Any]:
    """Per optimizer: the final loss, gap and recovered share for each fixed coefficient c of the sweep, and
    for ``auto``.

    ``c = 0`` is the ``delayed`` run and ``c = 1`` the ``delayed_corrected`` run of the main grid.
    """
    out: dict[str, Any] = {}
    for opt in OPTIMIZERS:
        pool = [r for r in runs if r["optimizer"] == opt and r["kind"] in ("main", "correction_sweep")]
        if not any(r["kind"] == "correction_sweep" for r in pool):
            continue
        main_lr = next(r["lr"] for r in pool if r["kind"] == "main")
        pool = [r for r in pool if r["lr"] == main_lr]

        def losses(match) -> list[float] | None:
            values = {r["seed"]: _loss(r) for r in pool if match(r)}
            return [values[s] for s in seeds] if all(s in values for s in seeds) else None

        sync = losses(lambda r: r["mode"] == "sync")
        delayed = losses(lambda r: r["mode"] == "delayed")
        if sync is None or delayed is None:
            continue
        coefficients = sorted({0.0} | {r["correction"] for r in pool if r["mode"] == "delayed_corrected"})
        rows = []
        for c in coefficients:
            values = delayed if c == 0 else losses(lambda r: r["mode"] == "delayed_corrected" and r["correction"] == c)
            if values is not None:
                rows.append(_correction_row(c, values, sync, delayed))
        auto = losses(lambda r: r["mode"] == "delayed_auto")
        if auto is not None:
            rows.append(_correction_row("auto", auto, sync, delayed))
        out[opt] = rows
    return out


def summarize_auto_coefficients(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per optimizer: the spread of the final automatic coefficients over tensors (main grid, all seeds)."""
    out: dict[str, Any] = {}
    for opt in OPTIMIZERS:
        values = sorted(
            v
            for r in runs
            if r["optimizer"] == opt and r["kind"] == "main" and r.get("auto_coefficients")
            for v in r["auto_coefficients"].values()
        )
        if values:
            out[opt] = {
                "min": values[0],
                "median": statistics.median(values),
                "max": values[-1],
                "tensors": len(values),
            }
    return out


def summarize_lr_grid(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per optimizer and grid learning rate: the sync loss, and the delayed loss and gap where they were run."""
    out: dict[str, Any] = {}
    for opt in OPTIMIZERS:
        grid = [r for r in runs if r["optimizer"] == opt and r["kind"] == "lr_grid"]
        rows = []
        for lr in sorted({r["lr"] for r in grid if r["mode"] == "sync"}):
            sync = next(_loss(r) for r in grid if r["lr"] == lr and r["mode"] == "sync")
            delayed = [_loss(r) for r in grid if r["lr"] == lr and r["mode"] == "delayed"]
            row = {"lr": lr, "final_val_loss": sync}
            if delayed:
                row.update(delayed=delayed[0], gap=delayed[0] - sync)
            rows.append(row)
        if rows:
            out[opt] = rows
    return out


def summarize_muon_parts(runs: list[dict[str, Any]], seed: int) -> dict[str, Any]:
    """Muon, one seed: the loss and gap to sync with every parameter, only the matrices or only the AdamW part
    one step stale."""
    pool = {
        r["mode"]: _loss(r)
        for r in runs
        if r["optimizer"] == "muon"
        and r["seed"] == seed
        and r["kind"] in ("main", "muon_parts")
        and r["momentum"] == DEFAULT_MOMENTUM["muon"]
    }
    if "sync" not in pool:
        return {}
    return {
        mode: {"loss": pool[mode], "gap": pool[mode] - pool["sync"]}
        for mode in ("delayed", "delayed_matrices_only", "delayed_adamw_only")
        if mode in pool
    }


def summarize_depth(runs: list[dict[str, Any]], depths: list[int], depth_seeds: list[int]) -> dict[str, Any]:
    """Per optimizer and depth P: the gap to sync under the original PipeDream profile, next to 2BW's."""
    out: dict[str, Any] = {}
    for opt in OPTIMIZERS:
        main = {(r["mode"], r["seed"]): _loss(r) for r in runs if r["optimizer"] == opt and r["kind"] == "main"}
        pd = {(r["stages"], r["seed"]): _loss(r) for r in runs if r["optimizer"] == opt and r["kind"] == "depth"}
        if not pd:
            continue
        rows = []
        for p in depths:
            gaps = [pd[(p, s)] - main[("sync", s)] for s in depth_seeds]
            gaps_2bw = [main[("delayed", s)] - main[("sync", s)] for s in depth_seeds]
            rows.append(
                {
                    "stages": p,
                    "pipedream_loss": _mean_std([pd[(p, s)] for s in depth_seeds])[0],
                    "pipedream_gap": _mean_std(gaps)[0],
                    "pipedream_gap_std": _mean_std(gaps)[1],
                    "2bw_gap": _mean_std(gaps_2bw)[0],
                }
            )
        out[opt] = rows
    return out


def summarize_momentum(runs: list[dict[str, Any]], seed: int) -> dict[str, Any]:
    """Per optimizer and momentum (one seed): the sync and delayed losses and their gap."""
    out: dict[str, Any] = {}
    for opt in OPTIMIZERS:
        pool = [r for r in runs if r["optimizer"] == opt and r["seed"] == seed and r["kind"] in ("main", "momentum")]
        values = sorted({r["momentum"] for r in pool if r["kind"] == "momentum"} | {DEFAULT_MOMENTUM[opt]})
        rows = []
        for m in values:
            sync = [_loss(r) for r in pool if r["momentum"] == m and r["mode"] == "sync"]
            delayed = [_loss(r) for r in pool if r["momentum"] == m and r["mode"] == "delayed"]
            if sync and delayed:
                rows.append({"momentum": m, "sync": sync[0], "delayed": delayed[0], "gap": delayed[0] - sync[0]})
        if len(rows) > 1:
            out[opt] = rows
    return out


def compare_pipeline(pipeline: dict[str, Any], simulated: dict[str, Any]) -> dict[str, Any]:
    """The real 2-process pipeline run against its one-device simulation: largest deviations of the losses."""
    sim_val = dict((s, v) for s, v in simulated["val_curve"])
    val_dev = [
        abs(v - sim_val[s])
        for s, v in pipeline["val_curve"]
        if s in sim_val and v is not None and sim_val[s] is not None
    ]
    train_dev = [
        abs(a - b) for a, b in zip(pipeline["train_loss"], simulated["train_loss"]) if a is not None and b is not None
    ]
    return {
        "optimizer": pipeline["optimizer"],
        "mode": pipeline["mode"],
        "seed": pipeline["seed"],
        "val_points": len(val_dev),
        "max_abs_val_loss_deviation": max(val_dev, default=None),
        "train_steps": len(train_dev),
        "max_abs_train_loss_deviation": max(train_dev, default=None),
        "final_val_loss_pipeline": pipeline["final_val_loss"],
        "final_val_loss_simulated": simulated["final_val_loss"],
        "wall_s_pipeline": pipeline["wall_s"],
        "wall_s_simulated": simulated["wall_s"],
    }


def finite_or_none(value: Any) -> Any:
    """The report with every non-finite float replaced by ``None`` (valid JSON)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    return value
