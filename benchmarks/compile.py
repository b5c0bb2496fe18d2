"""Step time of the demo GPT with its blocks compiled (``GPT(compile=True)``, inductor) against eager, on CPU.

What is timed is what a 2BW stage computes in a step, on the quick start's model and batch by default: ``M``
micro-batches, each forward through the layers with ``torch.func.functional_call`` on the buffer of the
step's weight version (the two versions alternate, as they do in the runtime), the loss, the backward, then
AdamW's step on the parameters. No processes, no Lightning: compilation changes compute, and this isolates
it. Eager and compiled rounds are interleaved, so a change of machine load hits both alike; the first
``--warmup`` rounds are reported apart. The compiled model's tracing and code generation happen before, in
its first step, timed on its own (``first_step``); the blocks of both compiled models share those graphs.

The report also gives the compiled model's largest difference from eager on the first step (loss and
gradients, from identical weights: inductor's fused kernels reorder float sums) and dynamo's frame count
after the warm-up and at the end (equal: no recompilation across the two weight versions).

    python benchmarks/compile.py --out benchmarks/results/compile/compile.json
    python benchmarks/compile.py --quick          # a few rounds of a tiny model (the smoke test)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F
from bench_common import machine_description, save_report
from torch import Tensor, nn
from torch._dynamo.utils import counters
from torch.func import functional_call

from lightning_async_pp.demos import GPT
from lightning_async_pp.runtime.microbatch import split_microbatches


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
        self.optimizer = torch.optim.AdamW(params.values(), lr=1e-3)

    def step(self, microbatches: list, version: int) -> tuple[Tensor, dict[str, Tensor]]:
        """Forward and backward of every micro-batch on ``version``'s buffer, then the optimizer's step."""
        weights = self.buffers[version % 2]
        total = torch.zeros(())
        for x, y in microbatches:
            logits = functional_call(self.layers, weights, (x,))
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)) / len(microbatches)
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
    frames_after_warmup = None
    for round_ in range(args.warmup + args.rounds):
        if round_ == args.warmup:
            frames_after_warmup = int(counters["frames"]["total"])
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
        "dynamo_frames": {"after_warmup": frames_after_warmup, "end": int(counters["frames"]["total"])},
    }
    print(
        f"step ({args.microbatches} micro-batches of {list(microbatches[0][0].shape)} tokens, {args.n_layer} blocks "
        f"of width {args.n_embd}, {args.threads} thread(s)): eager {report['step_ms']['eager']:.1f} ms, compiled "
        f"({args.backend}) {report['step_ms']['compiled']:.1f} ms, speedup {report['speedup']:.2f}x "
        f"(paired {paired:.2f}x); first compiled step (compilation) {first['compiled_first_step_s']:.1f} s"
    )
    print(
        f"first step vs eager: loss {first['loss_abs_diff']:.2e}, gradients {first['grad_abs_diff']:.2e} "
        f"(largest gradient {first['grad_max_abs']:.2e}); dynamo frames {report['dynamo_frames']}"
    )
    save_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
