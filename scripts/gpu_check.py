"""The first run on a GPU machine: what matters on NCCL and CUDA, sized to the GPUs it finds.

    python scripts/gpu_check.py [--out gpu_check.json]               # every GPU of the machine, NCCL
    python scripts/gpu_check.py --cpu [--devices 3] --out cpu.json   # the same checks on CPU (gloo, tiny model)

Checks, each recorded in one JSON file and printed as a table (:func:`plan` says which run on how many devices;
those that need more than the machine has are listed with the reason, never silently dropped):

On any one device:

- **one_device**: the one-device delayed trajectory (``DelayedWeights``) on the accelerator against the same run
  on CPU, 1e-3 relative (GPU kernels are not the CPU's).
- **bf16**: the same run under ``bf16-mixed``: finite, and within 5e-2 of the float32 losses.
- **no_sync**: a 1-stage ``StageRuntime`` on the device: host-device synchronisations in the steady state (a real
  CUDA stream, ``torch.cuda.set_sync_debug_mode``; on CPU, the tensor reads that would synchronise), must be 0.
- **overhead**: ``benchmarks/throughput.py``'s P = 1 check, the strategy's 1F1B against plain Lightning.

On several devices (NCCL; a GPU cannot hold two NCCL ranks):

- **exactness**: the test GPT trained as a pipeline against the one-device run of the same schedule: P = 2
  (``2bw``, ``1f1b``), P = 3 (a middle stage, whose two links share one communicator), and at P = 2 with
  gradient clipping, tied weights, ``bf16-mixed`` (2e-2), D = 2 replicas (4 devices) and a resume from a
  checkpoint taken mid-run. CPU runs match to 1e-5; GPUs pass at 1e-3 relative.
- **deadlock_probe**: every stage count that fits, 50 steps of 2BW (and 1F1B at the largest), under a
  watchdog; on GPUs with ``NCCL_BUFFSIZE=65536`` so that every activation exceeds NCCL's buffer and a send
  waits for its receive (the rendezvous that the deadlock model assumes).
- **failure**: a P = 3 run whose middle stage is killed: every rank must exit, non-zero, before the watchdog.
- **throughput**: ``async_pp_2bw`` against ``torch.distributed.pipelining``'s ``Schedule1F1B`` at P = number of
  devices for M in {P, 2P, 4P}, with each stage's bubble fraction and peak memory.

Exit status 1 if a check failed (a skipped check is not a failure).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_common  # noqa: E402

from lightning_async_pp import AsyncPipelineStrategy  # noqa: E402
from tests.fixtures.helpers import fit, global_batches, random_batches, tiny_gpt  # noqa: E402
from tests.multiprocess.scripts.pipeline_run import make_optimizer  # noqa: E402

EXACT = {"width": 64, "seq": 32, "batch": 16, "layers": 4, "steps": 10, "microbatches": 4}
PROBE = {"width": 64, "seq": 32, "layers": 8}  # batch: 2 samples per micro-batch
PROBE_STEPS = 50
GPU_MODEL = {"width": 1024, "layers": 16, "heads": 16, "seq": 512, "batch_size": 64, "warmup": 5, "steps": 20}
CPU_MODEL = {"width": 64, "layers": 4, "heads": 4, "seq": 32, "batch_size": 16, "warmup": 2, "steps": 6}


# The jobs import this checkout's package.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


def run_pipeline(
    accelerator: str,
    devices: int,
    schedule: str,
    microbatches: int,
    steps: int,
    out: Path,
    watchdog: float,
    size: dict,
    extra: tuple[str, ...] = (),
    env: dict | None = None,
) -> dict:
    """One multi-process training job (tests/multiprocess/scripts/pipeline_run.py, ``extra`` its further
    arguments); raises on failure or when the watchdog fires."""
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
        *extra,
    ]
    code, output = run_ranks(command, devices, watchdog, env)
    if code != 0:
        raise RuntimeError(f"exit code {code}:\n{output[-3000:]}")
    result = json.loads((out / "losses.json").read_text())
    result["weights"] = {}
    for rank in range(devices):
        result["weights"].update(torch.load(out / f"weights_rank{rank}.pt"))
    return result


def run_ranks(command: list[str], ranks: int, watchdog: float, extra_env: dict | None = None) -> tuple[int, str]:
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
        **(extra_env or {}),
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


@dataclass(frozen=True)
class Exact:
    """One exactness case: a pipeline job against the one-device run of the same training.

    Args:
        name: How the report names it.
        stages: Pipeline stages ``P``.
        replicas: Data-parallel replicas ``D`` (the job has ``P x D`` ranks).
        schedule: ``"2bw"`` or ``"1f1b"``.
        clip: ``gradient_clip_val``.
        tie: Tie the embedding and the output head (they sit on the first and the last stage).
        precision: Lightning's precision.
        resume: Stop after half the steps with a checkpoint, then resume from it in a second job.
        optimizer: ``pipeline_run``'s optimizer. SGD where partial sums (the clipping norm, a tie's
            gradient) are added in another order than on one device: AdamW's normalisation would magnify that
            rounding beyond the tolerance.
    """

    name: str
    stages: int = 2
    replicas: int = 1
    schedule: str = "2bw"
    clip: float | None = None
    tie: bool = False
    precision: str = "32-true"
    resume: bool = False
    optimizer: str = "adamw"

    @property
    def devices(self) -> int:
        return self.stages * self.replicas


EXACT_CASES = [
    Exact("P2 2bw"),
    Exact("P2 1f1b", schedule="1f1b"),
    Exact("P3 2bw (middle stage)", stages=3),
    Exact("P2 clipping", clip=0.05, optimizer="sgd"),
    Exact("P2 tied weights", tie=True, optimizer="sgd"),
    Exact("P2 bf16-mixed", precision="bf16-mixed"),
    Exact("P2 resumed", resume=True),
    Exact("P2 x D2", replicas=2, optimizer="sgd"),
]


def _job_arguments(case: Exact, size: dict) -> tuple[str, ...]:
    extra: list[str] = ["--precision", case.precision, "--optimizer", case.optimizer]
    if case.clip is not None:
        extra += ["--clip", str(case.clip)]
    if case.tie:
        extra.append("--tie-weights")
    if case.replicas > 1:
        extra += ["--pipeline-size", str(case.stages), "--total-steps", str(size["steps"] * case.replicas)]
    return tuple(extra)


def _pipeline_result(accelerator: str, case: Exact, size: dict, tmp: Path) -> dict:
    args = (accelerator, case.devices, case.schedule, size["microbatches"], size["steps"])
    extra = _job_arguments(case, size)
    if not case.resume:
        return run_pipeline(*args, tmp / "run", 600, size, extra)
    half = str(size["steps"] // 2)
    run_pipeline(*args, tmp / "first", 600, size, (*extra, "--stop-at", half, "--checkpoint-every", half))
    return run_pipeline(*args, tmp / "resumed", 600, size, (*extra, "--ckpt-path", str(tmp / "first" / "final.ckpt")))


def _reference(accelerator: str, case: Exact, size: dict) -> tuple[list[float], dict]:
    model = tiny_gpt(
        n_layer=size["layers"],
        n_embd=size["width"],
        block_size=size["seq"],
        optimizer=make_optimizer(case.optimizer),
        tie_weights=case.tie,
    )
    if case.replicas > 1:  # one replica reading what the replicas read together
        batches = global_batches(size["steps"], case.replicas, batch_size=size["batch"], block=size["seq"])
    else:
        batches = random_batches(size["steps"], batch_size=size["batch"], block=size["seq"])
    strategy = AsyncPipelineStrategy(schedule=case.schedule, num_microbatches=size["microbatches"] * case.replicas)
    losses = fit(
        model,
        batches,
        strategy=strategy,
        accelerator=accelerator,
        gradient_clip_val=case.clip,
        precision=case.precision,
    )
    return losses, {k: v.detach().cpu() for k, v in model.state_dict().items()}


def exactness(accelerator: str, tolerance: float, cases: list[Exact]) -> list[dict]:
    rows = []
    size = {**EXACT}
    for case in cases:
        tol = max(tolerance, 2e-2) if case.precision.startswith("bf16") else tolerance
        row = {"check": "exactness", "case": case.name, "stages": case.stages, "microbatches": size["microbatches"]}
        try:
            with tempfile.TemporaryDirectory() as tmp:
                result = _pipeline_result(accelerator, case, size, Path(tmp))
            ref_losses, ref_weights = _reference(accelerator, case, size)
            ref_losses = ref_losses[-len(result["losses"]) :]  # a resumed job logs the steps after the checkpoint
            loss_diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(result["losses"], ref_losses, strict=True))
            # Elementwise, as torch.testing.assert_close: |a - b| <= atol + rtol * |b| with atol = rtol / 10.
            weight_err = max(
                float(((result["weights"][k].float() - v.float()).abs() / (tol / 10 + tol * v.float().abs())).max())
                for k, v in ref_weights.items()
                if k in result["weights"]
            )
            row.update(
                max_rel_loss_diff=loss_diff,
                weight_error_over_tolerance=weight_err,
                ok=loss_diff <= tol and weight_err <= 1.0,
            )
        except Exception as error:  # a failed check is reported, the others still run
            row.update(ok=False, error=str(error)[-3000:])
        rows.append(row)
    return rows


def deadlock_probe(accelerator: str, stage_counts: list[int]) -> list[dict]:
    rows = []
    jobs = [(P, "2bw") for P in stage_counts] + [(stage_counts[-1], "1f1b")]
    # A small NCCL buffer: each activation is larger, so a send completes only once its receive runs.
    env = {"NCCL_BUFFSIZE": "65536"} if accelerator == "gpu" else None
    for P, schedule in jobs:
        row = {"check": "deadlock_probe", "schedule": schedule, "stages": P, "microbatches": P, "steps": PROBE_STEPS}
        started = time.perf_counter()
        try:
            with tempfile.TemporaryDirectory() as tmp:
                # The watchdog: a healthy job needs a few seconds of steps plus start-up.
                size = {**PROBE, "batch": 2 * P}
                result = run_pipeline(accelerator, P, schedule, P, PROBE_STEPS, Path(tmp), 300, size, env=env)
            bubbles = {s: round(sorted(b)[len(b) // 2], 3) for s, b in result["stage_bubbles"].items() if b}
            row.update(ok=len(result["losses"]) == PROBE_STEPS, bubble_fraction=bubbles)
        except Exception as error:
            row.update(ok=False, error=str(error)[-3000:])
        row["seconds"] = round(time.perf_counter() - started, 1)
        rows.append(row)
    return rows


def failure(accelerator: str, watchdog: float = 240) -> list[dict]:
    """A P = 3 job whose middle stage is killed at step 3: every rank must be gone, non-zero, before the watchdog."""
    row: dict = {"check": "failure", "stages": 3, "microbatches": 3, "case": "stage 1 killed at step 3"}
    started = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            run_pipeline(accelerator, 3, "2bw", 3, 20, Path(tmp), watchdog, {**PROBE, "batch": 6}, ("--kill-rank", "1"))
        row.update(ok=False, error="the job succeeded although a stage was killed")
    except TimeoutError as error:
        row.update(ok=False, error=f"a rank outlived the watchdog: {str(error)[-2000:]}")
    except RuntimeError:  # the job failed, as it must
        row.update(ok=True)
    row["seconds_to_exit"] = round(time.perf_counter() - started, 1)
    return [row]


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


def one_device(accelerator: str, tolerance: float) -> list[dict]:
    """The one-device delayed trajectory on the accelerator against CPU, and under bf16-mixed against float32."""
    size = {**EXACT}
    case = Exact("one device")
    rows = []
    try:
        cpu_losses, cpu_weights = _reference("cpu", case, size)
        losses, weights = _reference(accelerator, case, size)
        diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, cpu_losses, strict=True))
        worst = max(float((weights[k].float() - v.float()).abs().max()) for k, v in cpu_weights.items())
        rows.append(
            {"check": "one_device", "case": f"2bw {accelerator} vs cpu", "max_rel_loss_diff": diff,
             "max_abs_weight_diff": worst, "ok": diff <= tolerance}
        )  # fmt: skip
        bf16, _ = _reference(accelerator, Exact("bf16", precision="bf16-mixed"), size)
        finite = all(math.isfinite(x) for x in bf16)
        diff16 = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(bf16, losses, strict=True)) if finite else None
        rows.append(
            {"check": "bf16", "case": "bf16-mixed vs float32", "max_rel_loss_diff": diff16,
             "ok": finite and diff16 is not None and diff16 <= 5e-2}
        )  # fmt: skip
    except Exception as error:
        rows.append({"check": "one_device", "ok": False, "error": str(error)[-3000:]})
    return rows


def no_sync(device: torch.device, steps: int = 6, steady_from: int = 2) -> list[dict]:
    """Host-device synchronisations of a 1-stage runtime's steady-state steps (must be 0)."""
    from torch import nn

    from lightning_async_pp.runtime.stage import StageRuntime

    row: dict = {"check": "no_sync", "case": f"1 stage on {device.type}", "stages": 1, "microbatches": 4}
    try:
        torch.manual_seed(0)
        # SGD: AdamW's step counter is a CPU tensor read with `.item()`, which is not a device synchronisation.
        layers = [nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64)]
        for layer in layers:
            layer.to(device)
        params = [p for layer in layers for p in layer.parameters()]
        runtime = StageRuntime(
            kind="2bw", stage=0, num_stages=1, num_microbatches=4, layers=layers,
            optimizer=torch.optim.SGD(params, lr=0.1, momentum=0.9), inputs_fn=lambda mb: mb,
            loss_fn=lambda out, mb: out.pow(2).mean(), device=device,
        )  # fmt: skip
        batches = [torch.randn(16, 64, device=device) for _ in range(steps)]
        counts = []
        for step, batch in enumerate(batches):
            with _counting_syncs(device) as counter:
                runtime.run_step(step, batch)
            counts.append(counter["syncs"])
        runtime.drain()
        steady = counts[steady_from:]
        row.update(syncs_per_step=steady, ok=sum(steady) == 0)
    except Exception as error:
        row.update(ok=False, error=str(error)[-3000:])
    return [row]


@contextlib.contextmanager
def _counting_syncs(device: torch.device):
    """Count host-device synchronisations: CUDA's sync debug mode on a GPU; on CPU, the tensor reads that would
    synchronise on one (tests/multiprocess/test_no_sync.py)."""
    counter = {"syncs": 0}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield counter
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counter["syncs"] = sum("synchroniz" in str(w.message) for w in caught)
        return
    from tests.multiprocess.test_no_sync import count_syncs

    reads: dict = {}
    with count_syncs(reads):
        yield counter
    counter["syncs"] = sum(reads.values()) if reads else 0


def overhead(accelerator: str, model: dict, repeats: int) -> list[dict]:
    """``benchmarks/throughput.py``'s P = 1 check: the strategy's 1F1B against plain Lightning on one device."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "overhead.json"
        command = [
            sys.executable, str(ROOT / "benchmarks" / "throughput.py"), "--accelerator", accelerator,
            "--stage-counts", "1", "--microbatch-counts", "1", "--variants", "single_process", "--overhead",
            "--no-simulate", "--no-with-corrected", "--repeats", str(repeats), "--out", str(out),
            *[x for key, value in model.items() for x in (f"--{key.replace('_', '-')}", str(value))],
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0 or not out.exists():
            return [{"check": "overhead", "ok": False, "error": (done.stdout + done.stderr)[-3000:]}]
        target = json.loads(out.read_text()).get("targets", {}).get("p1_overhead")
    if target is None:
        return [{"check": "overhead", "ok": False, "error": "throughput.py reported no p1_overhead"}]
    return [{"check": "overhead", "stages": 1, "case": "P=1 1f1b vs plain Lightning", **target, "ok": True}]


@dataclass(frozen=True)
class Planned:
    """A check and the devices it needs."""

    name: str
    devices: int
    run: Callable[[], list[dict]]


def plan(count: int, cpu: bool, tolerance: float, model: dict, repeats: int) -> tuple[list[Planned], list[dict]]:
    """The checks ``count`` devices can run, and for the others why they are skipped.

    Args:
        count: Devices available (GPUs, or CPU processes with ``--cpu``).
        cpu: Run on CPU with gloo.
        tolerance: Relative tolerance of the exactness checks.
        model: The throughput benchmark's model size.
        repeats: Throughput repetitions.
    """
    accelerator = "cpu" if cpu else "gpu"
    device = torch.device("cpu") if cpu else torch.device("cuda", 0)
    checks = [
        Planned("one_device + bf16", 1, lambda: one_device(accelerator, tolerance)),
        Planned("no_sync", 1, lambda: no_sync(device)),
        Planned("overhead", 1, lambda: overhead(accelerator, model, repeats)),
    ]
    for case in EXACT_CASES:
        checks.append(
            Planned(
                f"exactness {case.name}", case.devices, functools.partial(exactness, accelerator, tolerance, [case])
            )
        )
    counts = list(range(2, count + 1)) if not cpu else [P for P in (2, 3) if P <= count]
    checks.append(Planned("deadlock_probe", 2, lambda: deadlock_probe(accelerator, counts or [2])))
    checks.append(Planned("failure (P=3, middle stage killed)", 3, lambda: failure(accelerator)))
    checks.append(
        Planned("throughput", 2, lambda: throughput(accelerator, 2 if cpu else min(count, 8), model, repeats))
    )
    runnable = [c for c in checks if c.devices <= count]
    where = "CPU processes (--devices)" if cpu else "GPUs"
    skipped = [
        {"check": c.name, "needs": c.devices,
         "reason": f"needs {c.devices} {where}, {count} available"
         + ("" if cpu else " (NCCL cannot put two ranks on one GPU)")}
        for c in checks if c.devices > count
    ]  # fmt: skip
    return runnable, skipped


def _fmt(value, spec: str = ".3g") -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_fmt(v, spec) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_fmt(v, spec)}" for k, v in value.items()) + "}"
    return format(value, spec) if isinstance(value, float) else str(value)


def print_table(rows: list[dict]) -> None:
    print(f"{'check':<15} {'ok':<5} {'P':>2} {'M':>3} {'schedule/variant':<17} result")
    for row in rows:
        name = row.get("case") or row.get("schedule") or row.get("variant", "")
        details = {
            k: v
            for k, v in row.items()
            if k not in ("check", "ok", "stages", "microbatches", "schedule", "variant", "case", "error")
        }
        line = f"{row['check']:<15} {str(row['ok']):<5} {row.get('stages', ''):>2} "
        line += f"{row.get('microbatches', ''):>3} {name:<17} "
        print(line + " ".join(f"{k}={_fmt(v)}" for k, v in details.items()))
        if "error" in row:
            print("    " + row["error"].strip().splitlines()[-1][:300])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="run the checks on CPU (gloo, tiny model)")
    parser.add_argument("--devices", type=int, default=3, help="with --cpu: processes a check may use (default 3)")
    parser.add_argument("--out", default="gpu_check.json")
    parser.add_argument("--repeats", type=int, default=None, help="throughput repetitions (GPU 3, CPU 1)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    if args.cpu:
        torch.set_num_threads(1)  # as every pipeline process: the reference then computes the same sums
        accelerator, count, tolerance, model, device = "cpu", args.devices, 1e-5, CPU_MODEL, "cpu"
    else:
        count = torch.cuda.device_count()
        if count < 1:
            sys.exit("No GPU found; run with --cpu for the CPU version of these checks.")
        accelerator, tolerance, model, device = "gpu", 1e-3, GPU_MODEL, torch.cuda.get_device_name(0)
    checks, skipped = plan(count, args.cpu, tolerance, model, args.repeats or (1 if args.cpu else 3))
    for row in skipped:
        print(f"skipped: {row['check']}: {row['reason']}")
    rows: list[dict] = []
    for check in checks:
        print(f"running: {check.name}", flush=True)
        rows += check.run()
    report = {
        "accelerator": accelerator,
        "devices": count,
        "device": device,
        "torch": torch.__version__,
        "seconds": round(time.perf_counter() - started, 1),
        "ok": all(r["ok"] for r in rows),
        "results": rows,
        "skipped": skipped,
    }
    print_table(rows)
    for row in skipped:
        print(f"{'skipped':<15} {row['check']}: {row['reason']}")
    Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    print(f"{'all checks passed' if report['ok'] else 'SOME CHECKS FAILED'} in {report['seconds']} s; wrote {args.out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
