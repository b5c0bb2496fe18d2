"""The first run on a GPU machine: exactness, a deadlock probe, throughput against torch's 1F1B, memory.

    python scripts/gpu_check.py [--out gpu_check.json]          # every GPU of the machine (1 to 8), NCCL
    python scripts/gpu_check.py --cpu --out cpu_check.json      # the same checks on CPU (gloo, tiny model)

Checks, each recorded in one JSON file and printed as a table:

1. **exactness**: the test GPT trained 10 steps as a 2-stage pipeline (``"2bw"`` and ``"1f1b"``) against
   the single-device run of the same schedule (the delayed trajectory for 2BW). CPU runs match to 1e-5;
   GPU kernels are not bitwise deterministic, so GPUs pass at 1e-3 relative. Needs 2 GPUs.
2. **deadlock probe**: every stage count that fits (2 to the number of GPUs; 2 and 3 on CPU), 50 steps of
   2BW (and 1F1B at the largest count), each under a watchdog that kills a job making no progress.
   A hang here is what NCCL's point-to-point ordering causes and the gloo tests cannot show.
3. **throughput**: ``benchmarks/throughput.py`` with ``async_pp_2bw`` against
   ``torch.distributed.pipelining``'s ``Schedule1F1B`` at P = number of GPUs (2 on CPU) for
   M in {P, 2P, 4P}, on the demo GPT sized to be compute-bound on GPUs (``--width``/``--layers``), with
   each stage's bubble fraction and peak memory (GPU: ``torch.cuda.max_memory_allocated``).

Exit status 1 if a check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_common  # noqa: E402

from lightning_async_pp import AsyncPipelineStrategy  # noqa: E402
from tests.fixtures.helpers import fit, random_batches, tiny_gpt  # noqa: E402
from tests.multiprocess.scripts.pipeline_run import make_optimizer  # noqa: E402

EXACT = {"width": 64, "seq": 32, "batch": 16, "layers": 4, "steps": 10, "microbatches": 4}
PROBE = {"width": 64, "seq": 32, "layers": 8}  # batch: 2 samples per micro-batch
PROBE_STEPS = 50
GPU_MODEL = {"width": 1024, "layers": 16, "heads": 16, "seq": 512, "batch_size": 64, "warmup": 5, "steps": 20}
CPU_MODEL = {"width": 64, "layers": 4, "heads": 4, "seq": 32, "batch_size": 16, "warmup": 2, "steps": 6}


# The jobs import this checkout's package.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


def run_pipeline(
    accelerator: str, devices: int, schedule: str, microbatches: int, steps: int, out: Path, watchdog: float, size: dict
) -> dict:
    """One multi-process training job (tests/multiprocess/scripts/pipeline_run.py); raises on failure or when the
    watchdog fires."""
    command = [
        sys.executable,
        "-m",
        "tests.multiprocess.scripts.pipeline_run",
        "--accelerator",
        accelerator,
        "--devices",
        str(devices),
        "--schedule",
        schedule,
        "--microbatches",
        str(microbatches),
        "--steps",
        str(steps),
        "--optimizer",
        "adamw",
        "--width",
        str(size["width"]),
        "--seq",
        str(size["seq"]),
        "--batch-size",
        str(size["batch"]),
        "--layers",
        str(size["layers"]),
        "--out",
        str(out),
    ]
    code, output = run_ranks(command, devices, watchdog)
    if code != 0:
        raise RuntimeError(f"exit code {code}:\n{output[-3000:]}")
    result = json.loads((out / "losses.json").read_text())
    result["weights"] = {}
    for rank in range(devices):
        result["weights"].update(torch.load(out / f"weights_rank{rank}.pt"))
    return result


def run_ranks(command: list[str], ranks: int, watchdog: float) -> tuple[int, str]:
    """Start every rank of a job at once, as torchrun does (Lightning would start rank 0 and only then, once it
    has imported everything, the others: a start-up each job pays twice); a failure or the watchdog (which
    raises ``TimeoutError``) kills the whole job. Returns the exit status and the ranks' combined output."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(
        os.environ,
        PYTHONWARNINGS="ignore",
        OMP_NUM_THREADS="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(ranks),
        NODE_RANK="0",
    )
    logs = [tempfile.TemporaryFile("w+") for _ in range(ranks)]
    try:
        code = bench_common.run_ranks(
            command, [dict(env, RANK=str(r), LOCAL_RANK=str(r)) for r in range(ranks)], logs, watchdog
        )
        output = ""
        for rank, log in enumerate(logs):
            log.seek(0)
            output += f"--- rank {rank}\n" + log.read()[-4000:]
    finally:
        for log in logs:
            log.close()
    if code is None:
        raise TimeoutError(f"{Path(command[1]).name} made no progress for {watchdog}s:\n{output[-4000:]}")
    return code, output


def exactness(accelerator: str, tolerance: float) -> list[dict]:
    rows = []
    size = {**EXACT}
    for schedule in ("2bw", "1f1b"):
        row = {"check": "exactness", "schedule": schedule, "stages": 2, "microbatches": size["microbatches"]}
        try:
            with tempfile.TemporaryDirectory() as tmp:
                result = run_pipeline(
                    accelerator, 2, schedule, size["microbatches"], size["steps"], Path(tmp), 600, size
                )
            model = tiny_gpt(
                n_layer=size["layers"], n_embd=size["width"], block_size=size["seq"], optimizer=make_optimizer("adamw")
            )
            batches = random_batches(size["steps"], batch_size=size["batch"], block=size["seq"])
            strategy = AsyncPipelineStrategy(schedule=schedule, num_microbatches=size["microbatches"])
            ref_losses = fit(model, batches, strategy=strategy, accelerator=accelerator)
            ref_weights = {k: v.detach().cpu() for k, v in model.state_dict().items()}
            loss_diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(result["losses"], ref_losses, strict=True))
            # Elementwise, as torch.testing.assert_close: |a - b| <= atol + rtol * |b| with atol = rtol / 10.
            weight_err = max(
                float(
                    (
                        (result["weights"][k].float() - v.float()).abs()
                        / (tolerance / 10 + tolerance * v.float().abs())
                    ).max()
                )
                for k, v in ref_weights.items()
            )
            row.update(
                max_rel_loss_diff=loss_diff,
                weight_error_over_tolerance=weight_err,
                ok=loss_diff <= tolerance and weight_err <= 1.0,
            )
        except Exception as error:  # a failed check is reported, the others still run
            row.update(ok=False, error=str(error)[-3000:])
        rows.append(row)
    return rows


def deadlock_probe(accelerator: str, stage_counts: list[int]) -> list[dict]:
    rows = []
    jobs = [(P, "2bw") for P in stage_counts] + [(stage_counts[-1], "1f1b")]
    for P, schedule in jobs:
        row = {"check": "deadlock_probe", "schedule": schedule, "stages": P, "microbatches": P, "steps": PROBE_STEPS}
        started = time.perf_counter()
        try:
            with tempfile.TemporaryDirectory() as tmp:
                # The watchdog: a healthy job needs a few seconds of steps plus start-up.
                size = {**PROBE, "batch": 2 * P}
                result = run_pipeline(accelerator, P, schedule, P, PROBE_STEPS, Path(tmp), 300, size)
            bubbles = {s: round(sorted(b)[len(b) // 2], 3) for s, b in result["stage_bubbles"].items() if b}
            row.update(ok=len(result["losses"]) == PROBE_STEPS, bubble_fraction=bubbles)
        except Exception as error:
            row.update(ok=False, error=str(error)[-3000:])
        row["seconds"] = round(time.perf_counter() - started, 1)
        rows.append(row)
    return rows


def throughput(accelerator: str, stages: int, model: dict, repeats: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "throughput.json"
        command = [
            sys.executable,
            str(ROOT / "benchmarks" / "throughput.py"),
            "--accelerator",
            accelerator,
            "--stage-counts",
            str(stages),
            "--microbatch-counts",
            *[str(m * stages) for m in (1, 2, 4)],
            "--variants",
            "async_pp_2bw",
            "torch_1f1b",
            "--no-overhead",
            "--no-simulate",
            "--no-with-corrected",
            "--repeats",
            str(repeats),
            "--out",
            str(out),
            *[x for key, value in model.items() for x in (f"--{key.replace('_', '-')}", str(value))],
        ]
        done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0 or not out.exists():
            return [{"check": "throughput", "ok": False, "error": (done.stdout + done.stderr)[-3000:]}]
        report = json.loads(out.read_text())
    rows = []
    for r in report["results"]:
        if r["name"] not in ("async_pp_2bw", "torch_1f1b"):
            continue
        memory = r.get("peak_gpu_mb") if accelerator == "gpu" else r.get("peak_heap_mb")
        rows.append(
            {
                "check": "throughput",
                "variant": r["name"],
                "stages": r["num_stages"],
                "microbatches": r["num_microbatches"],
                "tokens_per_sec": r["tokens_per_sec"],
                "bubble_fraction": r["bubble_fraction"],
                "peak_memory_mb": memory,
                "ok": r["tokens_per_sec"] is not None,
            }
        )
    for row in rows:
        if row["variant"] == "async_pp_2bw":
            peer = next(
                (x for x in rows if x["variant"] == "torch_1f1b" and x["microbatches"] == row["microbatches"]), None
            )
            if peer and peer["tokens_per_sec"]:
                row["vs_torch_1f1b"] = row["tokens_per_sec"] / peer["tokens_per_sec"]
    return rows


def _fmt(value, spec: str = ".3g") -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_fmt(v, spec) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_fmt(v, spec)}" for k, v in value.items()) + "}"
    return format(value, spec) if isinstance(value, float) else str(value)


def print_table(rows: list[dict]) -> None:
    print(f"{'check':<15} {'ok':<5} {'P':>2} {'M':>3} {'schedule/variant':<17} result")
    for row in rows:
        name = row.get("schedule") or row.get("variant", "")
        details = {
            k: v
            for k, v in row.items()
            if k not in ("check", "ok", "stages", "microbatches", "schedule", "variant", "error")
        }
        line = f"{row['check']:<15} {str(row['ok']):<5} {row.get('stages', ''):>2} "
        line += f"{row.get('microbatches', ''):>3} {name:<17} "
        print(line + " ".join(f"{k}={_fmt(v)}" for k, v in details.items()))
        if "error" in row:
            print("    " + row["error"].strip().splitlines()[-1][:300])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="run the checks on CPU (gloo, tiny model)")
    parser.add_argument("--out", default="gpu_check.json")
    parser.add_argument("--repeats", type=int, default=None, help="throughput repetitions (GPU 3, CPU 1)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    if args.cpu:
        torch.set_num_threads(1)  # as every pipeline process: the reference then computes the same sums
        accelerator, count, tolerance, model = "cpu", 2, 1e-5, CPU_MODEL
        stage_counts, device = [2, 3], "cpu"
    else:
        count = torch.cuda.device_count()
        if count < 1:
            sys.exit("No GPU found; run with --cpu for the CPU version of these checks.")
        accelerator, tolerance, model = "gpu", 1e-3, GPU_MODEL
        stage_counts, device = list(range(2, count + 1)), torch.cuda.get_device_name(0)
    rows: list[dict] = []
    if count >= 2:
        rows += exactness(accelerator, tolerance)
        rows += deadlock_probe(accelerator, stage_counts)
        rows += throughput(accelerator, count, model, args.repeats or (1 if args.cpu else 3))
    else:
        print("One GPU: the pipeline checks need at least 2; nothing to run beyond device discovery.")
    report = {
        "accelerator": accelerator,
        "devices": count,
        "device": device,
        "torch": torch.__version__,
        "seconds": round(time.perf_counter() - started, 1),
        "ok": all(r["ok"] for r in rows),
        "results": rows,
    }
    print_table(rows)
    Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    print(f"{'all checks passed' if report['ok'] else 'SOME CHECKS FAILED'} in {report['seconds']} s; wrote {args.out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
