"""Optimizer state and step time with the state sharded over a stage's replicas, against replicated state.

P = 2 stages x D = 2 replicas (4 gloo processes on the CPU, one intra-op thread each) train the demo GPT with
:class:`~lightning_async_pp.AsyncPipelineStrategy`, once with every replica holding its stage's whole optimizer
state and once with ``shard_optimizer=True`` (each replica keeps the state of a disjoint set of whole tensors:
the gradients are reduce-scattered to the owners, the owners step, the new weights are all-gathered). For AdamW,
this package's :class:`~lightning_async_pp.optim.Muon` and ``DelayCorrected(AdamW)``, per stage:

* optimizer-state bytes per rank after training (the bytes of the tensors in ``optimizer.state``): the
  replicated size, the sharded maximum and minimum over the stage's replicas, the ratio maximum / replicated
  (about ``1 / D``, plus at most the state of the largest tensor, which is given for context);
* seconds per step: on every rank the wall time between the ends of consecutive steps (Lightning's
  ``on_train_batch_end``) after ``--warmup`` steps, the median per rank, averaged over the stage's replicas;
  the median over repetitions, with and without sharding, and their ratio (sharded / replicated) as a ratio of
  medians and as the median of per-repetition ratios ("paired").

Every configuration is its own job (``--worker``; Lightning's launcher starts the other ranks); each rank
writes its numbers to a JSON file that this process aggregates. Repetitions are interleaved: per repetition
and optimizer the replicated and the sharded job run back to back, in alternating order, so a change of
machine load hits both alike. Muon's Newton-Schulz runs in float32 by default (``--ns-dtype``): bfloat16
matrix products are an order of magnitude slower on many CPUs.

Usage::

    python benchmarks/sharded_state.py --out benchmarks/results/sharded_state/sharded_state.json
    python benchmarks/sharded_state.py --quick --out /tmp/sharded_state.json  # tiny model, 1 repetition
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from bench_common import machine_description, save_report_and_table

ROOT = Path(__file__).resolve().parents[1]
OPTIMIZERS = ("adamw", "muon", "corrected_adamw")
P, D = 2, 2


def make_optimizer(name: str):
    from lightning_async_pp.optim import DelayCorrected, Muon

    if name == "adamw":
        return lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)
    if name == "muon":
        return lambda params: Muon(params, lr=0.02, adamw_lr=1e-3)
    if name == "corrected_adamw":
        return lambda params: DelayCorrected(torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1))
    raise ValueError(name)


def _tensor_bytes(state: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t))


def worker(args: argparse.Namespace) -> None:
    """One rank of one job (Lightning's launcher starts the others by running this command again)."""
    from lightning.pytorch import Callback, Trainer
    from torch.utils.data import DataLoader

    from lightning_async_pp import AsyncPipelineStrategy
    from lightning_async_pp.demos import GPT
    from lightning_async_pp.demos.data import random_token_batches
    from lightning_async_pp.optim.muon import newton_schulz_dtype

    torch.set_num_threads(1)
    step_ends: list[float] = []

    class StepClock(Callback):
        def on_train_batch_end(self, trainer: Trainer, module: Any, outputs: Any, batch: Any, index: int) -> None:
            step_ends.append(time.perf_counter())

    model = GPT(
        vocab_size=256,
        block_size=args.seq,
        n_layer=args.layers,
        n_head=args.heads,
        n_embd=args.width,
        lr_schedule="constant",
        optimizer=make_optimizer(args.optimizer),
    )
    strategy = AsyncPipelineStrategy(
        num_microbatches=args.microbatches,
        pipeline_parallel_size=P,
        shard_optimizer=args.shard,
        timeout=datetime.timedelta(minutes=5),
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=P * D,
        strategy=strategy,
        max_steps=args.warmup + args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[StepClock()],
        gradient_clip_val=args.clip or None,
    )
    # Each item is already a batch; each replica reads its shard of them (Lightning's DistributedSampler).
    batches = random_token_batches(D * (args.warmup + args.steps), batch_size=args.batch_size, block_size=args.seq)
    with newton_schulz_dtype(args.ns_dtype) if args.optimizer == "muon" else contextlib.nullcontext():
        trainer.fit(model, DataLoader(batches, batch_size=None, shuffle=False))

    optimizer = trainer.optimizers[0]
    per_tensor = [_tensor_bytes(s) for s in optimizer.state.values()]
    seconds = [b - a for a, b in zip(step_ends[args.warmup - 1 :], step_ends[args.warmup :])]
    record = {
        "rank": trainer.global_rank,
        "stage": strategy.stage,
        "state_bytes": sum(per_tensor),
        "largest_tensor_state_bytes": max(per_tensor, default=0),
        "tensors_stepped": sum(len(g["params"]) for g in optimizer.param_groups),
        "step_seconds": seconds,
    }
    Path(args.result_dir, f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def run_job(args: argparse.Namespace, optimizer: str, shard: bool, directory: Path) -> list[dict[str, Any]]:
    """One configuration's job; returns its ranks' records."""
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--optimizer", optimizer]
    command += ["--shard"] if shard else []
    for flag in (
        "layers",
        "width",
        "heads",
        "seq",
        "batch_size",
        "microbatches",
        "warmup",
        "steps",
        "ns_dtype",
        "clip",
    ):
        command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    command += ["--result-dir", str(directory)]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, env=env, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{optimizer} shard={shard} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    records = [json.loads((directory / f"rank{r}.json").read_text()) for r in range(P * D)]
    shutil.rmtree(directory, ignore_errors=True)
    return records


def job_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per stage: every replica's state bytes and the mean over replicas of their median step seconds."""
    stages: dict[str, Any] = {}
    for stage in range(P):
        ranks = sorted((r for r in records if r["stage"] == stage), key=lambda r: r["rank"])
        stages[str(stage)] = {
            "ranks": [r["rank"] for r in ranks],
            "state_bytes": [r["state_bytes"] for r in ranks],
            "largest_tensor_state_bytes": max(r["largest_tensor_state_bytes"] for r in ranks),
            "tensors_stepped": [r["tensors_stepped"] for r in ranks],
            "step_s": statistics.fmean(statistics.median(r["step_seconds"]) for r in ranks),
        }
    return stages


def aggregate(jobs: list[dict[str, Any]], optimizers: list[str]) -> list[dict[str, Any]]:
    """One row per optimizer and stage from every repetition of both configurations."""
    rows = []
    for name in optimizers:
        for stage in map(str, range(P)):
            runs = {
                shard: [j["stages"][stage] for j in jobs if j["optimizer"] == name and j["shard"] == shard]
                for shard in (False, True)
            }
            replicated = max(b for run in runs[False] for b in run["state_bytes"])
            sharded_max = max(b for run in runs[True] for b in run["state_bytes"])
            sharded_min = min(b for run in runs[True] for b in run["state_bytes"])
            step = {shard: [run["step_s"] for run in runs[shard]] for shard in (False, True)}
            paired = [s / u for u, s in zip(step[False], step[True])]
            rows.append(
                {
                    "optimizer": name,
                    "stage": int(stage),
                    "replicated_bytes": replicated,
                    "sharded_max_bytes": sharded_max,
                    "sharded_min_bytes": sharded_min,
                    "max_over_replicated": sharded_max / replicated,
                    "largest_tensor_state_bytes": runs[False][0]["largest_tensor_state_bytes"],
                    "step_s_unsharded": statistics.median(step[False]),
                    "step_s_sharded": statistics.median(step[True]),
                    "step_ratio": statistics.median(step[True]) / statistics.median(step[False]),
                    "step_ratio_paired": statistics.median(paired),
                    "step_s_unsharded_runs": step[False],
                    "step_s_sharded_runs": step[True],
                }
            )
    return rows


def markdown(report: dict[str, Any]) -> str:
    """The report's setup and table, as Markdown."""
    c, m = report["config"], report["machine"]
    lines = [
        f"P = {c['P']} stages x D = {c['D']} replicas (gloo, CPU, 1 thread per process); demo GPT "
        f"n_layer={c['layers']}, n_embd={c['width']}, n_head={c['heads']}, {c['parameters'] / 1e6:.2f}M "
        f"parameters; {c['batch_size']} sequences of {c['seq']} tokens per replica and step in "
        f"M = {c['microbatches']} micro-batches; {c['warmup']} warm-up + {c['steps']} timed steps; "
        f"{c['repeats']} interleaved repetitions; gradient clipping at {c.get('clip') or 'none'}; "
        f"Muon's Newton-Schulz in {c['ns_dtype']}; torch {m['torch']}; "
        f"{m['cores']} CPU cores ({m['cpu']}).",
        "",
        "| optimizer | stage | replicated bytes/rank | sharded max | sharded min | max/replicated "
        "| largest tensor's state | step s unsharded | step s sharded | ratio (paired) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['optimizer']} | {r['stage']} | {r['replicated_bytes']:,} | {r['sharded_max_bytes']:,} | "
            f"{r['sharded_min_bytes']:,} | {r['max_over_replicated']:.3f} | {r['largest_tensor_state_bytes']:,} | "
            f"{r['step_s_unsharded']:.3f} | {r['step_s_sharded']:.3f} | "
            f"{r['step_ratio']:.2f} ({r['step_ratio_paired']:.2f}) |"
        )
    return "\n".join(lines)


def orchestrate(args: argparse.Namespace) -> dict[str, Any]:
    from lightning_async_pp.demos import GPT

    scratch = Path(tempfile.mkdtemp(prefix="sharded_state_"))
    jobs, begin = [], time.perf_counter()
    try:
        for repeat in range(args.repeats):
            for name in args.optimizers:
                for shard in (False, True) if repeat % 2 == 0 else (True, False):
                    records = run_job(args, name, shard, scratch / f"{name}_{shard}_{repeat}")
                    jobs.append({"optimizer": name, "shard": shard, "repeat": repeat, "stages": job_summary(records)})
                    print(f"repetition {repeat} {name} shard={shard}: {time.perf_counter() - begin:.0f}s", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    model = GPT(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.width)
    config = {"P": P, "D": D, "parameters": sum(p.numel() for p in model.parameters()), "quick": args.quick}
    for key in ("layers", "width", "heads", "seq", "batch_size", "microbatches", "warmup", "steps", "repeats"):
        config[key] = getattr(args, key)
    config.update(ns_dtype=args.ns_dtype, clip=args.clip, optimizers=list(args.optimizers))
    return {
        "machine": machine_description(),
        "config": config,
        "rows": aggregate(jobs, args.optimizers),
        "jobs": jobs,
        "seconds": time.perf_counter() - begin,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=OPTIMIZERS)
    parser.add_argument("--layers", type=int, default=None, help="transformer blocks (default 4, quick 2)")
    parser.add_argument("--width", type=int, default=None, help="n_embd (default 256, quick 64)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per replica and step")
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=None, help="steps left out of the timing (default 3, quick 1)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 8, quick 2)")
    parser.add_argument("--repeats", type=int, default=None, help="repetitions of each job (default 2, quick 1)")
    parser.add_argument(
        "--clip", type=float, default=1.0, help="gradient_clip_val (0: none, the update stays in flight from UPDATE)"
    )
    parser.add_argument("--ns-dtype", default="float32", choices=["float32", "bfloat16"], help="Muon's Newton-Schulz")
    parser.add_argument("--quick", action="store_true", help="a tiny model, 1 repetition of 1 + 2 steps (smoke test)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per job before it is killed")
    parser.add_argument("--out", default=None, help="write the JSON report here")
    parser.add_argument("--markdown", default=None, help="write the Markdown table here (default: --out's .md)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--optimizer", default="adamw", help=argparse.SUPPRESS)
    parser.add_argument("--shard", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    defaults = {"layers": (4, 2), "width": (256, 64), "warmup": (3, 1), "steps": (8, 2), "repeats": (2, 1)}
    for key, (full, quick) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be >= 1")
    if args.worker:
        worker(args)
        return {}
    report = orchestrate(args)
    save_report_and_table(report, markdown(report), args.out, args.markdown)
    return report


if __name__ == "__main__":
    main()
