"""Where a stage's host time goes around the model, per micro-batch: each piece of the runtime's own work timed in
isolation, the way the runtime does it now against the way it did before, side by side.

The pieces, on one stage of the quickstart GPT (the embedding and two of four blocks, 4 micro-batches of
4 x 128 tokens) unless noted:

* ``version_swap``: running the stage on a micro-batch's pinned weight version, twice per micro-batch (its
  forward, and its backward for recomputing layers). Before: ``torch.func.functional_call`` and
  ``torch.nn.utils.stateless._reparametrize_module`` (a walk of every parameter name and tie per call). Now:
  :class:`~lightning_async_pp.runtime.versions_swap.ParameterSwap` (one dict assignment per parameter).
  Only the swap in and out is timed, not the layers.
* ``data_order``: the fingerprints of a step's micro-batches and their comparison with the previous
  stage's. Before: one :func:`~lightning_async_pp.runtime.fingerprint.fingerprint` and one comparison per
  micro-batch (and one more tensor in every activation message). Now: one
  :func:`~lightning_async_pp.runtime.fingerprint.step_fingerprints` and one comparison per step, sent once per
  step on its own group (the transfer is not timed here).
* ``profiler_label``: ``torch.profiler.record_function`` around each action (4 actions per micro-batch on a
  middle stage). Now only while a profiler records.
* ``action_label``: ``str(action)`` per action. Now only for a trace.
* ``payload_spec``: a tuple payload's encoded spec on every send. Before: encoded and copied to the device
  per message (on a GPU a pageable host-to-device copy). Now: once per layout.
* ``layout_check``: checking a message against the negotiated layout. Before: ``layout_of`` (validation and
  a new tuple) per message. Now: a comparison of dtypes and shapes.

Each piece runs ``--rounds`` rounds, before and after interleaved; the report has the medians in microseconds per
micro-batch and their sum. These are the runtime's host costs that do not depend on the schedule; the whole
runtime against torch's ``Schedule1F1B`` is measured by ``python -m benchmarks.emulated`` with zero-cost layers.

    python benchmarks/host_overhead.py --out benchmarks/results/host_overhead/host_overhead.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from bench_common import machine_description, save_report
from torch.nn.utils.stateless import _reparametrize_module

from lightning_async_pp.demos import GPT
from lightning_async_pp.runtime import activations
from lightning_async_pp.runtime.comm import _matches, layout_of
from lightning_async_pp.runtime.contract import StageModule
from lightning_async_pp.runtime.fingerprint import FingerprintCheck, fingerprint, step_fingerprints
from lightning_async_pp.runtime.microbatch import split_microbatches
from lightning_async_pp.runtime.versions_swap import ParameterSwap
from lightning_async_pp.schedule import step_actions

ACTIONS_PER_MICROBATCH = 4  # a middle stage: receive, forward, send; receive, backward, send (6), 2BW's update
REPEATS = 50  # calls per timed sample, so that a sample is well above the clock's resolution


def _per_call(fn: Callable[[], None], repeats: int = REPEATS) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def pieces(args: argparse.Namespace) -> dict[str, tuple[Callable[[], None], Callable[[], None], float]]:
    """Per piece: (before, after, how many calls of it one micro-batch makes)."""
    torch.manual_seed(0)
    model = GPT(n_layer=4, n_embd=128, n_head=4, block_size=args.block_size)
    stage = StageModule(*list(model.layers)[:3])
    params = {n: p for n, p in stage.named_parameters() if p.requires_grad}
    version = {n: p.detach().clone().requires_grad_(True) for n, p in params.items()}
    swap = ParameterSwap(stage, params)

    def swap_before() -> None:
        with _reparametrize_module(stage, version, tie_weights=True):
            pass

    def swap_after() -> None:
        with swap(version):
            pass

    M = args.microbatches
    tokens = torch.randint(0, 256, (M * 4, args.block_size + 1))
    batch = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    microbatches = split_microbatches(batch, M)

    def order_before() -> None:
        for microbatch in microbatches:
            mine = fingerprint(microbatch)
            FingerprintCheck(mine, mine.clone(), 0, 1).raise_if_different()

    def order_after() -> None:
        mine = step_fingerprints(batch, M)
        FingerprintCheck(mine, mine.clone(), 0, 1).raise_if_different()

    action = step_actions("2bw", 3, M, 1, 5, 0)[1]

    def label_before() -> None:
        with torch.profiler.record_function(f"pipeline {action}"):
            pass

    def label_after() -> None:
        if torch.autograd.profiler._is_profiler_enabled:
            raise AssertionError("a profiler is recording")

    hidden = torch.randn(4, args.block_size, 128)
    payload = (hidden, torch.ones(4, args.block_size, dtype=torch.int64))
    spec = activations.flatten(payload)[1]

    def spec_before() -> None:
        activations.encode(spec).to(hidden.device)

    def spec_after() -> None:
        activations.encoded(spec, hidden.device)

    message = [*payload, activations.encoded(spec, hidden.device)]
    layout = layout_of(message)

    def layout_before() -> None:
        if layout_of(message) != layout:
            raise AssertionError

    def layout_after() -> None:
        if not _matches(message, layout):
            raise AssertionError

    return {
        "version_swap": (swap_before, swap_after, 2.0),
        "data_order": (order_before, order_after, 1.0 / M),
        "profiler_label": (label_before, label_after, ACTIONS_PER_MICROBATCH),
        "action_label": (lambda: str(action), lambda: None, ACTIONS_PER_MICROBATCH),
        "payload_spec": (spec_before, spec_after, 1.0),
        "layout_check": (layout_before, layout_after, 2.0),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    table = pieces(args)
    samples: dict[str, dict[str, list[float]]] = {name: {"before": [], "after": []} for name in table}
    for _ in range(args.rounds):
        for name, (before, after, per_microbatch) in table.items():
            samples[name]["before"].append(_per_call(before) * per_microbatch)
            samples[name]["after"].append(_per_call(after) * per_microbatch)
    us = {
        name: {when: 1e6 * statistics.median(values) for when, values in by_when.items()}
        for name, by_when in samples.items()
    }
    total = {when: sum(piece[when] for piece in us.values()) for when in ("before", "after")}
    report = {
        "machine": machine_description(),
        "config": vars(args),
        "us_per_microbatch": us,
        "total_us_per_microbatch": total,
    }
    print(f"{'piece':<16} {'before us/mb':>13} {'after us/mb':>12}")
    for name, value in us.items():
        print(f"{name:<16} {value['before']:>13.1f} {value['after']:>12.1f}")
    print(f"{'total':<16} {total['before']:>13.1f} {total['after']:>12.1f}")
    save_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
