"""Training throughput and memory of this package's pipelines against the synchronous peers.

Variants, all on the same demo GPT, the same stage split, the same batches and the same micro-batch count:

* ``async_pp_2bw``: :class:`~lightning_async_pp.AsyncPipelineStrategy` with ``schedule="2bw"`` (no flush);
* ``async_pp_1f1b``: the same strategy with ``schedule="1f1b"`` (synchronous, flushed every step);
* ``torch_1f1b`` / ``torch_gpipe``: ``torch.distributed.pipelining``'s ``Schedule1F1B`` / ``ScheduleGPipe``
  with a ``PipelineStage`` per process, each stage an ``nn.Sequential`` of the same GPT layers, AdamW per
  stage, gradients averaged over the micro-batches (``scale_grads=True``);
* ``single_process``: no pipeline, one process with as many intra-op threads as the pipelines have
  processes, the whole batch in one forward/backward, plain PyTorch loop;
* optionally ``async_pp_2bw_dc`` (``--with-corrected``): 2BW with ``DelayCorrected(AdamW)``, for memory.

The strategy's own overhead is measured at P=1: ``p1_async_pp_1f1b`` (``strategy="1f1b"`` with
``devices=1``, ``num_microbatches=1``) against ``p1_lightning`` (the same Trainer settings without the
strategy: Lightning calls ``GPT.training_step``).

Every variant is a multi-process job, so the benchmark starts each repetition of each variant as its own
worker subprocess (``--worker NAME``; Lightning's launcher, or the worker itself for the torch peers, starts
the other ranks), one intra-op thread per pipeline process. Repetitions are interleaved
(A B C D E A B C D E ...), so a change of machine load hits every variant alike. Each worker times its
steps on every stage (``time.perf_counter`` at every step end), drops the first ``--warmup`` steps and
reports:

* ``tokens_per_sec``: tokens of the measured steps / time from the end of the last warm-up step to the end
  of the last step, on the last stage (the one with the loss);
* per stage ``busy`` time (forward, backward, loss and optimizer compute: the engine's own ``StepStats``
  for this package; hooks on ``PipelineStage.forward_one_chunk``/``backward_one_chunk``, the loss
  function and ``optimizer.step`` for the torch peers) and ``idle`` time (the rest of the window: waiting
  for neighbours, communication calls and framework overhead); ``bubble_fraction = idle / window``;
* ``peak_rss_mb`` per stage: ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` of the stage's process;
* ``peak_heap_mb`` per stage: the largest heap in use after any forward, backward or update (glibc's
  ``mallinfo2``; see :class:`HeapPeak`): the memory targets are checked on it, RSS being too coarse.

The reported value of each variant is the median over repetitions; ratios against ``torch_1f1b`` are given
as ratios of medians and as the median of per-repetition ratios ("paired"). With ``--simulate`` (on by
default), each async variant's measured per-stage forward/backward/update costs and the transfer latency
read from its Chrome trace are fed to :func:`lightning_async_pp.schedule.simulate.simulate`, and the
predicted tokens/s is reported next to the measured one.

Usage::

    python benchmarks/throughput.py --quick --out benchmarks/results/throughput/throughput_quick.json
    python benchmarks/throughput.py --out benchmarks/results/throughput/throughput_full.json  # M 2, 4, 8 x P 2, 4

P=4 on a 2-core machine runs 4 processes on 2 cores: its numbers measure oversubscription as much as the
schedules, and the output says so.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench_common import heap_in_use, machine_description, run_ranks

PIPELINE_VARIANTS = ("async_pp_2bw", "async_pp_1f1b", "torch_1f1b", "torch_gpipe", "single_process")
CORRECTED_VARIANT = "async_pp_2bw_dc"
OVERHEAD_VARIANTS = ("p1_async_pp_1f1b", "p1_lightning")
OVERHEAD_JOB = "p1_overhead"
ASYNC_VARIANTS = ("async_pp_2bw", "async_pp_1f1b", CORRECTED_VARIANT)
BASELINE = "torch_1f1b"
TARGETS = {
    "async_pp_2bw_vs_torch_1f1b": ">= 1.15",
    "async_pp_1f1b_vs_torch_1f1b": "within 0.95..1.05",
    "p1_overhead": "p1_async_pp_1f1b within 5% of p1_lightning",
    "memory_2bw": "peak heap per stage <= async_pp_1f1b's + one copy of the stage's weights",
    "memory_2bw_dc": "peak heap per stage <= async_pp_1f1b's + two copies of the stage's weights",
}
ENV_DROP = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "LOCAL_RANK",
    "NODE_RANK",
    "WORLD_SIZE",
    "GLOBAL_RANK",
    "RANK",
    "LOCAL_WORLD_SIZE",
    "PL_GLOBAL_SEED",
    "BENCH_RANK",
)


# ------------------------------------------------------------------------------------------ configuration


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--width", type=int, default=128, help="GPT width (n_embd)")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per step (split into M micro-batches)")
    parser.add_argument("--warmup", type=int, default=None, help="steps left out of the timing (default 5, quick 3)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 20, quick 10)")
    parser.add_argument(
        "--accelerator",
        default="cpu",
        choices=["cpu", "gpu"],
        help="gpu: one GPU per pipeline process, NCCL (used by scripts/gpu_check.py)",
    )


def build_model(args: argparse.Namespace):
    from lightning_async_pp.demos import GPT

    return GPT(
        vocab_size=256,
        block_size=args.seq,
        n_layer=args.layers,
        n_head=args.heads,
        n_embd=args.width,
        lr_schedule="constant",
    )


def make_batches(args: argparse.Namespace, seed: int = 0):
    from lightning_async_pp.demos.data import random_token_batches

    return random_token_batches(args.warmup + args.steps, args.batch_size, args.seq, seed=seed)


def split_points(args: argparse.Namespace, num_stages: int) -> list[int]:
    """Stage boundaries balanced by parameter count (the strategy's default), shared by every variant."""
    from lightning_async_pp.schedule.partition import balanced_partition, count_parameters

    model = build_model(args)
    starts = balanced_partition([count_parameters(layer) for layer in model.pipeline_layers()], num_stages)
    return starts[1:]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


class HeapPeak:
    """Largest heap in use (MiB) seen at the sampling points: tensors' memory, without the RSS noise.

    The peak RSS of a stage process is ~400 MiB of libraries and allocator slack, so differences of a copy of
    a stage's weights (~2 MiB here) are lost in it. glibc's ``mallinfo2`` gives the bytes the allocator has
    handed out and not got back (``uordblks``, small blocks, plus ``hblkhd``, mmapped large blocks); CPU
    tensors are allocated through it. Sampled after every forward, backward and update (where the live
    activations, gradients and weight versions are at their largest), not inside them: temporaries of a
    single kernel are not counted. ``None`` where glibc is not the allocator.
    """

    def __init__(self) -> None:
        self.available = heap_in_use() is not None
        self.peak = 0

    def sample(self) -> None:
        if self.available:
            self.peak = max(self.peak, heap_in_use())

    def wrap(self, fn):
        def sampled(*a, **k):
            try:
                return fn(*a, **k)
            finally:
                self.sample()

        return sampled

    def mb(self) -> float | None:
        return self.peak / 2**20 if self.available else None


HEAP = HeapPeak()
HEAP_SLACK_MB = 0.1


def _write(path: Path, record: dict) -> None:
    from lightning_async_pp.files import atomic_write_text

    atomic_write_text(path, json.dumps(record))


# ------------------------------------------------------------------------------------------ workers


def worker(args: argparse.Namespace) -> None:
    import torch

    name = args.worker
    threads = args.stages if name == "single_process" else 1
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    if name in ASYNC_VARIANTS:
        _lightning_worker(args)
    elif name == OVERHEAD_JOB:
        _overhead_worker(args)
    elif name in ("torch_1f1b", "torch_gpipe"):
        _torch_pipeline_worker(args)
    elif name == "single_process":
        _single_process_worker(args)
    else:
        raise ValueError(f"unknown variant {name!r}")


def _window_sync(args: argparse.Namespace, step: int) -> None:
    """On GPUs, wait for the device at the two ends of the timed window only (never inside it)."""
    if args.accelerator == "gpu" and step in (args.warmup - 1, args.warmup + args.steps - 1):
        import torch

        torch.cuda.synchronize()


def _peak_gpu_mb(args: argparse.Namespace) -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 2**20 if args.accelerator == "gpu" else None


class _StepClock:
    """Lightning callback recording ``time.perf_counter()`` at the end of every training step."""

    def __new__(cls, args: argparse.Namespace | None = None):
        from lightning.pytorch import Callback

        class StepClock(Callback):
            def __init__(self) -> None:
                self.ends: list[float] = []

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
                if args is not None:
                    _window_sync(args, len(self.ends))
                self.ends.append(time.perf_counter())

        return StepClock()


def _trainer(devices: int, strategy: Any, clock: Any, args: argparse.Namespace):
    from lightning.pytorch import Trainer

    return Trainer(
        accelerator=args.accelerator,
        devices=devices,
        strategy=strategy,
        max_steps=args.warmup + args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[clock],
    )


def _loader(args: argparse.Namespace):
    from torch.utils.data import DataLoader

    return DataLoader(make_batches(args), batch_size=None, shuffle=False)


def _lightning_worker(args: argparse.Namespace) -> None:
    import torch

    from lightning_async_pp import AsyncPipelineStrategy

    name = args.worker
    model = build_model(args)
    if name == CORRECTED_VARIANT:
        from lightning_async_pp.optim import DelayCorrected

        model.optimizer_factory = lambda params: DelayCorrected(torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1))
    strategy = AsyncPipelineStrategy(
        schedule="2bw" if "2bw" in name else "1f1b",
        num_microbatches=args.microbatches,
        split_points=[int(x) for x in args.split_points.split(",")],
        trace_dir=str(Path(args.result_dir) / "trace") if args.trace else None,
    )
    from lightning_async_pp.runtime import register_action_observer
    from lightning_async_pp.schedule import Op

    sampled = (Op.FORWARD, Op.BACKWARD, Op.UPDATE)
    register_action_observer(lambda action, begin, end: HEAP.sample() if action.op in sampled else None)
    clock = _StepClock(args)
    trainer = _trainer(args.stages, strategy, clock, args)
    trainer.fit(model, train_dataloaders=_loader(args))
    rank = trainer.global_rank
    params = [p for p in model.parameters() if p.requires_grad and not p.is_meta]
    record: dict[str, Any] = {
        "rank": rank,
        "stage": strategy.stage,
        "ends": clock.ends,
        "peak_rss_mb": peak_rss_mb(),
        "peak_heap_mb": HEAP.mb(),
        "stage_weight_mb": sum(p.numel() * p.element_size() for p in params) / 2**20,
        "peak_gpu_mb": _peak_gpu_mb(args),
    }
    if rank == 0:
        record["stage_stats"] = {str(s): [asdict(r) for r in records] for s, records in strategy.stage_stats.items()}
    _write(Path(args.result_dir) / f"rank{rank}.json", record)


def _overhead_worker(args: argparse.Namespace) -> None:
    """P=1: the strategy's "1f1b" (num_microbatches=1) and plain Lightning, alternately in one process (ABBA)."""
    from lightning_async_pp import AsyncPipelineStrategy

    tokens = args.batch_size * args.seq * args.steps
    record: dict[str, list[float]] = {name: [] for name in OVERHEAD_VARIANTS}
    for name in ("p1_lightning", "p1_async_pp_1f1b", "p1_async_pp_1f1b", "p1_lightning"):
        strategy = AsyncPipelineStrategy(schedule="1f1b", num_microbatches=1) if name == "p1_async_pp_1f1b" else "auto"
        clock = _StepClock()
        _trainer(1, strategy, clock, args).fit(build_model(args), train_dataloaders=_loader(args))
        record[name].append(tokens / (clock.ends[-1] - clock.ends[args.warmup - 1]))
    _write(Path(args.result_dir) / "rank0.json", {"rank": 0, "stage": 0, "tokens_per_sec": record})


class _Busy:
    """Adds the time spent inside wrapped callables."""

    def __init__(self) -> None:
        self.total = 0.0

    def wrap(self, fn):
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.total += time.perf_counter() - t0

        return timed


def _torch_pipeline_worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    P, M = args.stages, args.microbatches
    rank = int(os.environ["RANK"])  # MASTER_ADDR/MASTER_PORT/WORLD_SIZE come from the orchestrator
    gpu = args.accelerator == "gpu"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if gpu else "gloo", rank=rank, world_size=P, device_id=device if gpu else None)
    stage_index = rank  # torch's convention: stage s on rank s (the loss on rank P - 1)
    model = build_model(args)
    starts = [0, *[int(x) for x in args.split_points.split(",")]]
    layers = list(model.pipeline_layers())
    bounds = [*starts, len(layers)]
    module = nn.Sequential(*layers[bounds[stage_index] : bounds[stage_index + 1]]).to(device)
    del model, layers
    busy = _Busy()
    stage = PipelineStage(module, stage_index, P, device)
    stage.forward_one_chunk = HEAP.wrap(busy.wrap(stage.forward_one_chunk))
    stage.backward_one_chunk = HEAP.wrap(busy.wrap(stage.backward_one_chunk))

    def loss_fn(output, target):
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))

    kind = Schedule1F1B if args.worker == "torch_1f1b" else ScheduleGPipe
    schedule = kind(stage, M, loss_fn=busy.wrap(loss_fn))
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=0.1)
    optimizer_step = HEAP.wrap(busy.wrap(optimizer.step))
    ends, busy_per_step = [], []
    is_last = stage_index == P - 1
    for x, y in make_batches(args):
        x, y = x.to(device), y.to(device)
        before = busy.total
        optimizer.zero_grad(set_to_none=True)
        # return_outputs=False: the last stage does not concatenate the logits (this package does not either)
        if stage_index == 0:
            schedule.step(x, return_outputs=False)
        elif is_last:
            schedule.step(target=y, losses=[], return_outputs=False)
        else:
            schedule.step(return_outputs=False)
        optimizer_step()
        _window_sync(args, len(ends))
        ends.append(time.perf_counter())
        busy_per_step.append(busy.total - before)
    record = {
        "rank": rank,
        "stage": stage_index,
        "ends": ends,
        "busy": busy_per_step,
        "peak_rss_mb": peak_rss_mb(),
        "peak_heap_mb": HEAP.mb(),
        "peak_gpu_mb": _peak_gpu_mb(args),
        "stage_weight_mb": sum(p.numel() * p.element_size() for p in module.parameters()) / 2**20,
    }
    _write(Path(args.result_dir) / f"rank{rank}.json", record)
    dist.destroy_process_group()


def _single_process_worker(args: argparse.Namespace) -> None:
    import torch

    model = build_model(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    ends = []
    for batch in make_batches(args):
        optimizer.zero_grad(set_to_none=True)
        loss = model.pipeline_loss(model(model.pipeline_inputs(batch)), batch)
        HEAP.sample()
        loss.backward()
        HEAP.sample()
        optimizer.step()
        HEAP.sample()
        ends.append(time.perf_counter())
    busy = [b - a for a, b in zip([ends[0], *ends], ends)]
    weight_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    record = {
        "rank": 0,
        "stage": 0,
        "ends": ends,
        "busy": busy,
        "peak_rss_mb": peak_rss_mb(),
        "peak_heap_mb": HEAP.mb(),
        "stage_weight_mb": weight_mb,
    }
    _write(Path(args.result_dir) / "rank0.json", record)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------ one job


def run_job(
    name: str,
    num_stages: int,
    num_microbatches: int,
    args: argparse.Namespace,
    splits: Sequence[int],
    workdir: Path,
    timeout: float,
) -> dict[str, Any]:
    """Run one repetition of one variant as a subprocess; return its measurements (``error`` on failure)."""
    result_dir = workdir / f"{name}_P{num_stages}_M{num_microbatches}_{time.monotonic_ns()}"
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        name,
        "--stages",
        str(num_stages),
        "--microbatches",
        str(num_microbatches),
        "--split-points",
        ",".join(map(str, splits)),
        "--result-dir",
        str(result_dir),
        "--width",
        str(args.width),
        "--layers",
        str(args.layers),
        "--heads",
        str(args.heads),
        "--seq",
        str(args.seq),
        "--batch-size",
        str(args.batch_size),
        "--warmup",
        str(args.warmup),
        "--steps",
        str(args.steps),
        "--accelerator",
        args.accelerator,
    ]
    if name in ASYNC_VARIANTS and args.simulate:
        command.append("--trace")
    env = {k: v for k, v in os.environ.items() if k not in ENV_DROP}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else root
    ranks = num_stages if name not in ("single_process", OVERHEAD_JOB) else 1
    if ranks > 1:
        # All ranks start at once (as torchrun would): with LOCAL_RANK set, Lightning does not launch them itself.
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(ranks), NODE_RANK="0")
    started = time.perf_counter()
    result_dir.mkdir(parents=True)
    # One process group per job, so that a timeout kills every rank (and anything they started).
    envs = [dict(env, RANK=str(rank), LOCAL_RANK=str(rank)) if ranks > 1 else env for rank in range(ranks)]
    logs = [open(result_dir.with_name(result_dir.name + f".rank{rank}.log"), "w") for rank in range(ranks)]
    try:
        code = run_ranks(command, envs, logs, timeout, cwd=root)
    finally:
        for log in logs:
            log.close()
    elapsed = time.perf_counter() - started
    files = [result_dir / f"rank{r}.json" for r in range(ranks)]
    if code != 0 or not all(f.exists() for f in files):
        tail = "".join(f.read_text()[-2000:] for f in sorted(result_dir.parent.glob(result_dir.name + ".rank*.log")))
        why = "timed out" if code is None else f"exit code {code}"
        return {"error": f"{name} P={num_stages} M={num_microbatches}: {why}\n{tail}", "job_seconds": elapsed}
    records = [json.loads(f.read_text()) for f in files]
    if name == OVERHEAD_JOB:
        return {"tokens_per_sec": records[0]["tokens_per_sec"], "job_seconds": elapsed}
    measured = summarize_job(name, records, args, num_microbatches)
    trace = result_dir / "trace" / "pipeline_trace.json"
    if trace.exists():
        measured["trace"] = str(trace)
    measured["job_seconds"] = elapsed
    return measured


def summarize_job(name: str, records: list[dict], args: argparse.Namespace, num_microbatches: int) -> dict[str, Any]:
    """Tokens/s and per-stage busy/idle/RSS from the per-rank records of one job."""
    W, N = args.warmup, args.steps
    tokens_per_step = args.batch_size * args.seq
    by_stage = sorted(records, key=lambda r: r["stage"])
    stats = next((r["stage_stats"] for r in records if "stage_stats" in r), None)
    stages = []
    for record in by_stage:
        ends = record["ends"]
        window = ends[W + N - 1] - ends[W - 1]
        entry = {
            "stage": record["stage"],
            "window_s": window,
            "peak_rss_mb": record["peak_rss_mb"],
            "peak_heap_mb": record.get("peak_heap_mb"),
            "stage_weight_mb": record["stage_weight_mb"],
            "peak_gpu_mb": record.get("peak_gpu_mb"),
        }
        if stats is not None:
            steps = [s for s in stats[str(record["stage"])] if W <= s["step"] < W + N]
            busy = sum(s["forward"] + s["backward"] + s["update"] for s in steps)
            entry["engine_wait_fraction"] = sum(s["wait"] for s in steps) / max(sum(s["wall"] for s in steps), 1e-12)
            entry["forward_s_per_mb"] = sum(s["forward"] for s in steps) / (len(steps) * num_microbatches)
            entry["backward_s_per_mb"] = sum(s["backward"] for s in steps) / (len(steps) * num_microbatches)
            entry["update_s_per_step"] = sum(s["update"] for s in steps) / len(steps)
        elif "busy" in record:
            busy = sum(record["busy"][W : W + N])
        else:  # plain Lightning at P=1: no breakdown
            busy = None
        if busy is not None:
            entry["busy_s"] = busy
            entry["idle_s"] = max(0.0, window - busy)
            entry["bubble_fraction"] = entry["idle_s"] / window
        stages.append(entry)
    last = stages[-1]
    return {
        "tokens_per_sec": tokens_per_step * N / last["window_s"],
        "step_ms": 1e3 * last["window_s"] / N,
        "stages": stages,
    }


# ------------------------------------------------------------------------------------------ simulator check


def _trace_events(trace_path: str | Path) -> list[tuple[int, str, int, float, float]]:
    """``(stage, op, global micro-batch or step, start, end)`` of every action in an engine trace (seconds)."""
    from lightning_async_pp.schedule import Action

    out = []
    for e in json.loads(Path(trace_path).read_text())["traceEvents"]:
        if e.get("ph") != "X":
            continue
        # Parsed as if M = 1, the step is the global micro-batch index (an update's, its step); the weight
        # version, which depends on the schedule kind, is not used.
        action = Action.from_str(e["name"], 1, kind="1f1b")
        out.append((e["tid"], action.op.value, action.step, e["ts"] * 1e-6, (e["ts"] + e["dur"]) * 1e-6))
    return out


def trace_transfer_seconds(trace_path: str | Path) -> float:
    """Median latency of activation/gradient transfers seen in a Chrome trace of the engine.

    For each receive that was posted before its sender started sending (so the receiver really waited
    for the data), latency = end of the receive - start of the matching send on the neighbouring stage.
    """
    sends, recvs = {}, []
    for stage, op, index, start, end in _trace_events(trace_path):
        if op in ("SF", "SB"):
            sends[(op[1], stage + 1 if op == "SF" else stage - 1, index)] = start
        elif op in ("RF", "RB"):
            recvs.append((op[1], stage, index, start, end))
    latencies = []
    for direction, stage, index, start, end in recvs:
        sent = sends.get((direction, stage, index))
        if sent is not None and start <= sent:
            latencies.append(end - sent)
    return statistics.median(latencies) if latencies else 0.0


def trace_step_overhead(trace_path: str | Path, num_microbatches: int, first_step: int = 0) -> list[float]:
    """Per stage, median host time between its share of one step and the next (outside the engine's actions).

    That is the gap before the first action of each step ``t > first_step`` on the stage: the training loop,
    data loading and hooks, plus any wait for another rank in a collective the trainer runs between steps.
    """
    per_stage: dict[int, list[tuple[float, float, int]]] = {}
    for stage, op, index, start, end in _trace_events(trace_path):
        step = index if op == "U" else index // num_microbatches
        per_stage.setdefault(stage, []).append((start, end, step if op != "U" else -1))
    out = []
    for stage in sorted(per_stage):
        events = sorted(per_stage[stage])
        gaps, seen = [], set()
        for previous, (start, _, step) in zip(events, events[1:]):
            if step > first_step and step not in seen:
                seen.add(step)
                gaps.append(max(0.0, start - previous[1]))
            elif step >= 0:
                seen.add(step)
        out.append(statistics.median(gaps) if gaps else 0.0)
    return out


def simulate_job(
    name: str,
    measured: dict[str, Any],
    num_stages: int,
    num_microbatches: int,
    args: argparse.Namespace,
    transfer: float,
    step_overhead: Sequence[float] | float = 0.0,
) -> float:
    """Tokens/s the schedule simulator predicts from a job's measured per-stage costs."""
    from lightning_async_pp.schedule import build_schedule
    from lightning_async_pp.schedule.simulate import StageCosts, simulate

    costs = [
        StageCosts(forward=s["forward_s_per_mb"], backward=s["backward_s_per_mb"], update=s["update_s_per_step"])
        for s in measured["stages"]
    ]
    kind = "2bw" if "2bw" in name else "1f1b"
    schedule = build_schedule(kind, num_stages, num_microbatches, max(8, args.warmup + args.steps))
    result = simulate(schedule, costs, transfer=transfer, step_overhead=step_overhead)
    tokens_per_microbatch = args.batch_size // num_microbatches * args.seq
    return result.steady_throughput * tokens_per_microbatch


def replay_job(
    name: str,
    trace_path: str | Path,
    num_stages: int,
    num_microbatches: int,
    args: argparse.Namespace,
    transfer: float,
    step_overhead: Sequence[float],
) -> float:
    """Tokens/s of the simulator fed every action's *measured* duration from a job's trace (a replay).

    Same timed window as the measurement (the end of the last stage's update of the last warm-up step to that
    of the last step). Where it matches the measured tokens/s, the run is fully explained by its compute
    times, its host time between steps and the schedule's dependencies: no wait the engine adds on its own.
    """
    from lightning_async_pp.schedule import Op, build_schedule
    from lightning_async_pp.schedule.simulate import StageCosts, simulate

    durations = {
        f"{stage}{op}{index}": end - start
        for stage, op, index, start, end in _trace_events(trace_path)
        if op in ("F", "B", "U", "SF", "SB")
    }
    kind = "2bw" if "2bw" in name else "1f1b"
    schedule = build_schedule(kind, num_stages, num_microbatches, args.warmup + args.steps)
    result = simulate(
        schedule, StageCosts(0.0, 0.0), transfer=transfer, step_overhead=step_overhead, durations=durations
    )
    updates = {ev.action.step: ev.end for ev in result.timelines[-1] if ev.action.op is Op.UPDATE}
    window = updates[args.warmup + args.steps - 1] - updates[args.warmup - 1]
    return args.batch_size * args.seq * args.steps / window


# ------------------------------------------------------------------------------------------ the run


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def configurations(args: argparse.Namespace) -> list[tuple[int, int]]:
    if args.quick:
        return [(2, 4)]
    return [(p, m) for p in args.stage_counts for m in args.microbatch_counts]


def variants_for(num_stages: int, num_microbatches: int, args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """Variants that can run at (P, M) and, for the others, why not."""
    names = list(args.variants)
    if args.with_corrected and CORRECTED_VARIANT not in names:
        names.insert(1, CORRECTED_VARIANT)
    skipped = {}
    for name in list(names):
        if name in ("async_pp_2bw", CORRECTED_VARIANT) and num_microbatches < num_stages:
            skipped[name] = "2bw needs M >= P"
        elif name == "torch_1f1b" and num_microbatches < num_stages:
            skipped[name] = "torch Schedule1F1B needs M >= P"
        elif args.batch_size % num_microbatches:
            skipped[name] = "batch size not a multiple of M"
    return [n for n in names if n not in skipped], skipped


def machine_state() -> dict[str, Any]:
    """The machine, and its load average now (the benchmark records it before and after the run)."""
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return dict(machine_description(), loadavg=load)


def orchestrate(args: argparse.Namespace) -> dict[str, Any]:
    configs = configurations(args)
    splits = {p: split_points(args, p) for p in sorted({p for p, _ in configs})}
    jobs: list[tuple[str, int, int]] = []  # one round, interleaved
    skipped: dict[str, str] = {}
    single_done: set[int] = set()
    for p, m in configs:
        names, why = variants_for(p, m, args)
        skipped.update({f"{n} P={p} M={m}": reason for n, reason in why.items()})
        for n in names:
            if n == "single_process":  # independent of M: once per P
                if p in single_done:
                    continue
                single_done.add(p)
            jobs.append((n, p, m))
    if args.overhead:
        jobs.append((OVERHEAD_JOB, 1, 1))
    oversubscribed = [p for p in splits if p > (os.cpu_count() or 1)]
    if oversubscribed:
        print(
            f"NOTE: P={oversubscribed} runs more single-threaded processes than this machine has cores "
            f"({os.cpu_count()}): those numbers measure oversubscription as much as the schedules.",
            flush=True,
        )
    workdir = Path(tempfile.mkdtemp(prefix="async_pp_bench_"))
    raw: dict[tuple[str, int, int], list[dict]] = {job: [] for job in jobs}
    errors = []
    started = time.perf_counter()
    machine_before = machine_state()
    print(
        f"{len(jobs)} jobs x {args.repeats} repetitions, interleaved; load average {machine_before['loadavg']}",
        flush=True,
    )
    for rep in range(args.repeats):
        for job in jobs:
            name, p, m = job
            result = run_job(name, p, m, args, splits.get(p, []), workdir, args.timeout)
            if "error" in result:
                errors.append(result["error"])
                print(f"  rep {rep} {name:20s} P={p} M={m}: FAILED ({result['error'].splitlines()[0]})", flush=True)
                continue
            result["rep"] = rep
            raw[job].append(result)
            if name == OVERHEAD_JOB:
                shown = ", ".join(f"{k} {statistics.mean(v):.0f}" for k, v in result["tokens_per_sec"].items())
            else:
                shown = f"{result['tokens_per_sec']:9.0f}"
            print(
                f"  rep {rep} {name:20s} P={p} M={m}: {shown} tokens/s ({result['job_seconds']:.1f}s job)", flush=True
            )
    results = aggregate(raw, args)
    report = {
        "config": {
            "model": {"width": args.width, "blocks": args.layers, "heads": args.heads, "seq": args.seq, "vocab": 256},
            "batch_size": args.batch_size,
            "warmup_steps": args.warmup,
            "timed_steps": args.steps,
            "repeats": args.repeats,
            "split_points": {str(p): s for p, s in splits.items()},
            "threads_per_pipeline_process": 1,
            "optimizer": "AdamW(lr=1e-3, weight_decay=0.1)",
            "quick": args.quick,
        },
        "machine": {"before": machine_before, "after": machine_state()},
        "oversubscribed_stage_counts": oversubscribed,
        "skipped": skipped,
        "results": results,
        "ratios_vs_torch_1f1b": ratios(results, raw),
        "errors": errors,
        "seconds": time.perf_counter() - started,
    }
    report["targets"] = check_targets(report)
    if args.simulate:
        report["simulator"] = simulator_check(raw, args)
    if not args.keep_workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        report["workdir"] = str(workdir)
    return report


def aggregate(raw: dict[tuple[str, int, int], list[dict]], args: argparse.Namespace) -> list[dict[str, Any]]:
    results = []
    for (name, p, m), reps in raw.items():
        if not reps:
            continue
        if name == OVERHEAD_JOB:
            results += _overhead_results(reps)
            continue
        num = len(reps[0]["stages"])

        def per_stage(key: str) -> list[float | None]:
            out = []
            for s in range(num):
                values = [r["stages"][s][key] for r in reps if r["stages"][s].get(key) is not None]
                out.append(_median(values) if values else None)
            return out

        steps = args.steps
        busy, idle = per_stage("busy_s"), per_stage("idle_s")
        entry = {
            "name": name,
            "num_stages": p,
            "num_microbatches": None if name == "single_process" else m,
            "repetitions": len(reps),
            "tokens_per_sec": _median([r["tokens_per_sec"] for r in reps]),
            "tokens_per_sec_all": [r["tokens_per_sec"] for r in reps],
            "step_ms": _median([r["step_ms"] for r in reps]),
            "peak_rss_mb": per_stage("peak_rss_mb"),
            "peak_heap_mb": per_stage("peak_heap_mb"),
            "peak_gpu_mb": per_stage("peak_gpu_mb"),
            "bubble_fraction": per_stage("bubble_fraction"),
            "busy_ms_per_step": [None if b is None else 1e3 * b / steps for b in busy],
            "idle_ms_per_step": [None if i is None else 1e3 * i / steps for i in idle],
            "stage_weight_mb": per_stage("stage_weight_mb"),
        }
        if name in ASYNC_VARIANTS and name != "p1_async_pp_1f1b":
            entry["engine_wait_fraction"] = per_stage("engine_wait_fraction")
        if name == "single_process":
            entry["threads"] = p
        results.append(entry)
    return results


def _overhead_results(reps: list[dict]) -> list[dict[str, Any]]:
    """P=1 pair; ``paired_ratio`` is the median over jobs of (strategy / plain), each job an ABBA sequence."""
    out = []
    for name in OVERHEAD_VARIANTS:
        values = [v for r in reps for v in r["tokens_per_sec"][name]]
        out.append(
            {
                "name": name,
                "num_stages": 1,
                "num_microbatches": 1,
                "repetitions": len(values),
                "tokens_per_sec": _median(values),
                "tokens_per_sec_all": values,
                "threads": 1,
            }
        )
    paired = [
        statistics.mean(r["tokens_per_sec"]["p1_async_pp_1f1b"]) / statistics.mean(r["tokens_per_sec"]["p1_lightning"])
        for r in reps
    ]
    out[0]["paired_ratio_vs_p1_lightning"] = _median(paired)
    return out


def _find(results, name, p, m=None):
    for r in results:
        if r["name"] == name and r["num_stages"] == p and (m is None or r["num_microbatches"] in (m, None)):
            return r
    return None


def ratios(results: list[dict], raw: dict) -> list[dict[str, Any]]:
    """Per (P, M): each variant's tokens/s over torch_1f1b's (ratio of medians, and paired by repetition)."""
    out = []
    configs = sorted(
        {(r["num_stages"], r["num_microbatches"]) for r in results if r["num_microbatches"] and r["num_stages"] > 1}
    )
    for p, m in configs:
        base = _find(results, BASELINE, p, m)
        base_reps = {r["rep"]: r["tokens_per_sec"] for r in raw.get((BASELINE, p, m), [])}
        row: dict[str, Any] = {"num_stages": p, "num_microbatches": m, "baseline": BASELINE if base else None}
        for name in [*PIPELINE_VARIANTS, CORRECTED_VARIANT]:
            r = _find(results, name, p, m)
            if r is None or base is None:
                continue
            reps = raw.get((name, p, m)) or next((v for k, v in raw.items() if k[0] == name and k[1] == p), [])
            paired = [x["tokens_per_sec"] / base_reps[x["rep"]] for x in reps if x["rep"] in base_reps]
            row[name] = {"ratio": r["tokens_per_sec"] / base["tokens_per_sec"], "paired_ratio": _median(paired)}
        out.append(row)
    return out


def check_targets(report: dict[str, Any]) -> dict[str, Any]:
    results = report["results"]
    out: dict[str, Any] = {}
    row = next((r for r in report["ratios_vs_torch_1f1b"] if (r["num_stages"], r["num_microbatches"]) == (2, 4)), None)
    if row is not None:
        if "async_pp_2bw" in row:
            value = row["async_pp_2bw"]["ratio"]
            out["async_pp_2bw_vs_torch_1f1b"] = {
                "value": value,
                "target": TARGETS["async_pp_2bw_vs_torch_1f1b"],
                "met": value >= 1.15,
            }
        if "async_pp_1f1b" in row:
            value = row["async_pp_1f1b"]["ratio"]
            out["async_pp_1f1b_vs_torch_1f1b"] = {
                "value": value,
                "target": TARGETS["async_pp_1f1b_vs_torch_1f1b"],
                "met": 0.95 <= value <= 1.05,
            }
    ours, plain = _find(results, "p1_async_pp_1f1b", 1), _find(results, "p1_lightning", 1)
    if ours and plain:
        value = ours["tokens_per_sec"] / plain["tokens_per_sec"]
        paired = ours["paired_ratio_vs_p1_lightning"]
        out["p1_overhead"] = {"value": value, "paired": paired, "target": TARGETS["p1_overhead"], "met": paired >= 0.95}
    one = _find(results, "async_pp_1f1b", 2, 4)
    for name, copies, key in (("async_pp_2bw", 1, "memory_2bw"), (CORRECTED_VARIANT, 2, "memory_2bw_dc")):
        two = _find(results, name, 2, 4)
        if one and two:
            # The heap measurement where glibc gives it (RSS is ~400 MiB of libraries: too coarse), else RSS.
            key_mb = "peak_heap_mb" if None not in (*one["peak_heap_mb"], *two["peak_heap_mb"]) else "peak_rss_mb"
            excess = [a - b for a, b in zip(two[key_mb], one[key_mb])]
            # + HEAP_SLACK_MB: the extra tensors' own bookkeeping (Python objects, allocator headers).
            allowed = [copies * w + HEAP_SLACK_MB for w in two["stage_weight_mb"]]
            out[key] = {
                "measure": key_mb,
                "excess_mb_per_stage": excess,
                "allowed_mb_per_stage": allowed,
                "target": TARGETS[key],
                "met": all(e <= a for e, a in zip(excess, allowed)),
            }
    return out


def simulator_check(raw: dict, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per async configuration: tokens/s the simulator predicts from each repetition's measured costs.

    Fed per stage: forward and backward time per micro-batch and update time per step (the engine's
    ``StepStats``), the transfer latency and the host time between steps (read from the Chrome trace).
    ``simulated_tokens_per_sec`` models the run as it is: each stage spends its own measured host time
    between steps (the training loop, data, hooks) before its share of the next step, and no barrier joins
    the stages between steps (the strategy's stop-flag broadcast does not block). ``schedule_only_tokens_per_sec``
    leaves out the host time: the schedule alone. ``replayed_tokens_per_sec`` feeds the simulator every
    action's own measured duration instead of the per-stage medians (:func:`replay_job`): the difference
    between it and ``simulated_tokens_per_sec`` is what the unevenness of the costs costs.
    """
    out = []
    for (name, p, m), reps in raw.items():
        if name not in ASYNC_VARIANTS or not reps:
            continue
        predicted, bare, replayed, transfers, overheads = [], [], [], [], []
        for rep in reps:
            transfer, overhead = 0.0, [0.0] * p
            if rep.get("trace"):
                transfer = trace_transfer_seconds(rep["trace"])
                overhead = trace_step_overhead(rep["trace"], m, first_step=args.warmup)
                replayed.append(replay_job(name, rep["trace"], p, m, args, transfer, overhead))
            transfers.append(transfer)
            overheads.append(overhead)
            predicted.append(simulate_job(name, rep, p, m, args, transfer, overhead))
            bare.append(simulate_job(name, rep, p, m, args, transfer))
        measured = _median([r["tokens_per_sec"] for r in reps])
        prediction = _median(predicted)
        out.append(
            {
                "name": name,
                "num_stages": p,
                "num_microbatches": m,
                "measured_tokens_per_sec": measured,
                "simulated_tokens_per_sec": prediction,
                "relative_error": prediction / measured - 1.0,
                "schedule_only_tokens_per_sec": _median(bare),
                "replayed_tokens_per_sec": _median(replayed) if replayed else None,
                "transfer_ms": 1e3 * _median(transfers),
                "step_overhead_ms": [1e3 * _median([o[s] for o in overheads]) for s in range(p)],
                "costs_ms": [
                    {
                        "forward_per_mb": 1e3 * _median([r["stages"][s]["forward_s_per_mb"] for r in reps]),
                        "backward_per_mb": 1e3 * _median([r["stages"][s]["backward_s_per_mb"] for r in reps]),
                        "update_per_step": 1e3 * _median([r["stages"][s]["update_s_per_step"] for r in reps]),
                    }
                    for s in range(p)
                ],
            }
        )
    return out


# ------------------------------------------------------------------------------------------ printing


def _fmt(values, spec: str) -> str:
    return "/".join("-" if v is None else format(v, spec) for v in values)


def format_report(report: dict[str, Any]) -> str:
    lines = []
    cfg = report["config"]
    model = cfg["model"]
    lines.append(
        f"GPT width {model['width']}, {model['blocks']} blocks, seq {model['seq']}, batch {cfg['batch_size']}; "
        f"{cfg['warmup_steps']} warm-up + {cfg['timed_steps']} timed steps, median of {cfg['repeats']} "
        f"interleaved repetitions; 1 thread per pipeline process"
    )
    before, after = report["machine"]["before"], report["machine"]["after"]
    lines.append(
        f"machine: {before['cpu']}, {before['cores']} cores; load average before {before['loadavg']}, "
        f"after {after['loadavg']}"
    )
    if report["oversubscribed_stage_counts"]:
        lines.append(
            f"NOTE: P={report['oversubscribed_stage_counts']} oversubscribes the {before['cores']} cores "
            "(one process per stage): those rows measure oversubscription as much as the schedule."
        )
    header = (
        f"{'P':>2} {'M':>2} {'variant':20s} {'tokens/s':>9} {'vs 1f1b':>8} {'paired':>7} "
        f"{'bubble/stage':>14} {'busy ms/step':>14} {'idle ms/step':>14} {'peak RSS MB/stage':>18} "
        f"{'heap MB/stage':>14}"
    )
    lines.append(header)
    lines.append("-" * len(header))
    rows = {(r["num_stages"], r["num_microbatches"]): r for r in report["ratios_vs_torch_1f1b"]}
    configs = sorted(rows)
    for p, m in configs:
        for name in [PIPELINE_VARIANTS[0], CORRECTED_VARIANT, *PIPELINE_VARIANTS[1:]]:
            r = _find(report["results"], name, p, m)
            if r is None:
                continue
            ratio = rows[(p, m)].get(name)
            lines.append(
                f"{p:>2} {m:>2} {name:20s} {r['tokens_per_sec']:9.0f} "
                f"{format(ratio['ratio'], '8.3f') if ratio else '       -'} "
                f"{format(ratio['paired_ratio'], '7.3f') if ratio else '      -'} "
                f"{_fmt(r['bubble_fraction'], '.2f'):>14} {_fmt(r['busy_ms_per_step'], '.1f'):>14} "
                f"{_fmt(r['idle_ms_per_step'], '.1f'):>14} {_fmt(r['peak_rss_mb'], '.0f'):>18} "
                f"{_fmt(r.get('peak_heap_mb') or [None], '.1f'):>14}"
            )
    ours, plain = _find(report["results"], "p1_async_pp_1f1b", 1), _find(report["results"], "p1_lightning", 1)
    if ours and plain:
        lines.append(
            f"P=1 overhead (1 thread, whole batch, {ours['repetitions']} fits each, ABBA in one process): "
            f"strategy '1f1b' {ours['tokens_per_sec']:.0f} tokens/s, plain Lightning "
            f"{plain['tokens_per_sec']:.0f} tokens/s, ratio {ours['tokens_per_sec'] / plain['tokens_per_sec']:.3f} "
            f"(paired {ours['paired_ratio_vs_p1_lightning']:.3f})"
        )
    if report["skipped"]:
        lines.append("not run: " + "; ".join(f"{k} ({v})" for k, v in report["skipped"].items()))
    for key, value in report.get("targets", {}).items():
        shown = {
            k: (round(v, 3) if isinstance(v, float) else [round(x, 2) for x in v] if isinstance(v, list) else v)
            for k, v in value.items()
        }
        lines.append(f"target {key}: {shown}")
    for sim in report.get("simulator", []):
        lines.append(
            f"simulator {sim['name']} P={sim['num_stages']} M={sim['num_microbatches']}: predicted "
            f"{sim['simulated_tokens_per_sec']:.0f} tokens/s vs measured {sim['measured_tokens_per_sec']:.0f} "
            f"({100 * sim['relative_error']:+.1f}%; schedule alone {sim['schedule_only_tokens_per_sec']:.0f}; "
            f"replayed {_fmt([sim.get('replayed_tokens_per_sec')], '.0f')}), "
            f"transfer {sim['transfer_ms']:.2f} ms, host time between steps "
            f"{_fmt(sim['step_overhead_ms'], '.1f')} ms"
        )
    if report["errors"]:
        lines.append(f"{len(report['errors'])} job(s) failed; see `errors` in the JSON")
    lines.append(f"total {report['seconds']:.0f}s")
    return "\n".join(lines)


def markdown_report(report: dict[str, Any]) -> str:
    """The measured table (and the simulator check) of a saved report, as Markdown."""
    rows = {(r["num_stages"], r["num_microbatches"]): r for r in report["ratios_vs_torch_1f1b"]}
    lines = [
        "| P | M | variant | tokens/s | vs torch_1f1b | paired | bubble per stage | busy ms/step per stage "
        "| idle ms/step per stage | peak RSS MB per stage | peak heap MB per stage |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p, m in sorted(rows):
        for name in [PIPELINE_VARIANTS[0], CORRECTED_VARIANT, *PIPELINE_VARIANTS[1:]]:
            r = _find(report["results"], name, p, m)
            if r is None:
                continue
            ratio = rows[(p, m)].get(name)
            shown = f"`{name}`" + (f" ({r['threads']} threads)" if name == "single_process" else "")
            lines.append(
                f"| {p} | {m} | {shown} | {r['tokens_per_sec']:.0f} | "
                f"{format(ratio['ratio'], '.2f') if ratio else '-'} | "
                f"{format(ratio['paired_ratio'], '.2f') if ratio else '-'} | {_fmt(r['bubble_fraction'], '.2f')} | "
                f"{_fmt(r['busy_ms_per_step'], '.0f')} | {_fmt(r['idle_ms_per_step'], '.0f')} | "
                f"{_fmt(r['peak_rss_mb'], '.1f')} | {_fmt(r.get('peak_heap_mb') or [None], '.1f')} |"
            )
    sims = report.get("simulator") or []
    if sims:
        lines += [
            "",
            "| variant | P | M | measured tokens/s | simulated | error | schedule alone | replayed | transfer ms "
            "| host ms between steps |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for sim in sims:
            lines.append(
                f"| `{sim['name']}` | {sim['num_stages']} | {sim['num_microbatches']} | "
                f"{sim['measured_tokens_per_sec']:.0f} | {sim['simulated_tokens_per_sec']:.0f} | "
                f"{100 * sim['relative_error']:+.1f}% | {sim['schedule_only_tokens_per_sec']:.0f} | "
                f"{_fmt([sim.get('replayed_tokens_per_sec')], '.0f')} | "
                f"{sim['transfer_ms']:.2f} | {_fmt(sim['step_overhead_ms'], '.1f')} |"
            )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ entry point


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_args(parser)
    parser.add_argument(
        "--quick", action="store_true", help="P=2, M=4 only, 2 repetitions of 3 + 10 steps (under 3 minutes)"
    )
    parser.add_argument("--repeats", type=int, default=None, help="repetitions per variant (default 5, quick 2)")
    parser.add_argument("--stage-counts", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatch-counts", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--variants", nargs="+", default=list(PIPELINE_VARIANTS), choices=PIPELINE_VARIANTS)
    parser.add_argument(
        "--with-corrected",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"also run {CORRECTED_VARIANT} (default: full run only)",
    )
    parser.add_argument(
        "--overhead",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="P=1 check: the strategy's 1f1b vs plain Lightning",
    )
    parser.add_argument(
        "--simulate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="predict the async variants' tokens/s with the schedule simulator",
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per job before it is killed")
    parser.add_argument("--keep-workdir", action="store_true")
    parser.add_argument("--out", type=str, default=None, help="write the JSON report here")
    parser.add_argument(
        "--render",
        type=str,
        default=None,
        metavar="JSON",
        help="print a saved report (text table and Markdown) instead of measuring",
    )
    # worker-only
    parser.add_argument("--worker", type=str, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--stages", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--microbatches", type=int, default=4, help=argparse.SUPPRESS)
    parser.add_argument("--split-points", type=str, default="", help=argparse.SUPPRESS)
    parser.add_argument("--result-dir", type=str, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--trace", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 2 if args.quick else 5
    if args.warmup is None:
        args.warmup = 3 if args.quick else 5
    if args.steps is None:
        args.steps = 10 if args.quick else 20
    if args.with_corrected is None:
        args.with_corrected = not args.quick
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any] | None:
    args = parse_args(argv)
    if args.worker is not None:
        worker(args)
        return None
    if args.render:
        report = json.loads(Path(args.render).read_text())
        print(format_report(report), "", markdown_report(report), sep="\n")
        return report
    report = orchestrate(args)
    print(format_report(report), flush=True)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
