"""What :class:`~lightning_async_pp.optim.DelayCorrected` adds to an AdamW step: operations and CPU time.

Two measurements on the demo GPT (:class:`~lightning_async_pp.demos.GPT`, vocabulary 256, 24 blocks by default),
with random, fixed gradients:

* **Operations**: the aten operations of one steady-state optimizer step (the fourth), counted with a
  ``TorchDispatchMode`` (every multi-tensor ``torch._foreach_*`` call is one; on a GPU each is about one kernel
  launch, or one per tensor where the multi-tensor kernel does not apply), for ``AdamW(foreach=True)`` alone and
  wrapped with ``coefficient=1.0`` and ``"auto"``, at width ``--ops-width`` (128). ``added`` is the wrapper's
  count minus AdamW's.
* **Time**: the step time of the same three at width ``--width`` (256, 19M parameters), stepped in turn in
  every round (the order rotates), so that a change of machine load hits them alike; the first ``--warmup``
  rounds are dropped. ``paired`` is the median over rounds of the wrapper's step time over AdamW's in the same
  round.

``--compare FILE`` loads another version of ``delay_corrected.py`` (for example the one of an earlier commit,
``git show REV:lightning_async_pp/optim/delay_corrected.py > old.py``) and measures its wrapper in the same run,
as ``*_compared`` variants, so that before and after are side by side.

Usage::

    python benchmarks/delay_corrected_ops.py --out benchmarks/results/delay_corrected_ops/delay_corrected_ops.json
    python benchmarks/delay_corrected_ops.py --blocks 2 --width 32 --rounds 5   # seconds
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from bench_common import machine_description, save_report
from torch.utils._python_dispatch import TorchDispatchMode

import lightning_async_pp
from lightning_async_pp.demos import GPT
from lightning_async_pp.optim import DelayCorrected

TARGETS = {"ops_added": 30, "paired_ratio": 1.25}
"""Operations a corrected step may add to AdamW's (each coefficient), and the corrected step over AdamW's, paired."""


class OpCounter(TorchDispatchMode):
    """Counts the aten operations run under it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def load_wrapper(path: str) -> type:
    """The ``DelayCorrected`` class of another version of ``delay_corrected.py``."""
    spec = importlib.util.spec_from_file_location("delay_corrected_compared", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.DelayCorrected


def builders(compared: type | None) -> dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]]:
    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, foreach=True)

    variants = {
        "adamw": adamw,
        "corrected": lambda params: DelayCorrected(adamw(params), coefficient=1.0),
        "corrected_auto": lambda params: DelayCorrected(adamw(params), coefficient="auto"),
    }
    if compared is not None:
        variants["corrected_compared"] = lambda params: compared(adamw(params), coefficient=1.0)
        variants["corrected_auto_compared"] = lambda params: compared(adamw(params), coefficient="auto")
    return variants


def model_parameters(blocks: int, width: int) -> list[torch.nn.Parameter]:
    """The demo GPT's parameters, each with a fixed random gradient."""
    params = list(GPT(n_layer=blocks, n_embd=width, n_head=4).parameters())
    generator = torch.Generator().manual_seed(0)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator) * 0.01
    return params


def count_ops(build, blocks: int, width: int) -> collections.Counter[str]:
    optimizer = build(model_parameters(blocks, width))
    for _ in range(3):  # the state exists and every parameter has a previous update
        optimizer.step()
    counter = OpCounter()
    with counter:
        optimizer.step()
    return counter.ops


def time_interleaved(variants: dict, blocks: int, width: int, rounds: int, warmup: int) -> dict[str, list[float]]:
    optimizers = {name: build(model_parameters(blocks, width)) for name, build in variants.items()}
    names = list(optimizers)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(warmup + rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            optimizers[name].step()
            elapsed = time.perf_counter() - start
            if round_index >= warmup:
                times[name].append(elapsed)
    return times


def run(args: argparse.Namespace, log: Callable[[str], Any] = print) -> dict[str, Any]:
    compared = load_wrapper(args.compare) if args.compare else None
    variants = builders(compared)
    n_params = sum(p.numel() for p in model_parameters(args.blocks, args.width))
    log(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {lightning_async_pp.__file__}")

    counts = {name: count_ops(build, args.blocks, args.ops_width) for name, build in variants.items()}
    base = counts["adamw"]
    ops = {}
    for name, ops_of in counts.items():
        added = collections.Counter(ops_of)
        added.subtract(base)
        ops[name] = {
            "total": sum(ops_of.values()),
            "added": sum(ops_of.values()) - sum(base.values()),
            "added_by_op": {op: n for op, n in sorted(added.items()) if n},
        }

    times = time_interleaved(variants, args.blocks, args.width, args.rounds, args.warmup)
    timing = {}
    for name, samples in times.items():
        timing[name] = {
            "median_ms": statistics.median(samples) * 1e3,
            "paired_ratio": statistics.median(t / a for t, a in zip(samples, times["adamw"])),
        }
    wrapped = [name for name in variants if name != "adamw"]
    report = {
        "config": {
            "blocks": args.blocks,
            "ops_width": args.ops_width,
            "width": args.width,
            "parameters_timed": n_params,
            "rounds": args.rounds,
            "warmup": args.warmup,
            "threads": torch.get_num_threads(),
            "package": str(Path(lightning_async_pp.__file__).parent),
            "compare": args.compare,
        },
        "machine": machine_description(),
        "ops": ops,
        "time": timing,
        "targets": TARGETS,
        "targets_met": {
            name: {
                "ops_added": ops[name]["added"] <= TARGETS["ops_added"],
                "paired_ratio": timing[name]["paired_ratio"] <= TARGETS["paired_ratio"],
            }
            for name in wrapped
        },
    }
    for line in markdown(report).splitlines():
        log(line)
    return report


def markdown(report: dict[str, Any]) -> str:
    config = report["config"]
    lines = [
        f"Demo GPT, {config['blocks']} blocks; operations at width {config['ops_width']}, time at width "
        f"{config['width']} ({config['parameters_timed']:,} parameters), {config['threads']} thread(s), "
        f"{config['rounds']} rounds.",
        "",
        "| variant | ops per step | ops added to AdamW | step ms (median) | / AdamW, paired |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, ops in report["ops"].items():
        timing = report["time"][name]
        lines.append(
            f"| {name} | {ops['total']} | {ops['added']} | {timing['median_ms']:.1f} | {timing['paired_ratio']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the results as JSON to this file, and as Markdown beside it (.md)")
    parser.add_argument("--blocks", type=int, default=24)
    parser.add_argument("--ops-width", type=int, default=128, help="width of the model whose operations are counted")
    parser.add_argument("--width", type=int, default=256, help="width of the model that is timed")
    parser.add_argument("--rounds", type=int, default=60, help="timed rounds (each steps every variant once)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds before them")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 suits a shared machine)")
    parser.add_argument("--compare", help="another delay_corrected.py, measured in the same run")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    report = run(args)
    save_report(report, args.out)
    if args.out:
        Path(args.out).with_suffix(".md").write_text(markdown(report))
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
