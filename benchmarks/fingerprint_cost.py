"""Cost per step of the micro-batch fingerprint that guards the data order between stages.

Each stage computes :func:`~lightning_async_pp.runtime.fingerprint.step_fingerprints` of its step's ``M``
micro-batches in one pass and (except the first) compares them with the ones received
(:class:`~lightning_async_pp.runtime.fingerprint.FingerprintCheck`). This script times that work for one step,
interleaved round by round with the forward and backward of one stage of the quickstart GPT (the first half of
its layers, on the same micro-batches), and reports the medians and their ratio. A second case times the
fingerprint of an image micro-batch (``--image-batch`` images of 3 x 224 x 224), whose cost depends on the
input size, not on the model.

    python benchmarks/fingerprint_cost.py --out benchmarks/results/fingerprint_cost/fingerprint_cost.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_common import machine_description, save_report

from lightning_async_pp.demos import GPT
from lightning_async_pp.runtime.fingerprint import FingerprintCheck, step_fingerprints
from lightning_async_pp.runtime.microbatch import split_microbatches


def fingerprint_step(batch, num_microbatches: int) -> None:
    mine = step_fingerprints(batch, num_microbatches)
    FingerprintCheck(mine, mine.clone(), 0, 1).raise_if_different()


def stage_step(layers: list[torch.nn.Module], microbatches: list) -> None:
    for microbatch in microbatches:
        x = microbatch[0]
        for layer in layers:
            x = layer(x)
        x.float().pow(2).mean().backward()


def timed(function, *args) -> float:
    start = time.perf_counter()
    function(*args)
    return time.perf_counter() - start


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--image-batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    model = GPT(n_layer=args.n_layer, n_embd=args.n_embd, n_head=4, block_size=args.block_size)
    stage_layers = list(model.layers)[: (args.n_layer + 2) // 2]  # stage 0 of 2: embedding and half the blocks
    tokens = torch.randint(0, 256, (args.batch_size, args.block_size + 1))
    batch = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    microbatches = split_microbatches(batch, args.microbatches)
    images = (torch.randn(args.image_batch, 3, 224, 224), torch.randint(0, 1000, (args.image_batch,)))

    samples: dict[str, list[float]] = {"fingerprint": [], "stage": [], "image_fingerprint": []}
    for round_ in range(args.warmup + args.rounds):
        times = {
            "fingerprint": timed(fingerprint_step, batch, args.microbatches),
            "stage": timed(stage_step, stage_layers, microbatches),
            "image_fingerprint": timed(fingerprint_step, images, 1),
        }
        model.zero_grad(set_to_none=True)
        if round_ >= args.warmup:
            for name, value in times.items():
                samples[name].append(value)
    median = {name: statistics.median(values) for name, values in samples.items()}
    paired = statistics.median(f / s for f, s in zip(samples["fingerprint"], samples["stage"]))
    report = {
        "machine": machine_description(),
        "config": vars(args),
        "microbatch_shapes": [list(t.shape) for t in microbatches[0]],
        "median_seconds": median,
        "fingerprint_per_step_ms": 1e3 * median["fingerprint"],
        "stage_step_ms": 1e3 * median["stage"],
        "fingerprint_share_of_stage_step": paired,
        "image_microbatch_fingerprint_ms": 1e3 * median["image_fingerprint"],
    }
    print(
        f"fingerprint + check per step ({args.microbatches} micro-batches of {list(microbatches[0][0].shape)} "
        f"tokens): {report['fingerprint_per_step_ms']:.3f} ms; stage 0 forward+backward: "
        f"{report['stage_step_ms']:.1f} ms; share (median of paired ratios): {100 * paired:.2f}%"
    )
    print(f"one micro-batch of {args.image_batch} images 3x224x224: {report['image_microbatch_fingerprint_ms']:.2f} ms")
    save_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
