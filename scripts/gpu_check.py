"""The first run on a GPU machine: what matters on CUDA and NCCL, each check saved as soon as it finishes.

    python scripts/gpu_check.py [--out gpu_check.json]                  # every check the GPUs allow
    python scripts/gpu_check.py --only plain runtime optimizers         # some checks, by name
    python scripts/gpu_check.py --skip runtime_compiled --steps 5       # all but some; fewer timed steps
    python scripts/gpu_check.py --cpu --devices 1 --out cpu.json        # the same code on CPU, a tiny model

Each check prints its rows and rewrites ``--out`` (atomically: the file is a whole JSON report after every row,
``"finished": false`` until the end), so a run cut short keeps everything it measured. On one GPU the
one-device checks below are sized to take under 4 minutes with their defaults, start-up included (an estimate
from the step times an H200 gave, compilation the largest part; for machines lent 15 minutes in all: run it
once, early). Exit status 1 if a check failed (a skipped check is not a failure).

On a device machine the repository travels and the image has torch and Lightning (no jsonargparse, which
nothing here imports): no ``carry`` is needed. Run it from the repository root as
``PYTHONUNBUFFERED=1 python3 scripts/gpu_check.py --out $OUT/gpu_check.json`` with a ``timeout_s`` of about
300; the report comes back under ``$OUT`` even when the command is stopped at its limit.

One-device checks (``devices=1``; the real-size ones on the demo GPT at GPT-2-medium shape: 24 blocks, width
1024, 16 heads, 1,024 tokens per sequence, vocabulary 50,304, 406M parameters, ``bf16-mixed``, 16 sequences per
step, fused AdamW; ``--cpu``: 2 blocks of width 64):

- **one_device**: the one-device delayed trajectory (``DelayedWeights``) on the accelerator against the same run
  on CPU, 1e-3 relative (GPU kernels are not the CPU's); **bf16**: under ``bf16-mixed``, within 5e-2 of float32.
- **no_sync**: a 1-stage ``StageRuntime``'s host-device synchronisations in the steady state (a real CUDA stream,
  ``torch.cuda.set_sync_debug_mode``; on CPU, the tensor reads that would synchronise), on a small MLP and on the
  demo GPT with 4 experts per block: must be 0.
- **plain**: a plain PyTorch loop, whole batch and micro-batched (M = 2 and 4), tokens/s.
- **runtime**: a 1-stage ``StageRuntime`` (2bw and 1f1b, M = 4) against the plain loop with the same
  micro-batches, and its synchronisations per step; **runtime_compiled**: the same with the blocks compiled
  (inductor; ``--cpu``: ``aot_eager``), against eager, with dynamo's frame and graph counts (recompilations).
- **lightning**: ``Trainer(devices=1)`` without a strategy and with ``strategy="async_pp"`` (1F1B, M = 1).
- **mfu**: ``throughput/mfu`` as logged under ``async_pp`` (2bw, M = 4) against a FLOP count by hand
  (6 x matmul weights + 12 x layers x sequence x width per token).
- **optimizers**: one optimizer step, ms: AdamW fused and foreach, ``Muon`` (whole model, and the block matrices
  alone), ``torch.optim.Muon`` on those matrices, ``DelayCorrected`` around AdamW (foreach) and around ``Muon``.
- **memory**: peak CUDA memory (``torch.cuda.max_memory_allocated``) of a 1-stage 2bw runtime, M = 4 and 8.

Checks on several devices (NCCL; a GPU cannot hold two NCCL ranks; :func:`plan` lists those the machine
cannot run with the reason):

- **exactness P2 2bw** (and the other ``exactness ...`` cases): the test GPT trained as a pipeline against the
  one-device run of the same schedule: P = 2 (``2bw``, ``1f1b``), P = 3 (a middle stage), and at P = 2 with
  gradient clipping, tied weights, ``bf16-mixed`` (2e-2), D = 2 replicas (4 devices) and a resume from a
  checkpoint taken mid-run. CPU runs match to 1e-5; GPUs pass at 1e-3 relative.
- **deadlock_probe**: every stage count that fits, 50 steps of 2BW (and 1F1B at the largest), under a
  watchdog; on GPUs with ``NCCL_BUFFSIZE=65536`` so that a send waits for its receive.
- **failure (P=3, middle stage killed)**: every rank must exit, non-zero, before the watchdog.
- **throughput**: ``async_pp_2bw`` against ``torch.distributed.pipelining``'s ``Schedule1F1B`` at P = number of
  devices for M in {P, 2P, 4P}, with each stage's bubble fraction and peak memory.

``--only``/``--skip`` take check names; ``exactness`` alone names every exactness case.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
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


@dataclass(frozen=True)
class Size:
    """The model and the steps of the one-device measurements."""

    layers: int
    width: int
    heads: int
    seq: int
    vocab: int
    batch: int  # sequences per step
    warmup: int  # steps before the timed ones (compilation happens there)
    steps: int  # timed steps
    optimizer_steps: int  # timed optimizer steps, after 2 untimed


REAL = Size(layers=24, width=1024, heads=16, seq=1024, vocab=50304, batch=16, warmup=3, steps=10, optimizer_steps=10)
TINY = Size(layers=2, width=64, heads=4, seq=32, vocab=256, batch=8, warmup=2, steps=3, optimizer_steps=3)

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


def no_sync(device: torch.device, steps: int = 6, steady_from: int = 2) -> list[dict]:
    """Host-device synchronisations of a 1-stage runtime's steady-state steps (must be 0): on a small MLP, and on
    the demo GPT with a mixture of experts in each block (its routing and its attached load-balancing loss)."""
    from torch import nn

    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
    moe = tiny_gpt(n_experts=4, experts_per_token=2, n_embd=64)
    return [
        _steady_syncs("1 stage on " + device.type, device, list(mlp), lambda mb: mb, lambda out, mb: out.pow(2).mean(),
                      [torch.randn(16, 64, device=device) for _ in range(steps)], steady_from),
        _steady_syncs("demo GPT, 4 experts, 1 stage on " + device.type, device, list(moe.layers), moe.pipeline_inputs,
                      moe.pipeline_loss, [tuple(t.to(device) for t in b) for b in random_batches(steps)], steady_from),
    ]  # fmt: skip


def _steady_syncs(case: str, device: torch.device, layers: list, inputs_fn, loss_fn, batches, steady_from) -> dict:
    from lightning_async_pp.runtime.stage import StageRuntime

    row: dict = {"check": "no_sync", "case": case, "stages": 1, "microbatches": 4}
    try:
        for layer in layers:
            layer.to(device)
        params = [p for layer in layers for p in layer.parameters()]
        # SGD: AdamW's step counter is a CPU tensor read with `.item()`, which is not a device synchronisation.
        runtime = StageRuntime(
            kind="2bw", stage=0, num_stages=1, num_microbatches=4, layers=layers,
            optimizer=torch.optim.SGD(params, lr=0.1, momentum=0.9), inputs_fn=inputs_fn, loss_fn=loss_fn,
            device=device,
        )  # fmt: skip
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
    return row


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


def one_device(accelerator: str, tolerance: float) -> Iterator[dict]:
    """The one-device delayed trajectory on the accelerator against CPU, and under bf16-mixed against float32."""
    size, case = {**EXACT}, Exact("one device")
    cpu_losses, cpu_weights = _reference("cpu", case, size)
    losses, weights = _reference(accelerator, case, size)
    diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, cpu_losses, strict=True))
    worst = max(float((weights[k].float() - v.float()).abs().max()) for k, v in cpu_weights.items())
    yield {"check": "one_device", "case": f"2bw {accelerator} vs cpu", "max_rel_loss_diff": diff,
           "max_abs_weight_diff": worst, "ok": diff <= tolerance}  # fmt: skip
    bf16, _ = _reference(accelerator, Exact("bf16", precision="bf16-mixed"), size)
    finite = all(math.isfinite(x) for x in bf16)
    diff16 = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(bf16, losses, strict=True)) if finite else None
    yield {"check": "bf16", "case": "bf16-mixed vs float32", "max_rel_loss_diff": diff16,
           "ok": finite and diff16 is not None and diff16 <= 5e-2}  # fmt: skip


class Bench:
    """The one-device measurements: one model of ``size`` on ``device`` (built once, shared by the checks that
    leave its parameters as they were), bf16 autocast, fused AdamW, and what one check measured that a later one
    compares against (the plain loop's tokens/s).

    Args:
        device: Where everything runs.
        size: The model and the step counts.
        compile_option: ``torch.compile``'s keyword arguments for the compiled blocks.
    """

    def __init__(self, device: torch.device, size: Size, compile_option: dict) -> None:
        self.device, self.size, self.compile_option = device, size, compile_option
        self.accelerator = "gpu" if device.type == "cuda" else "cpu"
        self._model = None
        self.plain_tokens_per_sec: dict[int, float] = {}  # micro-batches -> tokens/s of the plain loop
        self.runtime_tokens_per_sec: dict[str, float] = {}  # schedule -> tokens/s of the eager runtime
        generator = torch.Generator().manual_seed(0)
        count = size.warmup + size.steps
        tokens = torch.randint(0, size.vocab, (count, size.batch, size.seq + 1), generator=generator)
        self.cpu_batches = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]
        self.batches = [(x.to(device), y.to(device)) for x, y in self.cpu_batches]

    def gpt(self, **kwargs):
        from lightning_async_pp.demos import GPT

        s = self.size
        return GPT(vocab_size=s.vocab, block_size=s.seq, n_layer=s.layers, n_head=s.heads, n_embd=s.width,
                   lr_schedule="constant", **kwargs)  # fmt: skip

    @property
    def model(self):
        if self._model is None:
            self._model = self.gpt().to(self.device)
        return self._model

    def release(self) -> None:
        """Drop the shared model (the compiled check changes its blocks) and cached device memory."""
        self._model = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def adamw(self, params, **kwargs) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, **({"fused": True} | kwargs))

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def timed(self, step: Callable[[int, tuple], object], batches: list | None = None) -> float:
        """Seconds of the steps after the warm-up ones (the device drained at both ends)."""
        batches = self.batches if batches is None else batches
        start = None
        for index, batch in enumerate(batches):
            if index == self.size.warmup:
                self.sync()
                start = time.perf_counter()
            step(index, batch)
        self.sync()
        return time.perf_counter() - start

    def tokens_per_sec(self, seconds: float) -> float:
        return self.size.batch * self.size.seq * self.size.steps / seconds

    def config(self) -> dict:
        return {"layers": self.size.layers, "width": self.size.width, "seq": self.size.seq,
                "batch": self.size.batch, "steps": self.size.steps}  # fmt: skip


def plain(bench: Bench) -> Iterator[dict]:
    """A plain PyTorch loop: forward and backward of the whole batch or of each of M micro-batches, then the step."""
    from lightning_async_pp.runtime.microbatch import split_microbatches

    model = bench.model
    optimizer = bench.adamw(model.parameters())

    def step(microbatches: int, index: int, batch: tuple) -> None:
        optimizer.zero_grad(set_to_none=True)
        for part in split_microbatches(batch, microbatches) if microbatches > 1 else [batch]:
            with bench.autocast():
                loss = model.pipeline_loss(model(model.pipeline_inputs(part)), part) / microbatches
            loss.backward()
        optimizer.step()

    for microbatches in (1, 2, 4):
        speed = bench.tokens_per_sec(bench.timed(functools.partial(step, microbatches)))
        bench.plain_tokens_per_sec[microbatches] = speed
        row = {"check": "plain", "microbatches": microbatches, "tokens_per_sec": speed, **bench.config()}
        if microbatches > 1:
            row["vs_whole_batch"] = speed / bench.plain_tokens_per_sec[1]
        yield row | {"ok": speed > 0}
    model.zero_grad(set_to_none=True)


def _stage_runtime(bench: Bench, model, kind: str, microbatches: int):
    """A 1-stage ``StageRuntime`` on ``model``'s layers, as the strategy builds one with its defaults (every action
    timed, finite losses checked), with its own fused AdamW."""
    from lightning_async_pp.runtime.stage import StageRuntime

    return StageRuntime(
        kind=kind, stage=0, num_stages=1, num_microbatches=microbatches, layers=list(model.layers),
        optimizer=bench.adamw(model.parameters()), inputs_fn=model.pipeline_inputs, loss_fn=model.pipeline_loss,
        device=bench.device, forward_context=bench.autocast,
    )  # fmt: skip


def runtime(bench: Bench) -> Iterator[dict]:
    """A 1-stage runtime (2bw, then 1f1b; M = 4): tokens/s, against the plain loop of the same micro-batches, and
    its host-device synchronisations per steady-state step."""
    microbatches, model = 4, bench.model
    for kind in ("2bw", "1f1b"):
        stage = _stage_runtime(bench, model, kind, microbatches)
        syncs: list[int] = []

        def step(index: int, batch: tuple, stage=stage) -> None:
            if index < bench.size.warmup:
                stage.run_step(index, batch)
                return
            with _counting_syncs(bench.device) as counter:
                stage.run_step(index, batch)
            syncs.append(counter["syncs"])

        seconds = bench.timed(step)
        stage.drain()
        speed = bench.tokens_per_sec(seconds)
        row = {"check": "runtime", "schedule": kind, "stages": 1, "microbatches": microbatches, "tokens_per_sec": speed}
        plain_speed = bench.plain_tokens_per_sec.get(microbatches)
        if plain_speed:
            row["vs_plain_microbatched"] = speed / plain_speed
        yield row | {"syncs_per_step": max(syncs), "ok": speed > 0}
        del stage, step
        gc.collect()
        model.zero_grad(set_to_none=True)


def runtime_compiled(bench: Bench, microbatches: int = 4, steps_per_round: int = 2) -> Iterator[dict]:
    """The 1-stage runtime with its blocks compiled against the same runtime eager, in alternating rounds of
    ``steps_per_round`` steps (eager, compiled, compiled, eager, ...), so that a change in the host's load hits
    both: ``vs_eager`` is the median of the rounds' ratios. The warm-up steps (compilation) come first, then
    dynamo's counts; a recompilation during the timed rounds shows in ``dynamo_at_end``."""
    from lightning_async_pp.models.compiling import compile_blocks

    compiled_model = bench.gpt().to(bench.device)
    compile_blocks(compiled_model.layers[1:-1], bench.compile_option)
    models = {"eager": bench.model, "compiled": compiled_model}
    rounds = max(1, bench.size.steps // steps_per_round)
    batches = bench.batches
    try:
        for kind in ("2bw", "1f1b"):
            stages = {name: _stage_runtime(bench, model, kind, microbatches) for name, model in models.items()}
            steps = dict.fromkeys(stages, 0)

            def run(name: str, count: int, stages=stages, steps=steps) -> float:
                bench.sync()
                start = time.perf_counter()
                for _ in range(count):
                    stages[name].run_step(steps[name], batches[steps[name] % len(batches)])
                    steps[name] += 1
                bench.sync()
                return time.perf_counter() - start

            for name in stages:
                run(name, bench.size.warmup)
            after_warmup = bench_common.dynamo_counts()
            seconds: dict[str, list[float]] = {name: [] for name in stages}
            for index in range(rounds):
                for name in ("eager", "compiled") if index % 2 == 0 else ("compiled", "eager"):
                    seconds[name].append(run(name, steps_per_round))
            for stage in stages.values():
                stage.drain()
            tokens = bench.size.batch * bench.size.seq * steps_per_round * rounds
            speed = {name: tokens / sum(values) for name, values in seconds.items()}
            ratios = [e / c for e, c in zip(seconds["eager"], seconds["compiled"])]
            yield {
                "check": "runtime_compiled", "schedule": kind, "stages": 1, "microbatches": microbatches,
                "tokens_per_sec": speed["compiled"], "eager_tokens_per_sec": speed["eager"],
                "vs_eager": statistics.median(ratios), "vs_eager_rounds": ratios, "compile": bench.compile_option,
                "dynamo_after_warmup": after_warmup, "dynamo_at_end": bench_common.dynamo_counts(),
                "ok": speed["compiled"] > 0,
            }  # fmt: skip
            del stages, run
            gc.collect()
            for model in models.values():
                model.zero_grad(set_to_none=True)
    finally:
        del models, compiled_model
        bench.release()


class _StepClock:
    """Lightning callback: the time at the end of the last warm-up step and of the last step, the device drained."""

    def __new__(cls, bench: Bench):
        from lightning.pytorch import Callback

        class StepClock(Callback):
            def __init__(self) -> None:
                self.marks: list[float] = []

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
                if batch_idx in (bench.size.warmup - 1, bench.size.warmup + bench.size.steps - 1):
                    bench.sync()
                    self.marks.append(time.perf_counter())

        return StepClock()


def _fit(bench: Bench, strategy, optimizer, callbacks=(), logger=False) -> float:
    """Train a fresh GPT with Lightning on one device; tokens/s of the timed steps."""
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader

    model = bench.gpt(optimizer=optimizer)
    clock = _StepClock(bench)
    trainer = Trainer(
        accelerator=bench.accelerator, devices=1, strategy=strategy, precision="bf16-mixed",
        max_steps=bench.size.warmup + bench.size.steps, logger=logger, log_every_n_steps=1,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, num_sanity_val_steps=0, callbacks=[clock, *callbacks],
    )  # fmt: skip
    trainer.fit(model, train_dataloaders=DataLoader(bench.cpu_batches, batch_size=None))
    del model, trainer
    bench.release()
    return bench.tokens_per_sec(clock.marks[1] - clock.marks[0])


def lightning(bench: Bench) -> Iterator[dict]:
    """Plain Lightning against ``strategy="async_pp"`` with 1F1B and one micro-batch (the same computation)."""
    bench.release()
    factory = bench.adamw
    base = _fit(bench, "auto", factory)
    yield {"check": "lightning", "case": "plain Lightning", "tokens_per_sec": base, "ok": base > 0}
    ours = _fit(bench, AsyncPipelineStrategy(schedule="1f1b", num_microbatches=1), factory)
    yield {"check": "lightning", "case": "async_pp 1f1b M=1", "stages": 1, "microbatches": 1,
           "tokens_per_sec": ours, "vs_plain_lightning": ours / base, "ok": ours > 0}  # fmt: skip


def flops_per_token_by_hand(size: Size) -> int:
    """6 FLOPs per matmul weight and token (forward and backward; the embeddings are lookups, the head is a matmul)
    and attention's ``Q K^T`` and ``A V``, ``2 x 2 T C`` per token and layer forward (not halved for the causal
    mask), x 3 with the backward."""
    block = 12 * size.width * size.width  # qkv 3C^2, projection C^2, MLP 8C^2 (biases and norms: no matmul)
    weights = size.layers * block + size.width * size.vocab
    return 6 * weights + 12 * size.layers * size.seq * size.width


def mfu(bench: Bench) -> Iterator[dict]:
    """``throughput/mfu`` as the strategy logs it (2bw, M = 4), against the FLOP count by hand and this check's
    own clock."""
    from lightning.pytorch.loggers.logger import Logger

    from lightning_async_pp.strategy.throughput import PipelineThroughputMonitor, peak_flops_of

    class Recorder(Logger):
        name, version = "recorder", 0
        logged: list[tuple[int, dict]] = []

        @property
        def experiment(self):
            return None

        def log_metrics(self, metrics, step=None) -> None:
            self.logged.append((step, dict(metrics)))

        def log_hyperparams(self, params, *args, **kwargs) -> None:
            pass

    bench.release()
    # No peak is known for a CPU: give one, so that the CPU run logs MFU too.
    peak = None if bench.device.type == "cuda" else 1e12
    monitor, recorder = PipelineThroughputMonitor(peak_flops=peak), Recorder()
    strategy = AsyncPipelineStrategy(schedule="2bw", num_microbatches=4)
    speed = _fit(bench, strategy, bench.adamw, [monitor], recorder)
    peak_used, source = peak_flops_of(bench.device, peak)
    timed = [m for step, m in recorder.logged if "throughput/mfu" in m and step >= bench.size.warmup]
    logged = statistics.median(m["throughput/mfu"] for m in timed)
    by_hand = flops_per_token_by_hand(bench.size)
    own = by_hand * speed / peak_used
    yield {
        "check": "mfu", "schedule": "2bw", "stages": 1, "microbatches": 4, "logged_mfu": logged,
        "mfu_by_hand": own, "logged_over_by_hand": logged / own, "flops_per_token_logged": monitor.flops_per_item,
        "flops_per_token_by_hand": by_hand, "flops_ratio": monitor.flops_per_item / by_hand,
        "peak_flops": peak_used, "peak_source": source, "tokens_per_sec": speed,
        "ok": abs(monitor.flops_per_item / by_hand - 1) <= 0.02 and abs(logged / own - 1) <= 0.2,
    }  # fmt: skip


def optimizers(bench: Bench) -> Iterator[dict]:
    """One optimizer step on the model, with gradients in place: ms per step, each optimizer on its own."""
    from lightning_async_pp.optim import DelayCorrected, Muon

    model = bench.model
    generator = torch.Generator(device=bench.device).manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=generator, device=p.device) * 1e-3
    matrices = [p for layer in model.layers[1:-1] for p in layer.parameters() if p.dim() == 2]
    cases: dict[str, Callable[[], torch.optim.Optimizer]] = {
        "AdamW fused": lambda: bench.adamw(model.parameters()),
        "AdamW foreach": lambda: bench.adamw(model.parameters(), fused=False, foreach=True),
        "Muon": lambda: Muon(model.named_parameters()),
        "Muon, block matrices": lambda: Muon(matrices),
        "DelayCorrected(AdamW foreach)": lambda: DelayCorrected(
            bench.adamw(model.parameters(), fused=False, foreach=True)
        ),
        "DelayCorrected(Muon)": lambda: DelayCorrected(Muon(model.named_parameters())),
    }
    if hasattr(torch.optim, "Muon"):
        cases["torch.optim.Muon, block matrices"] = lambda: torch.optim.Muon(matrices)
    for name, make in cases.items():
        optimizer = make()
        for _ in range(2):  # state created, kernels warm
            optimizer.step()
        bench.sync()
        start = time.perf_counter()
        for _ in range(bench.size.optimizer_steps):
            optimizer.step()
        bench.sync()
        ms = 1e3 * (time.perf_counter() - start) / bench.size.optimizer_steps
        tensors = len(matrices) if "matrices" in name else sum(1 for _ in model.parameters())
        yield {"check": "optimizers", "optimizer": name, "tensors": tensors, "ms_per_step": ms, "ok": ms > 0}
        del optimizer
        gc.collect()
    bench.release()  # the optimizers have changed the weights


def memory(bench: Bench) -> Iterator[dict]:
    """Peak memory of a 1-stage 2bw runtime under bf16-mixed with fused AdamW, M = 4 and 8 (CUDA only): the
    model's weights, the second version, the optimizer's state, gradients and the activations in flight."""
    bench.release()
    model = bench.model  # fresh: no optimizer state or gradients from an earlier check
    for microbatches in (4, 8):
        if bench.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(bench.device)
        stage = _stage_runtime(bench, model, "2bw", microbatches)
        for index, batch in enumerate(bench.batches[:3]):
            stage.run_step(index, batch)
        stage.drain()
        bench.sync()
        peak = torch.cuda.max_memory_allocated(bench.device) / 2**30 if bench.device.type == "cuda" else None
        weights = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
        yield {"check": "memory", "schedule": "2bw", "stages": 1, "microbatches": microbatches,
               "sequences_per_microbatch": bench.size.batch // microbatches, "peak_gib": peak,
               "weights_gib": weights, "ok": True}  # fmt: skip
        del stage
        gc.collect()
        model.zero_grad(set_to_none=True)
        if bench.device.type == "cuda":
            torch.cuda.empty_cache()
    bench.release()


@dataclass(frozen=True)
class Planned:
    """A check, the devices it needs, and what runs it (rows, each yielded as soon as it is measured)."""

    name: str
    devices: int
    run: Callable[[], Iterator[dict]]


ONE_DEVICE = (
    "one_device",
    "no_sync",
    "plain",
    "runtime",
    "runtime_compiled",
    "lightning",
    "mfu",
    "optimizers",
    "memory",
)


def plan(
    count: int, cpu: bool, tolerance: float, model: dict, repeats: int, bench: Callable[[], Bench] | None = None
) -> tuple[list[Planned], list[dict]]:
    """The checks ``count`` devices can run, and for the others why they are skipped.

    Args:
        count: Devices available (GPUs, or CPU processes with ``--cpu``).
        cpu: Run on CPU with gloo.
        tolerance: Relative tolerance of the exactness checks.
        model: The several-device throughput benchmark's model size.
        repeats: Throughput repetitions.
        bench: Gives the one-device measurements' :class:`Bench` (built at the first check that needs it).
    """
    accelerator = "cpu" if cpu else "gpu"
    device = torch.device("cpu") if cpu else torch.device("cuda", 0)

    def measured(fn: Callable[[Bench], Iterator[dict]]) -> Callable[[], Iterator[dict]]:
        return lambda: fn(bench())

    runs = {
        "one_device": lambda: one_device(accelerator, tolerance),
        "no_sync": lambda: no_sync(device),
        "plain": measured(plain),
        "runtime": measured(runtime),
        "runtime_compiled": measured(runtime_compiled),
        "lightning": measured(lightning),
        "mfu": measured(mfu),
        "optimizers": measured(optimizers),
        "memory": measured(memory),
    }
    checks = [Planned(name, 1, runs[name]) for name in ONE_DEVICE]
    for case in EXACT_CASES:
        run = functools.partial(exactness, accelerator, tolerance, [case])
        checks.append(Planned(f"exactness {case.name}", case.devices, run))
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


def select(checks: list[Planned], only: list[str] | None, skip: list[str] | None) -> list[Planned]:
    """The checks ``--only`` and ``--skip`` leave. A name matches a check's whole name or its first word
    (``exactness`` names every exactness case).

    Raises:
        SystemExit: A name matches no check (before anything runs).
    """
    known = {c.name for c in checks} | {c.name.split()[0] for c in checks}
    unknown = [name for name in (only or []) + (skip or []) if name not in known]
    if unknown:
        sys.exit(f"Unknown check(s) {unknown}; the checks are: {', '.join(c.name for c in checks)}.")

    def matches(check: Planned, names: list[str]) -> bool:
        return check.name in names or check.name.split()[0] in names

    return [c for c in checks if (only is None or matches(c, only)) and not (skip and matches(c, skip))]


class Report:
    """The JSON report, rewritten whole after every row (a temporary file renamed over it: never half written),
    and each row printed as it comes."""

    def __init__(self, path: Path, header: dict) -> None:
        self.path, self.header, self.rows, self.started = path, header, [], time.perf_counter()
        self.write(finished=False)

    def add(self, row: dict) -> None:
        row["at_s"] = round(time.perf_counter() - self.started, 1)
        self.rows.append(row)
        print_row(row)
        self.write(finished=False)

    @property
    def ok(self) -> bool:
        return all(r["ok"] for r in self.rows)

    def write(self, finished: bool) -> None:
        report = {**self.header, "finished": finished, "seconds": round(time.perf_counter() - self.started, 1),
                  "ok": self.ok, "results": self.rows}  # fmt: skip
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text(json.dumps(report, indent=1, default=str))
        os.replace(partial, self.path)


def run_check(check: Planned, report: Report) -> None:
    """Run one check, recording each of its rows as it comes; an exception becomes a failed row and the next
    check still runs."""
    try:
        for row in check.run():
            report.add(row)
    except Exception as error:  # a failed check is reported, the others still run
        report.add({"check": check.name, "ok": False, "error": "".join(traceback.format_exception(error))[-3000:]})
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _fmt(value, spec: str = ".3g") -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_fmt(v, spec) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_fmt(v, spec)}" for k, v in value.items()) + "}"
    return format(value, spec) if isinstance(value, float) else str(value)


def print_row(row: dict) -> None:
    name = row.get("case") or row.get("optimizer") or row.get("schedule") or row.get("variant", "")
    details = {
        k: v
        for k, v in row.items()
        if k not in ("check", "ok", "stages", "microbatches", "schedule", "variant", "case", "optimizer", "error")
    }
    line = f"{row['check']:<16} {str(row['ok']):<5} {row.get('stages', ''):>2} {row.get('microbatches', ''):>3} "
    print(line + f"{name:<20} " + " ".join(f"{k}={_fmt(v)}" for k, v in details.items()), flush=True)
    if "error" in row:
        print("    " + row["error"].strip().splitlines()[-1][:300], flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="run the checks on CPU (gloo, tiny model)")
    parser.add_argument("--devices", type=int, default=3, help="with --cpu: processes a check may use (default 3)")
    parser.add_argument("--out", default="gpu_check.json")
    parser.add_argument("--only", nargs="+", metavar="CHECK", help="run only these checks")
    parser.add_argument("--skip", nargs="+", metavar="CHECK", help="run all but these checks")
    parser.add_argument("--steps", type=int, default=None, help="timed steps of the one-device measurements")
    parser.add_argument("--warmup", type=int, default=None, help="steps before the timed ones")
    parser.add_argument("--repeats", type=int, default=None, help="several-device throughput repetitions (GPU 3)")
    args = parser.parse_args(argv)
    if args.cpu:
        torch.set_num_threads(1)  # as every pipeline process: the reference then computes the same sums
        accelerator, count, tolerance, model, device = "cpu", args.devices, 1e-5, CPU_MODEL, torch.device("cpu")
        size, compile_option = TINY, {"backend": "aot_eager"}  # inductor's C++ build would dominate the run
    else:
        count = torch.cuda.device_count()
        if count < 1:
            sys.exit("No GPU found; run with --cpu for the CPU version of these checks.")
        accelerator, tolerance, model, device = "gpu", 1e-3, GPU_MODEL, torch.device("cuda", 0)
        size, compile_option = REAL, {}
    size = replace(size, steps=args.steps or size.steps, warmup=args.warmup or size.warmup)
    bench = functools.cache(lambda: Bench(device, size, compile_option))
    checks, skipped = plan(count, args.cpu, tolerance, model, args.repeats or (1 if args.cpu else 3), bench)
    checks = select(checks, args.only, args.skip)
    import lightning

    header = {
        "accelerator": accelerator, "devices": count,
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "lightning": lightning.__version__, "size": size.__dict__,
        "checks": [c.name for c in checks], "skipped": skipped,
    }  # fmt: skip
    report = Report(Path(args.out), header)
    for row in skipped:
        print(f"skipped: {row['check']}: {row['reason']}", flush=True)
    for check in checks:
        print(f"running: {check.name}", flush=True)
        run_check(check, report)
    report.write(finished=True)
    print(f"{'all checks passed' if report.ok else 'SOME CHECKS FAILED'} in {time.perf_counter() - report.started:.1f}"
          f" s; wrote {args.out}")  # fmt: skip
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
