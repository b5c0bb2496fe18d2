"""Heap peak under ``bf16-mixed`` with a cast of the weights per micro-batch against one per weight version.

A model of weight-heavy layers (``--layers`` x ``Linear(--width, --width)``) and small activations (micro-batches
of ``--rows`` rows) trains under autocast to bfloat16 (Lightning's ``bf16-mixed`` plugin's context: autocast
without a cast cache), with AdamW, two ways, side by side in one run:

- ``per_microbatch``: what autocast does alone: each micro-batch's forward casts every weight matrix, and its
  graph keeps that cast until its backward;
- ``per_version``: :class:`~lightning_async_pp.runtime.casts.WeightCasts`: one cast per weight version,
  shared by the micro-batches that run on it (the default).

Two settings:

- ``one_device``: the one-device 2BW path (:func:`~lightning_async_pp.strategy.single_device.microbatch_losses`
  on ``w[t-1]`` through :class:`~lightning_async_pp.reference.delayed.DelayedWeights`; all of a step's
  forwards before its backwards), at each of ``--one-device-microbatches``, in this process;
- ``pipeline``: ``P = 2`` gloo processes, one :class:`~lightning_async_pp.runtime.stage.StageRuntime` each
  (``schedule="2bw"``, ``--microbatches`` micro-batches, half the layers per stage), both ways in turn in
  the same processes.

Measured: the largest heap in use (glibc's ``mallinfo2``, as the throughput benchmark's ``HeapPeak``) after
every forward, backward and update, less the heap in use before the model was built, in MiB; and whether
the two ways trained the same weights to the last bit. One bfloat16 copy of a stage's weights is
``2 x parameters`` bytes; the difference of the two ways, divided by it, counts the copies saved.

    python benchmarks/cast_memory.py --out benchmarks/results/cast_memory/cast_memory.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from bench_common import heap_in_use, machine_description, run_ranks, save_report
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
WAYS = ("per_microbatch", "per_version")
MIB = 2**20


class HeapPeak:
    """The largest heap in use seen after a forward or backward (``compute``) and after anything (``overall``, the
    updates too), less the heap in use at construction, in MiB."""

    def __init__(self) -> None:
        self.base = heap_in_use()
        self.peaks = {"compute": self.base, "overall": self.base}

    def sample(self, compute: bool) -> None:
        now = heap_in_use()
        for kind in ("compute", "overall") if compute else ("overall",):
            self.peaks[kind] = max(self.peaks[kind], now)

    def observe(self, action: Any, begin: float, end: float) -> None:
        from lightning_async_pp.schedule import Op

        self.sample(action.op in (Op.FORWARD, Op.BACKWARD))

    def mib(self) -> dict[str, float]:
        return {kind: (peak - self.base) / MIB for kind, peak in self.peaks.items()}


class Layers(nn.Module):
    """A pipeline-ready stack of ``Linear`` layers (``pipeline_layers``, ``pipeline_inputs``, ``pipeline_loss``)."""

    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def pipeline_layers(self) -> nn.ModuleList:
        return self.layers

    def pipeline_inputs(self, batch: torch.Tensor) -> torch.Tensor:
        return batch

    def pipeline_loss(self, output: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        return output.float().square().mean()


def bf16_mixed() -> Any:
    from lightning.pytorch.plugins.precision import MixedPrecision

    return MixedPrecision("bf16-mixed", "cpu")


def batches(args: argparse.Namespace, microbatches: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(args.rows * microbatches, args.width, generator=generator) for _ in range(args.steps)]


def one_device(args: argparse.Namespace, microbatches: int, way: str) -> dict[str, Any]:
    """The one-device 2BW path's heap peak over ``--steps`` steps."""
    from lightning_async_pp.reference.delayed import DelayedWeights
    from lightning_async_pp.strategy.single_device import SharedCasts, microbatch_losses

    precision = bf16_mixed()
    data = batches(args, microbatches)
    heap = HeapPeak()
    torch.manual_seed(0)
    model = Layers(args.layers, args.width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    delayed = DelayedWeights(model)
    casts = SharedCasts(model, precision) if way == "per_version" else None

    for batch in data:

        def closure(batch: torch.Tensor = batch) -> None:
            around = casts() if casts is not None else contextlib.nullcontext
            with precision.train_step_context():
                losses = microbatch_losses(model, batch, microbatches, around)
            heap.sample(compute=True)
            for loss in losses:
                (loss / microbatches).backward()
                heap.sample(compute=True)

        optimizer.zero_grad(set_to_none=True)
        delayed.wrap_closure(closure)()
        optimizer.step()
        heap.sample(compute=False)
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {"peak_heap_mib": heap.mib(), "weights": weights}


def stage_run(args: argparse.Namespace, way: str, rank: int, world: int, p2p: Any) -> dict[str, Any]:
    """Train this rank's stage ``--steps`` steps one ``way``; its heap peaks, parameter count and final weights."""
    from lightning_async_pp.runtime.stage import StageRuntime

    data = batches(args, args.microbatches)[: 1 if way == "warm_up" else None]
    heap = HeapPeak()
    torch.manual_seed(rank)
    model = Layers(args.layers_per_stage, args.width)  # this stage's layers only
    runtime = StageRuntime(
        kind="2bw",
        stage=rank,
        num_stages=world,
        num_microbatches=args.microbatches,
        layers=list(model.layers),
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
        inputs_fn=model.pipeline_inputs,
        loss_fn=model.pipeline_loss,
        device=torch.device("cpu"),
        prev_rank=rank - 1 if rank > 0 else None,
        next_rank=rank + 1 if rank < world - 1 else None,
        p2p_group=p2p,
        check_data_order=False,
        forward_context=bf16_mixed().forward_context,
        time_actions=False,
        observers=[heap.observe],
        cast_weights=way == "per_version",
    )
    for step, batch in enumerate(data):
        runtime.run_step(step, batch)
    runtime.drain()
    heap.sample(compute=False)
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {"peak_heap_mib": heap.mib(), "parameters": weights.numel(), "weights": weights}


def worker(args: argparse.Namespace) -> None:
    """One stage of the pipeline: a warm-up, then each way in turn, a fresh stage each."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=args.timeout)
    dist.init_process_group(
        "gloo", init_method=f"file://{args.init_file}", rank=rank, world_size=world, timeout=timeout
    )
    p2p = dist.new_group(backend="gloo")
    record: dict[str, Any] = {}
    for way in ("warm_up", *WAYS):  # the first use of the process's kernels and buffers is not measured
        gc.collect()  # the previous way's stage (a runtime holds reference cycles) is gone before the next starts
        result = stage_run(args, way, rank, world, p2p)
        torch.save(result.pop("weights"), Path(args.out_dir, f"{way}_{rank}.pt"))
        if way != "warm_up":
            record[way] = result
        dist.barrier()
    Path(args.out_dir, f"stage{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


def pipeline(args: argparse.Namespace, stages: int) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="cast_memory_") as scratch:
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--out-dir", scratch]
        command += ["--init-file", str(Path(scratch, "init"))]
        for option in ("layers_per_stage", "width", "rows", "steps", "microbatches", "timeout"):
            command += [f"--{option.replace('_', '-')}", str(getattr(args, option))]
        environment = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", WORLD_SIZE=str(stages))
        environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), environment.get("PYTHONPATH")]))
        logs = [open(Path(scratch, f"rank{rank}.log"), "w") for rank in range(stages)]
        try:
            code = run_ranks(
                command, [dict(environment, RANK=str(r)) for r in range(stages)], logs, args.timeout, str(ROOT)
            )
        finally:
            for log in logs:
                log.close()
        if code != 0:
            output = "\n".join(Path(scratch, f"rank{rank}.log").read_text()[-3000:] for rank in range(stages))
            raise RuntimeError(f"the cast-memory benchmark's ranks failed ({code}):\n{output}")
        records = []
        for rank in range(stages):
            record = json.loads(Path(scratch, f"stage{rank}.json").read_text())
            same = torch.equal(*(torch.load(Path(scratch, f"{way}_{rank}.pt")) for way in WAYS))
            records.append({"stage": rank, **record, "same_weights": same})
        return records


def row(setting: str, stage: int, microbatches: int, parameters: int, peaks: dict, same: bool) -> dict[str, Any]:
    """One line of the report; ``peaks[way]`` holds the ``compute`` and ``overall`` heap peaks (MiB)."""
    copy_mib = 2 * parameters / MIB
    saved = peaks["per_microbatch"]["compute"] - peaks["per_version"]["compute"]
    return {
        "setting": setting,
        "stage": stage,
        "microbatches": microbatches,
        "parameters": parameters,
        "bf16_copy_mib": copy_mib,
        **{f"{way}_{kind}_mib": peaks[way][kind] for way in WAYS for kind in ("compute", "overall")},
        "saved_compute_mib": saved,
        "saved_copies": saved / copy_mib,
        "same_weights": same,
    }


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "| setting | stage | M | bf16 copy MiB | forward/backward peak MiB: per micro-batch | per version | saved "
        "| saved copies | overall peak MiB: per micro-batch | per version | same weights |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['setting']} | {r['stage']} | {r['microbatches']} | {r['bf16_copy_mib']:.1f} | "
            f"{r['per_microbatch_compute_mib']:.1f} | {r['per_version_compute_mib']:.1f} | "
            f"{r['saved_compute_mib']:.1f} | {r['saved_copies']:.2f} | {r['per_microbatch_overall_mib']:.1f} | "
            f"{r['per_version_overall_mib']:.1f} | {r['same_weights']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4, help="Linear layers of the one-device model")
    parser.add_argument("--layers-per-stage", type=int, default=2, help="Linear layers per pipeline stage")
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4], help="pipeline sizes P")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=2, help="rows per micro-batch")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--microbatches", type=int, default=8, help="the pipeline's micro-batches per step")
    parser.add_argument("--one-device-microbatches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--quick", action="store_true", help="a smoke run at tiny sizes")
    parser.add_argument("--out", default=None, help="JSON report (and the Markdown table next to it)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--init-file", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.width, args.steps = 256, 2
    if args.worker:
        worker(args)
        return {}
    if heap_in_use() is None:
        raise SystemExit("This benchmark reads the heap through glibc's mallinfo2, which this system does not have.")
    torch.set_num_threads(1)
    one_device(argparse.Namespace(**{**vars(args), "steps": 1}), 1, WAYS[0])  # warm-up: the process's first use
    rows = []
    for microbatches in args.one_device_microbatches:
        runs = {}
        for way in WAYS:
            gc.collect()
            runs[way] = one_device(args, microbatches, way)
        same = torch.equal(runs["per_microbatch"]["weights"], runs["per_version"]["weights"])
        peaks = {way: runs[way]["peak_heap_mib"] for way in WAYS}
        rows.append(row("one_device", 0, microbatches, runs[WAYS[0]]["weights"].numel(), peaks, same))
    for stages in args.stages:
        for stage in pipeline(args, stages):
            peaks = {way: stage[way]["peak_heap_mib"] for way in WAYS}
            rows.append(
                row(
                    f"pipeline_2bw_P{stages}",
                    stage["stage"],
                    args.microbatches,
                    stage[WAYS[0]]["parameters"],
                    peaks,
                    stage["same_weights"],
                )
            )
    report = {
        "machine": machine_description(),
        "config": {k: v for k, v in vars(args).items() if k not in ("worker", "out_dir", "init_file", "out")},
        "rows": rows,
    }
    table = markdown(report)
    print(table)
    save_report(report, args.out)
    if args.out:
        Path(args.out).with_suffix(".md").write_text(table)
    return report


if __name__ == "__main__":
    main()
