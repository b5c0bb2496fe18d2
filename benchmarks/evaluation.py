"""Evaluation batches per second through a 2-stage pipeline: one forward per batch against micro-batches.

Two gloo processes (one per stage, ``--threads`` intra-op threads each) hold the halves of the demo GPT in
evaluation-only :class:`~lightning_async_pp.runtime.stage.StageRuntime`\\ s and evaluate the same batches two
ways, interleaved block by block (the order alternating, so drift hits both alike):

- ``whole``: what evaluation did before micro-batches: each batch in one forward (``num_microbatches=1``), its
  transfer layout negotiated again for every batch (both links forget it, a header and a host read per batch);
- ``microbatched``: :meth:`StageRuntime.evaluate` as it is: ``--microbatches`` micro-batches streamed through
  the stages, the layout negotiated once while the micro-batch shapes stay the same.

Two patterns, each in blocks of ``--batches`` batches timed on the last stage (where each batch's output is
complete):

- ``stream``: the batches one after the other, as Lightning's evaluation loop runs them. Sends never block, so
  with whole batches too the first stage runs ahead and forwards batch ``b + 1`` while the last forwards ``b``:
  the stages already overlap across batches, and micro-batches only shorten the fill at the block's start.
- ``isolated``: every stage waits at a barrier before each batch, so no stage runs ahead: the time of one batch
  through the pipeline, what a single or a first batch costs. Whole batches run the stages in turn,
  micro-batches overlap them (at most ``P * M / (M + P - 1)`` times faster with idle cores).

Reported per pattern: each way's median batches per second, the median over blocks of the paired speedup, and
the largest difference between the two ways' outputs of the first batch.

The stages overlap only if each has a core to itself. ``--model emulated`` replaces the GPT by an emulated
device, a layer per stage that sleeps ``--sample-ms`` per sample instead of computing, as a GPU computes while
its host waits: it measures the schedule where other processes hold the cores.

    python benchmarks/evaluation.py --out benchmarks/results/evaluation/gpt.json
    python benchmarks/evaluation.py --model emulated --out benchmarks/results/evaluation/emulated.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from bench_common import machine_description, run_ranks, save_report

ROOT = Path(__file__).resolve().parents[1]
WAYS = ("whole", "microbatched")
PATTERNS = ("stream", "isolated")


def _evaluate(runtime: Any, batch: Any, way: str) -> Any:
    if way == "microbatched":
        return runtime.evaluate(batch)
    for channel in (runtime.prev, runtime.next):
        if channel is not None:
            channel.forget_layout()  # both ends of the link, before the batch's first message
    return runtime.evaluate(batch, num_microbatches=1)


def _timed_block(runtime: Any, batches: list, way: str, pattern: str, group: Any) -> tuple[float, Any]:
    """Seconds the block took on this stage, and the first batch's output."""
    dist.barrier(group=group)
    elapsed, outputs = 0.0, []
    start = time.perf_counter()
    for batch in batches:
        if pattern == "isolated":
            elapsed += time.perf_counter() - start
            dist.barrier(group=group)  # not timed: every stage starts the batch together
            start = time.perf_counter()
        outputs.append(_evaluate(runtime, batch, way))
    return elapsed + time.perf_counter() - start, outputs[0]


class SleepLayer(torch.nn.Module):
    """An emulated device: a forward takes ``seconds_per_sample`` per sample of its input without using the CPU
    (a sleep), and passes the values on."""

    def __init__(self, seconds_per_sample: float) -> None:
        super().__init__()
        self.seconds_per_sample = seconds_per_sample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds_per_sample * x.shape[0])
        return x * 1.0


def _stage_model(args: argparse.Namespace, rank: int) -> tuple[list[torch.nn.Module], Any, list]:
    """This stage's layers, the inputs function and the batches."""
    from lightning_async_pp.demos import GPT
    from lightning_async_pp.demos.data import random_token_batches

    if args.model == "emulated":
        layers = [SleepLayer(args.sample_ms / 1e3)]
        generator = torch.Generator().manual_seed(1)
        batches = [(torch.randn(args.batch_size, 64, generator=generator),) for _ in range(args.batches)]
        return layers, lambda batch: batch[0], batches
    model = GPT(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, block_size=args.block_size).eval()
    layers = list(model.pipeline_layers())
    cut = (len(layers) + 1) // 2  # the embedding and half the blocks, then the other half and the head
    batches = random_token_batches(args.batches, args.batch_size, args.block_size, seed=1)
    return layers[:cut] if rank == 0 else layers[cut:], model.pipeline_inputs, batches


def worker(args: argparse.Namespace) -> None:
    from lightning_async_pp.runtime.stage import StageRuntime

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(args.threads)
    timeout = datetime.timedelta(seconds=args.timeout)
    init = f"file://{args.init_file}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timeout)
    p2p, control = dist.new_group(backend="gloo"), dist.new_group(backend="gloo")
    torch.manual_seed(0)
    layers, inputs_fn, batches = _stage_model(args, rank)
    runtime = StageRuntime(
        kind="1f1b",
        stage=rank,
        num_stages=world,
        num_microbatches=args.microbatches,
        layers=layers,
        optimizer=None,
        inputs_fn=inputs_fn,
        loss_fn=lambda output, batch: output.float().mean(),  # not called: evaluation hands the output back
        device=torch.device("cpu"),
        prev_rank=rank - 1 if rank > 0 else None,
        next_rank=rank + 1 if rank < world - 1 else None,
        p2p_group=p2p,
    )
    seconds = {pattern: {way: [] for way in WAYS} for pattern in PATTERNS}
    outputs: dict[str, Any] = {}
    for block in range(args.warmup + args.repeats):
        for pattern in PATTERNS:
            for way in WAYS if block % 2 == 0 else reversed(WAYS):
                elapsed, outputs[way] = _timed_block(runtime, batches, way, pattern, control)
                if block >= args.warmup:
                    seconds[pattern][way].append(elapsed)
    dist.barrier(group=control)
    if runtime.is_last:
        difference = (outputs["whole"] - outputs["microbatched"]).abs().max().item()
        record = {"seconds": seconds, "max_abs_difference": difference}
        Path(args.out_dir, "last_stage.json").write_text(json.dumps(record))
    dist.destroy_process_group()


def summarize(args: argparse.Namespace, record: dict[str, Any]) -> dict[str, Any]:
    report: dict[str, Any] = {
        "machine": machine_description(),
        "load_average": os.getloadavg(),
        "config": {k: v for k, v in vars(args).items() if k not in ("worker", "out_dir", "init_file")},
        "max_abs_difference": record["max_abs_difference"],
        "block_seconds": record["seconds"],
    }
    for pattern, seconds in record["seconds"].items():
        report[pattern] = {
            "batches_per_second": {way: args.batches / statistics.median(seconds[way]) for way in WAYS},
            "speedup": statistics.median(w / m for w, m in zip(seconds["whole"], seconds["microbatched"])),
        }
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        choices=["gpt", "emulated"],
        default="gpt",
        help="the demo GPT computing on the CPU, or an emulated device: a layer per stage that sleeps --sample-ms "
        "per sample (the stages overlap even where other processes hold the CPU cores)",
    )
    parser.add_argument("--sample-ms", type=float, default=2.0, help="emulated: milliseconds per sample per stage")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batches", type=int, default=8, help="batches per timed block")
    parser.add_argument("--repeats", type=int, default=6, help="timed blocks per way")
    parser.add_argument("--warmup", type=int, default=1, help="blocks per way before timing")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per stage")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--quick", action="store_true", help="a smoke run at tiny sizes")
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--init-file", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.microbatches, args.batches, args.repeats, args.warmup = 4, 2, 2, 0
        args.batch_size, args.block_size, args.n_layer, args.n_embd, args.n_head = 8, 16, 2, 16, 2
        args.sample_ms = 0.1
    if args.worker:
        worker(args)
        return {}
    with tempfile.TemporaryDirectory(prefix="evaluation_bench_") as scratch:
        command = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            "--out-dir",
            scratch,
            "--init-file",
            str(Path(scratch, "init")),
            *(argv if argv is not None else sys.argv[1:]),
        ]
        environment = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS=str(args.threads), WORLD_SIZE="2")
        environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), environment.get("PYTHONPATH")]))
        logs = [open(Path(scratch, f"rank{rank}.log"), "w") for rank in range(2)]
        try:
            code = run_ranks(command, [dict(environment, RANK=str(r)) for r in range(2)], logs, args.timeout, str(ROOT))
        finally:
            for log in logs:
                log.close()
        if code != 0:
            output = "\n".join(Path(scratch, f"rank{rank}.log").read_text()[-3000:] for rank in range(2))
            raise RuntimeError(f"the evaluation benchmark's ranks failed ({code}):\n{output}")
        record = json.loads(Path(scratch, "last_stage.json").read_text())
    report = summarize(args, record)
    if args.model == "emulated":
        model = f"batches of {args.batch_size} samples, an emulated device taking {args.sample_ms} ms per sample"
    else:
        model = f"batches of {args.batch_size} x {args.block_size} tokens, GPT {args.n_layer} x {args.n_embd}"
    print(
        f"P=2, {model}, {args.microbatches} micro-batches; outputs differ by at most {report['max_abs_difference']:.2e}"
    )
    for pattern in PATTERNS:
        per_second = report[pattern]["batches_per_second"]
        print(
            f"{pattern:>8}: whole batches, layout per batch {per_second['whole']:.2f} batches/s; micro-batches, "
            f"layout kept {per_second['microbatched']:.2f} batches/s; speedup {report[pattern]['speedup']:.2f}x"
        )
    save_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
