"""Operations per optimizer step (kernel launches on a GPU) and CPU step times, Muon batched vs per matrix.

Two measurements on the demo GPT (``lightning_async_pp.demos.GPT``, vocabulary 256), with fixed random
gradients:

* **Operations** (``--blocks`` 24, ``--width`` 128): the aten operations one step dispatches, counted with a
  ``TorchDispatchMode`` on the second step (the first creates the state). On a GPU each one is (at least) a
  kernel launch; on CPU they are what the host loops over. Every variant is counted: ``Muon`` on the 96
  hidden matrices, ``Muon`` on the whole model (its AdamW part takes the other 197 tensors), the same two with
  ``batched=False`` (the per-matrix step, torch's own loops: the code before the batched step) and with
  the batches a GPU takes (``*_gpu_batches``: ``ns_batch_bytes`` at its GPU default, 128 MiB, where the CPU
  default is 4 MiB),
  ``torch.optim.Muon`` on the 96 matrices, ``AdamW(foreach=True)``, ``DelayCorrected`` around it (what the
  correction adds) and around ``Muon``.
* **Time** (``--time-width`` 256): CPU step times of the Muon variants, per-matrix ("before") against batched
  ("after"), and of AdamW with and without ``DelayCorrected``, each family stepped interleaved (A B A B ...)
  in one run so that machine load hits both alike; the first ``--warmup`` rounds are dropped, and the ratios
  are medians of per-round ratios ("paired"). ``torch.optim.Muon`` is counted but not timed: its bfloat16
  iteration measures the CPU's bfloat16 support, not the optimizer.

Muon runs with its default ``ns_dtype="auto"``: float32 Newton-Schulz on CPU. ``TARGETS`` holds issue 35's
bounds; ``targets_met`` compares them. The operation targets stand for kernel launches on a GPU, so they are
measured with the GPU's batches (``*_gpu_batches``); the CPU default's counts are in the table beside them.

``--experts`` counts instead the operations of Muon's step on the stacked experts of mixture-of-experts layers
(``--layers`` 8 layers of ``--experts-per-layer`` 8 experts, ``(experts, 4 x width, width)`` fused gate and
up projections and ``(experts, width, 2 x width)`` down projections, as Hugging Face stores them): each expert's
gate, up and down are three matrices, per matrix (``batched=False``) or batched (CPU and GPU batches).

Usage::

    python benchmarks/optimizer_ops.py --out benchmarks/results/optimizer_ops/optimizer_ops.json
    python benchmarks/optimizer_ops.py --quick   # a tiny model, a few rounds (the smoke test)
    python benchmarks/optimizer_ops.py --experts --out benchmarks/results/optimizer_ops/optimizer_ops_experts.json
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from bench_common import machine_description, save_report_and_table
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_async_pp.demos import GPT
from lightning_async_pp.optim import DelayCorrected, Muon
from lightning_async_pp.optim.newton_schulz import NS_BATCH_BYTES

TARGETS = {
    "ops_muon_matrices": 340,
    "ops_muon": 600,
    "ops_correction_on_adamw": 30,
    "time_muon_matrices_after_over_before": 1.0,
    "time_muon_after_over_before": 1.0,
    "time_adamw_corrected_over_adamw": 1.25,
}
"""Issue 35's bounds: operations per step, and paired CPU time ratios."""

MUON_TIMED = (
    "muon_matrices_per_matrix",
    "muon_matrices",
    "muon_matrices_gpu_batches",
    "muon_per_matrix",
    "muon",
    "muon_corrected_per_matrix",
    "muon_corrected",
)
ADAMW_TIMED = ("adamw", "adamw_corrected")
PAIRS = {
    "muon_matrices_after_over_before": ("muon_matrices", "muon_matrices_per_matrix"),
    "muon_matrices_gpu_batches_over_before": ("muon_matrices_gpu_batches", "muon_matrices_per_matrix"),
    "muon_after_over_before": ("muon", "muon_per_matrix"),
    "muon_corrected_after_over_before": ("muon_corrected", "muon_corrected_per_matrix"),
    "adamw_corrected_over_adamw": ("adamw_corrected", "adamw"),
}


def model(blocks: int, width: int) -> GPT:
    """The demo GPT with a fixed random gradient on every parameter."""
    gpt = GPT(n_layer=blocks, n_embd=width, n_head=4)
    generator = torch.Generator().manual_seed(0)
    for param in gpt.parameters():
        param.grad = torch.randn(param.shape, generator=generator)
    return gpt


def hidden_matrices(gpt: GPT) -> list[tuple[str, torch.nn.Parameter]]:
    """The blocks' attention and MLP weight matrices (4 per block)."""
    return [(n, p) for n, p in gpt.named_parameters() if p.ndim == 2 and (".attn." in n or ".mlp." in n)]


MUON = {"lr": 0.02, "adamw_lr": 1e-3}
GPU_BATCHES = {"ns_batch_bytes": NS_BATCH_BYTES}
VARIANTS: dict[str, Callable[[GPT], torch.optim.Optimizer]] = {
    "muon_matrices_per_matrix": lambda m: Muon(hidden_matrices(m), **MUON, batched=False),
    "muon_matrices": lambda m: Muon(hidden_matrices(m), **MUON),
    "muon_matrices_gpu_batches": lambda m: Muon(hidden_matrices(m), **MUON, **GPU_BATCHES),
    "muon_per_matrix": lambda m: Muon(m.named_parameters(), **MUON, batched=False),
    "muon": lambda m: Muon(m.named_parameters(), **MUON),
    "muon_gpu_batches": lambda m: Muon(m.named_parameters(), **MUON, **GPU_BATCHES),
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True),
    "adamw_corrected": lambda m: DelayCorrected(torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True)),
    "muon_corrected_per_matrix": lambda m: DelayCorrected(Muon(m.named_parameters(), **MUON, batched=False)),
    "muon_corrected": lambda m: DelayCorrected(Muon(m.named_parameters(), **MUON)),
}
if hasattr(torch.optim, "Muon"):
    VARIANTS["torch_muon"] = lambda m: torch.optim.Muon([p for _, p in hidden_matrices(m)], lr=0.02)


EXPERT_VARIANTS: dict[str, dict[str, Any]] = {
    "experts_per_matrix": {"batched": False},
    "experts": {},
    "experts_gpu_batches": GPU_BATCHES,
}


def expert_stacks(layers: int, experts: int, width: int) -> torch.nn.Module:
    """``layers`` modules named ``experts`` holding stacked expert weights, with fixed random gradients."""
    generator = torch.Generator().manual_seed(0)
    model = torch.nn.ModuleList()
    for _ in range(layers):
        stacks = torch.nn.Module()
        stacks.gate_up_proj = torch.nn.Parameter(torch.randn(experts, 4 * width, width, generator=generator))
        stacks.down_proj = torch.nn.Parameter(torch.randn(experts, width, 2 * width, generator=generator))
        model.append(torch.nn.ModuleDict({"experts": stacks}))
    for param in model.parameters():
        param.grad = torch.randn(param.shape, generator=generator)
    return model


def run_experts(args: argparse.Namespace) -> dict[str, Any]:
    """Operations of Muon's step on the expert stacks, per matrix and batched."""
    begin = time.perf_counter()
    operations = {
        name: count_operations(
            lambda m, options=options: Muon(m.named_parameters(), **MUON, **options),
            args.layers,
            args.width,
            stacks=args.experts_per_layer,
        )
        for name, options in EXPERT_VARIANTS.items()
    }
    routing = Muon(expert_stacks(args.layers, args.experts_per_layer, args.width).named_parameters(), **MUON)
    return {
        "machine": machine_description(),
        "config": {
            "layers": args.layers,
            "experts": args.experts_per_layer,
            "width": args.width,
            "matrices": routing.routing()["muon_expert_matrices"],
            "routing": routing.describe_routing(),
        },
        "operations": operations,
        "seconds": time.perf_counter() - begin,
    }


def experts_markdown(report: dict[str, Any]) -> str:
    c, ops = report["config"], report["operations"]
    lines = [
        f"{c['layers']} mixture-of-experts layers of {c['experts']} experts, width {c['width']}: {c['matrices']} "
        f"expert matrices. Muon's routing: {c['routing']}. torch {report['machine']['torch']}.",
        "",
        "| step | operations | per matrix |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {r['operations']:,} | {r['operations'] / c['matrices']:.2f} |" for name, r in ops.items()]
    return "\n".join(lines)


class OperationCounter(TorchDispatchMode):
    """Counts the operations dispatched while the mode is active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def count_operations(
    build: Callable[[Any], torch.optim.Optimizer], blocks: int, width: int, stacks: int | None = None
) -> dict[str, Any]:
    """Operations of the second step of a fresh optimizer: their number and the most frequent ones (on the demo
    GPT, or with ``stacks`` experts per layer on :func:`expert_stacks`)."""
    optimizer = build(model(blocks, width) if stacks is None else expert_stacks(blocks, stacks, width))
    optimizer.step()
    counter = OperationCounter()
    with counter:
        optimizer.step()
    return {"operations": sum(counter.counts.values()), "most_frequent": dict(counter.counts.most_common(6))}


def time_interleaved(names: tuple[str, ...], blocks: int, width: int, rounds: int, warmup: int) -> dict[str, list]:
    """Step times (seconds) of ``names``, stepped in turn, one model each, after ``warmup`` untimed rounds."""
    optimizers = {name: VARIANTS[name](model(blocks, width)) for name in names}
    times: dict[str, list[float]] = {name: [] for name in names}
    for index in range(warmup + rounds):
        order = names if index % 2 == 0 else names[::-1]  # neither goes first every time
        for name in order:
            start = time.perf_counter()
            optimizers[name].step()
            if index >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


def run(args: argparse.Namespace) -> dict[str, Any]:
    begin = time.perf_counter()
    operations = {name: count_operations(build, args.blocks, args.width) for name, build in VARIANTS.items()}
    ops = {name: result["operations"] for name, result in operations.items()}
    print(f"operations counted ({time.perf_counter() - begin:.0f} s)", flush=True)
    samples = time_interleaved(MUON_TIMED, args.time_blocks, args.time_width, args.muon_rounds, args.warmup)
    print(f"Muon timed ({time.perf_counter() - begin:.0f} s)", flush=True)
    samples.update(time_interleaved(ADAMW_TIMED, args.time_blocks, args.time_width, args.rounds, args.warmup))
    times = {
        name: {
            "median_ms": statistics.median(values) * 1e3,
            "min_ms": min(values) * 1e3,
            "max_ms": max(values) * 1e3,
            "rounds": len(values),
        }
        for name, values in samples.items()
    }
    paired = {key: statistics.median(x / y for x, y in zip(samples[a], samples[b])) for key, (a, b) in PAIRS.items()}
    gpt = model(args.blocks, args.width)
    muon = VARIANTS["muon"](gpt)
    measured = {
        "ops_muon_matrices": ops["muon_matrices_gpu_batches"],
        "ops_muon": ops["muon_gpu_batches"],
        "ops_correction_on_adamw": ops["adamw_corrected"] - ops["adamw"],
        "time_muon_matrices_after_over_before": paired["muon_matrices_after_over_before"],
        "time_muon_after_over_before": paired["muon_after_over_before"],
        "time_adamw_corrected_over_adamw": paired["adamw_corrected_over_adamw"],
    }
    return {
        "machine": machine_description(),
        "config": {
            "blocks": args.blocks,
            "width": args.width,
            "time_blocks": args.time_blocks,
            "time_width": args.time_width,
            "parameters": sum(p.numel() for p in gpt.parameters()),
            "tensors": len(list(gpt.parameters())),
            "hidden_matrices": len(hidden_matrices(gpt)),
            "time_parameters": sum(p.numel() for p in model(args.time_blocks, args.time_width).parameters()),
            "muon_rounds": args.muon_rounds,
            "rounds": args.rounds,
            "warmup": args.warmup,
            "threads": torch.get_num_threads(),
            "routing": muon.describe_routing(),
            "quick": args.quick,
        },
        "operations": operations,
        "times": times,
        "paired_ratios": paired,
        "measured": measured,
        "targets": TARGETS,
        "targets_met": {key: measured[key] <= bound for key, bound in TARGETS.items()},
        "seconds": time.perf_counter() - begin,
    }


def markdown(report: dict[str, Any]) -> str:
    """The report as Markdown: operations, times and targets."""
    c, m, ops, times = report["config"], report["machine"], report["operations"], report["times"]
    lines = [
        f"Demo GPT, {c['blocks']} blocks of width {c['width']} ({c['parameters']:,} parameters in {c['tensors']} "
        f"tensors, {c['hidden_matrices']} hidden matrices) for the operations; {c['time_blocks']} blocks of width "
        f"{c['time_width']} ({c['time_parameters']:,} parameters) for the times: {c['warmup']} warm-up and "
        f"{c['muon_rounds']} timed rounds of the Muon variants, {c['rounds']} of AdamW's, interleaved, "
        f"{c['threads']} threads. Muon's Newton-Schulz in float32 (`ns_dtype=\"auto\"` on CPU). Muon's routing: "
        f"{c['routing']}. torch {m['torch']}, {m['cores']} CPU cores ({m['cpu']}).",
        "",
        "| step | operations | CPU ms (median) |",
        "|---|---|---|",
    ]
    for name, result in ops.items():
        timed = f"{times[name]['median_ms']:.1f}" if name in times else "-"
        lines.append(f"| `{name}` | {result['operations']:,} | {timed} |")
    lines += ["", "| paired ratio | median |", "|---|---|"]
    lines += [f"| {key} | {value:.3f} |" for key, value in report["paired_ratios"].items()]
    lines += ["", "| target | measured | bound | met |", "|---|---|---|---|"]
    for key, bound in report["targets"].items():
        value = report["measured"][key]
        shown = f"{value:,}" if isinstance(value, int) else f"{value:.3f}"
        lines.append(f"| {key} | {shown} | {bound} | {'yes' if report['targets_met'][key] else 'no'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=None, help="blocks for the operation counts (default 24)")
    parser.add_argument("--width", type=int, default=None, help="width for the operation counts (default 128)")
    parser.add_argument("--time-blocks", type=int, default=None, help="blocks for the times (default 24)")
    parser.add_argument("--time-width", type=int, default=None, help="width for the times (default 256)")
    parser.add_argument("--muon-rounds", type=int, default=None, help="timed rounds of the Muon variants (default 5)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds of the AdamW pair (default 30)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed rounds first (default 2)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="2 blocks of width 32, 2 rounds (smoke test)")
    parser.add_argument("--experts", action="store_true", help="count Muon's operations on stacked experts only")
    parser.add_argument("--layers", type=int, default=8, help="--experts: mixture-of-experts layers (default 8)")
    parser.add_argument("--experts-per-layer", type=int, default=8, help="--experts: experts per layer (default 8)")
    parser.add_argument("--out", default=None, help="write the JSON report here")
    parser.add_argument("--markdown", default=None, help="write the Markdown tables here (default: --out's .md)")
    args = parser.parse_args(argv)
    defaults = {
        "blocks": (24, 2),
        "width": (128, 32),
        "time_blocks": (24, 2),
        "time_width": (256, 32),
        "muon_rounds": (5, 2),
        "rounds": (30, 2),
        "warmup": (2, 1),
    }
    for key, (full, quick) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)
    if min(args.muon_rounds, args.rounds) < 1 or args.warmup < 0:
        parser.error("--muon-rounds and --rounds must be >= 1, --warmup >= 0")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.experts:
        report = run_experts(args)
        save_report_and_table(report, experts_markdown(report), args.out, args.markdown)
        return report
    report = run(args)
    save_report_and_table(report, markdown(report), args.out, args.markdown)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
