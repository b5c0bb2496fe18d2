"""Step time of the demo GPT with its blocks compiled (``GPT(compile=True)``, inductor) against eager, on CPU.

What is timed is what a 2BW stage computes in a step, on the quick start's model and batch by default: ``M``
micro-batches, each forward through the layers with the buffer of the step's weight version in place of the
parameters (:class:`~lightning_async_pp.runtime.versions_swap.ParameterSwap`, as the runtime does; the two versions
alternate), the loss, the backward, then AdamW's step on the parameters; with ``--precision bf16-mixed`` the
forward and the loss run under bfloat16 autocast, as Lightning's ``bf16-mixed`` does. No processes, no Lightning:
compilation changes compute, and this isolates it. Eager and compiled rounds are interleaved, so a change of
machine load hits both alike; the first ``--warmup`` rounds are reported apart. The compiled model's tracing and
code generation happen before, in its first step, timed on its own (``first_step``); the blocks of both compiled
models share those graphs.

``host_us_per_block`` is what the host spends per block and micro-batch (forward and backward, the step's
optimizer included) at width 16, where the computation is negligible: on a GPU, whose kernels run behind
the host, the time the host needs per block to keep ahead of it.

The report also gives the compiled model's largest difference from eager on the first step (loss and
gradients, from identical weights: inductor's fused kernels reorder float sums) and dynamo's counts (frames,
unique graphs, recompilations, graph breaks) after the warm-up and at the end (equal: no recompilation
across the two weight versions).

    python benchmarks/compile.py --out benchmarks/results/compile/compile.json
    python benchmarks/compile.py --n-layer 24 --precision bf16-mixed --out benchmarks/results/compile/compile_24.json
    python benchmarks/compile.py --quick          # a few rounds of a tiny model (the smoke test)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import torch
import torch.nn.functional as F
from bench_common import dynamo_counts, machine_description, save_report
from torch import Tensor, nn
from torch._dynamo.utils import counters

from lightning_async_pp.demos import GPT
from lightning_async_pp.runtime.microbatch import split_microbatches
from lightning_async_pp.runtime.versions_swap import ParameterSwap


class Variant:
    """One model (eager or compiled), its two weight buffers and its optimizer."""

    def __init__(self, args: argparse.Namespace, compile_option: bool | dict) -> None:
        self.model = GPT(
            n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size,
            compile=compile_option,
        )  # fmt: skip
        self.layers = nn.Sequential(*self.model.layers)
        params = dict(self.layers.named_parameters())
        self.buffers = [
            {n: p.data.requires_grad_(True) for n, p in params.items()},
            {n: p.detach().clone().requires_grad_(True) for n, p in params.items()},
        ]
        self.params = params
        self.swap = ParameterSwap(self.layers, params)
        self.optimizer = torch.optim.AdamW(params.values(), lr=1e-3)
        self.bf16 = args.precision == "bf16-mixed"

    def autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast("cpu", dtype=torch.bfloat16) if self.bf16 else contextlib.nullcontext()

    def step(self, microbatches: list, version: int) -> tuple[Tensor, dict[str, Tensor]]:
        """Forward and backward of every micro-batch on ``version``'s buffer, then the optimizer's step."""
        weights = self.buffers[version % 2]
        total = torch.zeros(())
        for x, y in microbatches:
            with self.autocast(), self.swap(weights):
                logits = self.layers(x)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)) / len(microbatches)
            with self.swap(weights):  # a block that recomputes in backward reads the same version
                loss.backward()
            total += loss.detach()
        grads = {n: t.grad for n, t in weights.items()}
        for name, param in self.params.items():
            param.grad = grads[name]
            weights[name].grad = None
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total, grads


def timed_step(variant: Variant, microbatches: list, version: int) -> float:
    start = time.perf_counter()
    variant.step(microbatches, version)
    return time.perf_counter() - start


def first_step(args: argparse.Namespace, microbatches: list, compile_option: dict) -> dict[str, float]:
    """The compiled model's first step (tracing and code generation included): its time, and its largest
    difference from eager's first step from the same weights."""
    eager, compiled = Variant(args, False), Variant(args, compile_option)
    loss_e, grads_e = eager.step(microbatches, 0)
    start = time.perf_counter()
    loss_c, grads_c = compiled.step(microbatches, 0)
    seconds = time.perf_counter() - start
    return {
        "compiled_first_step_s": seconds,
        "loss_abs_diff": float((loss_c - loss_e).abs()),
        "grad_abs_diff": max(float((grads_c[n] - grads_e[n]).abs().max()) for n in grads_e),
        "grad_max_abs": max(float(g.abs().max()) for g in grads_e.values()),
    }


def host_cost(args: argparse.Namespace, compile_option: dict, rounds: int = 20) -> dict[str, float]:
    """Microseconds per block, forward and backward, of the same step at a size where the computation is
    negligible (width 16, 4 tokens per micro-batch): what the host spends to issue a block's work, eager and
    compiled (interleaved rounds, medians). On a GPU this is the time the host needs to keep ahead of it."""
    tiny = argparse.Namespace(**{**vars(args), "n_embd": 16, "n_head": 2, "block_size": 4})
    tokens = torch.randint(0, 256, (args.microbatches, tiny.block_size + 1))
    microbatches = split_microbatches((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()), args.microbatches)
    variants = {"eager": Variant(tiny, False), "compiled": Variant(tiny, compile_option)}
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(3 + rounds):
        for name, variant in variants.items():
            seconds = timed_step(variant, microbatches, version=round_)
            if round_ >= 3:
                samples[name].append(1e6 * seconds / (args.n_layer * args.microbatches))
    return {name: statistics.median(values) for name, values in samples.items()}


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3, help="rounds not measured (compilation happens here)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--backend", default="inductor", help="torch.compile's backend")
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"])
    parser.add_argument("--quick", action="store_true", help="a tiny model, 2 rounds after 2 warm-up rounds")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.warmup, args.batch_size, args.block_size = 2, 2, 4, 16
        args.microbatches, args.n_layer, args.n_head, args.n_embd = 2, 2, 2, 32
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (args.batch_size, args.block_size + 1))
    microbatches = split_microbatches((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()), args.microbatches)
    compile_option = {"backend": args.backend}
    counters.clear()
    first = first_step(args, microbatches, compile_option)

    variants = {"eager": Variant(args, False), "compiled": Variant(args, compile_option)}
    samples: dict[str, list[float]] = {name: [] for name in variants}
    warmup: dict[str, list[float]] = {name: [] for name in variants}
    counts_after_warmup = None
    for round_ in range(args.warmup + args.rounds):
        if round_ == args.warmup:
            counts_after_warmup = dynamo_counts()
        for name, variant in variants.items():
            seconds = timed_step(variant, microbatches, version=round_)
            (warmup if round_ < args.warmup else samples)[name].append(seconds)
    median = {name: statistics.median(values) for name, values in samples.items()}
    paired = statistics.median(e / c for e, c in zip(samples["eager"], samples["compiled"]))
    report = {
        "machine": machine_description(),
        "load_average_at_end": os.getloadavg(),  # the machine may be shared: other work slows both variants
        "config": vars(args),
        "step_ms": {name: 1e3 * value for name, value in median.items()},
        "speedup": median["eager"] / median["compiled"],
        "speedup_paired": paired,
        "warmup_ms": {name: [1e3 * s for s in values] for name, values in warmup.items()},
        "first_step": first,
        "dynamo": {"after_warmup": counts_after_warmup, "end": dynamo_counts()},
    }
    # After the counts: the tiny model's new shapes compile once more.
    report["host_us_per_block"] = host_cost(args, compile_option)
    print(
        f"step ({args.microbatches} micro-batches of {list(microbatches[0][0].shape)} tokens, {args.n_layer} blocks "
        f"of width {args.n_embd}, {args.threads} thread(s)): eager {report['step_ms']['eager']:.1f} ms, compiled "
        f"({args.backend}) {report['step_ms']['compiled']:.1f} ms, speedup {report['speedup']:.2f}x "
        f"(paired {paired:.2f}x); first compiled step (compilation) {first['compiled_first_step_s']:.1f} s"
    )
    print(
        f"first step vs eager: loss {first['loss_abs_diff']:.2e}, gradients {first['grad_abs_diff']:.2e} "
        f"(largest gradient {first['grad_max_abs']:.2e}); dynamo {report['dynamo']}"
    )
    host = report["host_us_per_block"]
    print(f"host time per block (forward and backward, width 16): eager {host['eager']:.0f} us, compiled "
          f"{host['compiled']:.0f} us")  # fmt: skip
    save_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
