"""The command line: the grid, one job per ``P`` (see :mod:`.worker`), the report, the Markdown and the plot."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.bench_common import machine_description, run_ranks, save_report

from . import grid, report

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = "benchmarks/results/emulated/emulated.json"
# Variables of an enclosing launcher (torchrun, Lightning, another benchmark) that must not reach the job.
LAUNCHER_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "PL_GLOBAL_SEED")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.emulated",
        description="Pipeline schedules on emulated devices (layers that sleep): ours against torch's.",
    )
    parser.add_argument(
        "--quick", action="store_true", help="P=2 and 4, M=P, 2 repetitions, 1 ms sleeps (a smoke run, ~20 s)"
    )
    parser.add_argument("--stages", type=int, nargs="+", default=None, help="P values (default 2 4 8 16)")
    parser.add_argument("--multipliers", type=int, nargs="+", default=None, help="M = k P for each k (default 1 2 4)")
    parser.add_argument("--schedules", nargs="+", default=list(grid.SCHEDULES), choices=grid.SCHEDULES)
    parser.add_argument("--repeats", type=int, default=None, help="interleaved repetitions (default 5, quick 2)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps at the start of each repetition")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per repetition")
    parser.add_argument("--forward-ms", type=float, default=None, help="per stage and micro-batch (default 5, quick 1)")
    parser.add_argument("--input-grad-ms", type=float, default=None, help="(default 5, quick 1)")
    parser.add_argument("--weight-grad-ms", type=float, default=None, help="(default 5, quick 1)")
    parser.add_argument("--last-stage-factor", type=float, default=1.0, help="the last stage's costs times this")
    parser.add_argument(
        "--stage-factors", type=float, nargs="+", default=None, help="each stage's costs times this (one per stage)"
    )
    parser.add_argument("--layers-per-stage", type=int, default=2, help="a multiple of 2 (the virtual stages)")
    parser.add_argument("--width", type=int, default=256, help="features per activation row")
    parser.add_argument("--activation-kib", type=float, default=64.0, help="one micro-batch's activation")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per job (default: from the grid)")
    parser.add_argument("--out", default=None, help=f"the JSON report (default {DEFAULT_OUT}; quick: none)")
    parser.add_argument("--markdown", default=None, help="also write the Markdown tables here")
    parser.add_argument("--png", default=None, help="the plot of efficiency against P (needs matplotlib)")
    parser.add_argument("--render", default=None, metavar="JSON", help="print a saved report's Markdown and exit")
    parser.add_argument("--worker-spec", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quick = args.quick
    args.stages = args.stages or ([2, 4] if quick else [2, 4, 8, 16])
    args.multipliers = args.multipliers or ([1] if quick else [1, 2, 4])
    args.repeats = args.repeats or (2 if quick else 5)
    for name in ("forward_ms", "input_grad_ms", "weight_grad_ms"):
        if getattr(args, name) is None:
            setattr(args, name, 1.0 if quick else 5.0)
    if args.warmup < 1 or args.steps < 1 or args.repeats < 1:
        parser.error("--warmup, --steps and --repeats must be >= 1")
    if args.stage_factors is not None and len(args.stages) != 1:
        parser.error("--stage-factors gives one factor per stage: run a single P (--stages P)")
    try:
        grid.check_layers_per_stage(args.layers_per_stage)
        grid.Costs(1, 1, 1, args.stage_factors).stage(0, args.stages[0])
    except ValueError as err:
        parser.error(str(err))
    rows = args.activation_kib * 1024 / (4 * args.width)
    if rows < 1 or rows != int(rows):
        parser.error(f"--activation-kib must be a whole number of rows of {args.width} float32 ({args.width * 4} B)")
    args.rows = int(rows)
    return args


def job_spec(args: argparse.Namespace) -> dict[str, Any]:
    """What every rank of a job needs to know (the same for every ``P``, apart from ``P`` itself)."""
    return {
        "schedules": args.schedules,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "steps": args.steps,
        "layers_per_stage": args.layers_per_stage,
        "width": args.width,
        "rows": args.rows,
        "cores": os.cpu_count() or 1,
        "costs": {
            "forward": args.forward_ms / 1e3,
            "input": args.input_grad_ms / 1e3,
            "weight": args.weight_grad_ms / 1e3,
            "stage_factors": args.stage_factors,
            "last_stage_factor": args.last_stage_factor,
        },
    }


def estimated_seconds(P: int, spec: dict[str, Any]) -> float:
    """A generous guess of one job's length: every cell at 1F1B's bubble plus twice the pipeline's fill, and
    the ranks' start (a few seconds of CPU each, on however many cores there are)."""
    costs = grid.Costs(**spec["costs"])
    per_mb = max(c.total for c in costs.layers(P, 1))
    steps = (spec["warmup"] + spec["steps"]) * spec["repeats"] * len(spec["schedules"])
    running = sum(steps * (M + 2 * P) * per_mb for M in spec["microbatch_counts"])
    return running + 4.0 * P / max(1, os.cpu_count() or 1) + 10.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(P: int, spec: dict[str, Any], workdir: Path, timeout: float) -> tuple[list[dict], str | None]:
    """Start the ``P`` ranks of one job; their records (what came back before a failure too) and any error."""
    job = workdir / f"P{P}"
    job.mkdir(parents=True)
    (job / "spec.json").write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(P))
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "benchmarks.emulated", "--worker-spec", str(job / "spec.json")]
    logs = [open(job / f"rank{r}.log", "w") for r in range(P)]
    try:
        code = run_ranks(command, [dict(env, RANK=str(r)) for r in range(P)], logs, timeout, cwd=str(ROOT))
    finally:
        for log in logs:
            log.close()
    records = [
        json.loads(line)
        for r in range(P)
        if (job / f"rank{r}.jsonl").exists()
        for line in (job / f"rank{r}.jsonl").read_text().splitlines()
        if line.strip()
    ]
    if code == 0:
        return records, None
    tail = "".join((job / f"rank{r}.log").read_text()[-1500:] for r in range(P))
    return records, f"P={P}: {'timed out' if code is None else f'exit code {code}'}\n{tail}"


def machine_state() -> dict[str, Any]:
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return dict(machine_description(), loadavg=load)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    base = job_spec(args)
    started, before = time.perf_counter(), machine_state()
    records, errors, seconds = [], [], {}
    workdir = Path(tempfile.mkdtemp(prefix="emulated_pp_"))
    try:
        for P in args.stages:
            spec = dict(base, microbatch_counts=[k * P for k in args.multipliers])
            timeout = args.timeout or 3 * estimated_seconds(P, spec) + 60
            t0 = time.perf_counter()
            got, error = run_job(P, spec, workdir, timeout)
            seconds[str(P)] = time.perf_counter() - t0
            print(f"P={P}: {len(got)} records in {seconds[str(P)]:.0f} s" + (" (FAILED)" if error else ""), flush=True)
            records += got
            if error:
                errors.append(error)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    results, skipped = report.aggregate(records, base)
    config = {k: v for k, v in base.items() if k != "rows"}
    config.update(
        stages=args.stages,
        multipliers=args.multipliers,
        activation_kib=args.activation_kib,
        quick=args.quick,
        threads_per_process=1,
    )
    return {
        "config": config,
        "machine": {"before": before, "after": machine_state()},
        "results": results,
        "skipped": skipped,
        "errors": errors,
        "job_seconds": seconds,
        "seconds": time.perf_counter() - started,
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any] | None:
    args = parse_args(argv)
    if args.worker_spec:
        from .worker import main_worker

        main_worker(args.worker_spec)
        return None
    if args.render:
        saved = json.loads(Path(args.render).read_text())
        print(report.markdown(saved))
        return saved
    result = measure(args)
    text = report.markdown(result)
    print(text)
    out = args.out or (None if args.quick else DEFAULT_OUT)
    if args.png:
        why = report.plot(result["results"], args.png)
        print(why or f"plot written to {args.png}")
        result["plot"] = why or Path(args.png).name
    save_report(result, out)
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(text + "\n")
    for error in result["errors"]:
        print(error, file=sys.stderr)
    return result
