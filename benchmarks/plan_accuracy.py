"""How close ``python -m lightning_async_pp plan`` comes to what a run measures.

Memory: for each configuration, the plan's per-stage peak (read on the meta device) against the stage's
measured heap peak, in one CPU run of a few steps: glibc's heap in use (the throughput benchmark's
:class:`HeapPeak`, sampled after every forward, backward and update) above its level when the stage starts
(Lightning's ``setup`` hook, before the stage's layers are materialised). Each configuration is the YAML config
(``examples/configs/quickstart.yaml``, the demo GPT; ``examples/configs/llama_tiny.yaml``, a tiny Llama) with
overrides for the schedule, the pipeline depth, the replicas, ``shard_optimizer`` and activation checkpointing.
The plan also counts what a sample between actions cannot see (nothing of a kernel's own temporaries), so the
ratio ``predicted / measured`` is what the table reports.

Time: the plan's step time (the simulator fed each stage's forward time, backward = 2 x forward) for the
cells of the emulated-device benchmark (``benchmarks/results/emulated/emulated.json``, ``ours_2bw`` and
``ours_1f1b``, ``P <= 8``), whose layers sleep a known time per micro-batch, against their measured step times.
No new runs are needed for it.

Usage::

    python benchmarks/plan_accuracy.py --out benchmarks/results/plan_accuracy/plan_accuracy.json
    python benchmarks/plan_accuracy.py --quick ...   # the quick start GPT only
    python benchmarks/plan_accuracy.py --variants bf16 --out .../plan_accuracy_bf16.json  # GPT, bf16-mixed

The ``bf16`` rows test the plan's count of autocast's low-precision copies of the weights: one per weight
version held, shared by the micro-batches that read it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import heap_in_use, machine_description, save_report  # noqa: E402

MODELS = {"gpt": "examples/configs/quickstart.yaml", "llama": "examples/configs/llama_tiny.yaml"}
# (name, P, D, shard_optimizer, activation_checkpointing, precision)
VARIANTS = [
    ("plain", 2, 1, False, False, "32-true"),
    ("recompute", 2, 1, False, True, "32-true"),
    ("sharded_D2", 2, 2, True, False, "32-true"),
    ("plain_P3", 3, 1, False, False, "32-true"),
    ("bf16", 2, 1, False, False, "bf16-mixed"),
]
DEFAULT_VARIANTS = "plain,recompute,sharded_D2,plain_P3"
RUN_ARGS = [
    "--trainer.max_steps",
    "4",
    "--trainer.logger",
    "false",
    "--trainer.enable_checkpointing",
    "false",
    "--trainer.limit_val_batches",
    "0",
    "--trainer.enable_progress_bar",
    "false",
    "--trainer.enable_model_summary",
    "false",
]


def cell_args(
    model: str, schedule: str, stages: int, replicas: int, shard: bool, recompute: bool, precision: str
) -> list[str]:
    """The ``fit`` arguments of one cell (the plan reads the same)."""
    prefix = "--trainer.strategy.init_args."
    return [
        "--trainer.precision",
        precision,
        "--config",
        str(ROOT / MODELS[model]),
        "--trainer.devices",
        str(stages * replicas),
        f"{prefix}schedule",
        schedule,
        f"{prefix}pipeline_parallel_size",
        str(stages),
        f"{prefix}shard_optimizer",
        str(shard).lower(),
        f"{prefix}activation_checkpointing",
        str(recompute).lower(),
    ]


# ------------------------------------------------------------------------------------------ the measured run


def worker(out_dir: str, args: list[str]) -> None:
    """One rank of a short ``fit`` of ``args``: writes its stage's heap peak above its start."""
    import torch
    from lightning.pytorch import Callback, LightningDataModule, LightningModule
    from throughput import HeapPeak

    from lightning_async_pp.cli import AsyncPipelineCLI
    from lightning_async_pp.runtime import register_action_observer
    from lightning_async_pp.schedule import Op

    torch.set_num_threads(1)
    heap = HeapPeak()
    sampled = (Op.FORWARD, Op.BACKWARD, Op.UPDATE)
    register_action_observer(lambda action, begin, end: heap.sample() if action.op in sampled else None)

    class Start(Callback):
        def setup(self, trainer, pl_module, stage) -> None:
            self.heap = heap_in_use()

    start = Start()
    cli = AsyncPipelineCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_callback=None,
        run=False,
        args=args,
    )
    cli.trainer.callbacks.append(start)
    cli.trainer.fit(cli.model, cli.datamodule)
    strategy = cli.trainer.strategy
    record = {"stage": strategy.stage, "rank": cli.trainer.global_rank, "peak_mib": (heap.peak - start.heap) / 2**20}
    Path(out_dir, f"rank{cli.trainer.global_rank}.json").write_text(json.dumps(record))


def measure(args: list[str], ranks: int, timeout: float) -> dict[int, float]:
    """Per stage, the largest heap peak of its replicas in a short run of ``args``."""
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        command = [sys.executable, __file__, "--worker", out, "--", *args, *RUN_ARGS]
        done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        files = sorted(Path(out).glob("rank*.json"))
        if done.returncode != 0 or len(files) != ranks:
            raise RuntimeError(f"run failed ({done.returncode}): {done.stderr[-3000:]}")
        peaks: dict[int, float] = {}
        for f in files:
            record = json.loads(f.read_text())
            peaks[record["stage"]] = max(peaks.get(record["stage"], 0.0), record["peak_mib"])
        return peaks


def predict(args: list[str]) -> list[tuple[float, float]]:
    """Per stage, the plan's peak (MiB) for ``args``, and the same without recomputation's transient (which a
    heap sampled between actions cannot see: it lives inside a backward)."""
    import contextlib
    import io

    from lightning_async_pp.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["plan", *args, "--json", "--reserved", "0"])
    report = json.loads(out.getvalue())
    kind = report["setting"]["schedule"]
    stages = report["schedules"][kind]["stages"]
    return [(s["total"] / 2**20, (s["total"] - s["recompute_transient"]) / 2**20) for s in stages]


def memory_rows(cells: list[tuple[str, tuple]], timeout: float) -> list[dict[str, Any]]:
    rows = []
    for model, (name, stages, replicas, shard, recompute, precision) in cells:
        for schedule in ("2bw", "1f1b"):
            args = cell_args(model, schedule, stages, replicas, shard, recompute, precision)
            began = time.perf_counter()
            predicted = predict(args)
            try:
                measured = measure(args, stages * replicas, timeout)
            except (RuntimeError, subprocess.TimeoutExpired) as error:
                rows.append({"model": model, "variant": name, "schedule": schedule, "error": str(error)[-500:]})
                print(json.dumps(rows[-1]), flush=True)
                continue
            for stage, (value, between) in enumerate(predicted):
                rows.append(
                    {
                        "model": model,
                        "variant": name,
                        "schedule": schedule,
                        "P": stages,
                        "D": replicas,
                        "stage": stage,
                        "predicted_mib": value,
                        "predicted_between_actions_mib": between,
                        "measured_mib": measured[stage],
                        "ratio": value / measured[stage],
                        "ratio_between_actions": between / measured[stage],
                        "seconds": time.perf_counter() - began,
                    }
                )
            print(json.dumps(rows[-1]), flush=True)
    return rows


# ------------------------------------------------------------------------------------------ step time


def time_rows(path: Path) -> list[dict[str, Any]]:
    """The plan's step time against the emulated benchmark's measured cells (``P <= 8``)."""
    from lightning_async_pp.schedule.plan import predict_time
    from lightning_async_pp.schedule.simulate import StageCosts

    report = json.loads(path.read_text())
    costs = report["config"]["costs"]
    forward = costs["forward"]
    backward_ratio = (costs["input"] + costs["weight"]) / forward
    rows = []
    for cell in report["results"]:
        kind = {"ours_2bw": "2bw", "ours_1f1b": "1f1b"}.get(cell["name"])
        if kind is None or cell["num_stages"] > 8:
            continue
        P, M = cell["num_stages"], cell["num_microbatches"]
        predicted = predict_time([forward] * P, kind, M, backward_ratio=backward_ratio).step_seconds * 1e3
        host = cell["host_ms_by_call"]
        overhead = [
            StageCosts(f / 1e3, b / 1e3, u / 1e3)
            for f, b, u in zip(host["forward_per_microbatch"], host["backward_per_microbatch"], host["update_per_step"])
        ]
        with_host = predict_time([forward] * P, kind, M, backward_ratio=backward_ratio, overhead=overhead)
        rows.append(
            {
                "schedule": kind,
                "P": P,
                "M": M,
                "predicted_ms": predicted,
                "predicted_with_host_ms": with_host.step_seconds * 1e3,
                "measured_ms": cell["step_ms"],
                "error": predicted / cell["step_ms"] - 1,
                "error_with_host": with_host.step_seconds * 1e3 / cell["step_ms"] - 1,
            }
        )
    return rows


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "# plan against measurement",
        "",
        f"Memory: {report['memory_note']}",
        "",
        "| model | variant | schedule | P x D | stage | predicted MiB | between actions | measured MiB | "
        "predicted / measured | between actions / measured |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["memory"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['variant']} | {r['schedule']} | failed | | | | | | |")
            continue
        lines.append(
            f"| {r['model']} | {r['variant']} | {r['schedule']} | {r['P']} x {r['D']} | {r['stage']} | "
            f"{r['predicted_mib']:.2f} | {r['predicted_between_actions_mib']:.2f} | {r['measured_mib']:.2f} | "
            f"{r['ratio']:.2f} | {r['ratio_between_actions']:.2f} |"
        )
    lines += [
        "",
        "Step time: the plan's simulator against the emulated-device benchmark's measured cells "
        "(benchmarks/results/emulated/emulated.json, P <= 8): fed the layers' time alone (what `plan` predicts "
        "from FLOPs), and fed besides the host time each cell measured inside its forward, backward and update "
        "calls (`host_ms_by_call`, what `plan --overhead-ms` adds).",
        "",
        "| schedule | P | M | predicted ms | measured ms | error | predicted with host time ms | error |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["time"]:
        lines.append(
            f"| {r['schedule']} | {r['P']} | {r['M']} | {r['predicted_ms']:.1f} | {r['measured_ms']:.1f} | "
            f"{r['error']:+.1%} | {r['predicted_with_host_ms']:.1f} | {r['error_with_host']:+.1%} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[4:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/plan_accuracy/plan_accuracy.json")
    parser.add_argument("--quick", action="store_true", help="the quick start GPT only, without sharding")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per run")
    parser.add_argument(
        "--variants",
        help=f"comma-separated rows of VARIANTS (default {DEFAULT_VARIANTS}; 'bf16' runs the GPT under bf16-mixed)",
    )
    parser.add_argument("--memory-from", help="an earlier report whose memory rows to keep (no runs)")
    args = parser.parse_args()
    began = time.perf_counter()
    models = ["gpt"] if args.quick else list(MODELS)
    chosen = (args.variants or ("plain,recompute" if args.quick else DEFAULT_VARIANTS)).split(",")
    variants = [v for v in VARIANTS if v[0] in chosen]
    # Every model at P = 2 (plain, recompute, sharded over 2 replicas); P = 3 and bf16 for the GPT only, for time.
    cells = [(m, v) for m in models for v in variants if m == "gpt" or v[0] in ("plain", "recompute", "sharded_D2")]
    report = {
        "machine": machine_description(),
        "memory_note": "heap peak per stage above its start, sampled after every forward, backward and update, in "
        "a 4-step CPU run of the config with the overrides of its row (32-true unless the row says bf16).",
        "memory": json.loads(Path(args.memory_from).read_text())["memory"]
        if args.memory_from
        else memory_rows(cells, args.timeout),
        "time": time_rows(ROOT / "benchmarks/results/emulated/emulated.json"),
    }
    report["seconds"] = time.perf_counter() - began
    save_report(report, args.out)
    Path(args.out).with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
