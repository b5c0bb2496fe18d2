"""Step time and memory of the optimizers on the parameters of a small GPT.

Compares, in one run:

* ``adamw`` vs ``adamw_corrected``: :class:`torch.optim.AdamW` alone and wrapped in
  :class:`~lightning_async_pp.optim.DelayCorrected`, on all parameters;
* ``muon`` vs ``muon_corrected``: our :class:`~lightning_async_pp.optim.Muon` (hidden matrices with Muon,
  embedding, head and norms with AdamW) alone and wrapped, on all parameters;
* ``torch_muon`` vs ``muon_matrices``: :class:`torch.optim.Muon` and ours on the hidden matrices only.

The parameters are bare tensors shaped like a GPT (no model is built): embedding ``vocab x width``, per block
two LayerNorms, attention ``width x 3 width`` and ``width x width``, MLP ``width x 4 width`` and
``4 width x width``, a final LayerNorm and a ``width x vocab`` head. The defaults (vocab 256, width 128,
4 blocks) give 0.85M parameters. Gradients are random and fixed; every variant owns its own copy.

Time: variants of a family are stepped interleaved (A B A B ... and C D E F C D E F ...), so that a change of
machine load hits all of them alike; the first ``--warmup`` rounds are dropped and the median of the rest is
reported. Ratios are given as the ratio of the medians, as the median of per-round ratios ("paired"), and,
for the correction, as the median over rounds of (corrected step time / time of the base optimizer's step
inside it) ("in step", timed with step hooks on the base optimizer): that last one isolates the
correction's own cost from load that changes between two steps, but does not see a slowdown the correction
might cause in the base step itself (e.g. through caches), which the other two would. ``targets_met``
compares the paired ratios with ``TARGETS``. The AdamW pair and
the Muon group run as separate interleaved loops, because a Muon step costs far more (Newton-Schulz matmuls
run in bfloat16, which is slow on most CPUs) and gets fewer repetitions.

Memory, two numbers per variant, both counted rather than sampled from the process:

* ``state_bytes``: bytes of the tensors in ``optimizer.state_dict()["state"]`` at the end of the run, i.e.
  the persistent optimizer state (moments, momentum, step counts, previous updates).
* ``peak_temporary_bytes``: the peak, during one step (the last warm-up round), of the bytes of tensors that
  ops of that step allocated and that are still alive. Counted with a ``TorchDispatchMode`` that sees every
  aten op: outputs that do not alias an input are new allocations, and a finalizer on their storage marks
  them freed. Scratch memory that a kernel allocates internally without returning it (e.g. matmul
  workspaces) is not seen.

On a machine shared with other processes, pass ``--threads 1``: with more intra-op threads than free
cores, each parallel kernel can wait for a descheduled thread, which inflates step times erratically (a
busy 2-core machine showed the corrected Muon step 18% slower with 2 threads and 0.2% with 1).

Usage::

    python benchmarks/optim_overhead.py --out optim_overhead.json
    python benchmarks/optim_overhead.py --quick
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_async_pp.optim import DelayCorrected, Muon

ADAMW_FAMILY = ("adamw", "adamw_corrected")
MUON_FAMILY = ("torch_muon", "muon_matrices", "muon", "muon_corrected")
TARGETS = {"correction_on_adamw": 1.15, "correction_on_muon": 1.02, "ours_vs_torch_muon": 1.05}


def gpt_shapes(vocab: int = 256, width: int = 128, blocks: int = 4) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of a GPT's parameters; hidden matrices are the ``attn``/``mlp`` weights."""
    shapes: list[tuple[str, tuple[int, ...]]] = [("embed.weight", (vocab, width))]
    for i in range(blocks):
        shapes += [
            (f"blocks.{i}.ln1.weight", (width,)),
            (f"blocks.{i}.ln1.bias", (width,)),
            (f"blocks.{i}.attn.qkv.weight", (width, 3 * width)),
            (f"blocks.{i}.attn.proj.weight", (width, width)),
            (f"blocks.{i}.ln2.weight", (width,)),
            (f"blocks.{i}.ln2.bias", (width,)),
            (f"blocks.{i}.mlp.fc.weight", (width, 4 * width)),
            (f"blocks.{i}.mlp.proj.weight", (4 * width, width)),
        ]
    shapes += [("ln_f.weight", (width,)), ("ln_f.bias", (width,)), ("lm_head.weight", (width, vocab))]
    return shapes


def make_parameters(shapes, seed: int = 0) -> list[tuple[str, torch.nn.Parameter]]:
    generator = torch.Generator().manual_seed(seed)
    named = []
    for name, shape in shapes:
        param = torch.nn.Parameter(torch.randn(shape, generator=generator) * 0.02)
        param.grad = torch.randn(shape, generator=generator)
        named.append((name, param))
    return named


MUON_NS_DTYPE = "bfloat16"
"""Newton-Schulz precision of every Muon variant here: torch.optim.Muon's, not Muon's CPU default (float32)."""


def is_hidden_matrix(name: str) -> bool:
    return ".attn." in name or ".mlp." in name


def build(variant: str, shapes, adamw_lr: float, muon_lr: float) -> torch.optim.Optimizer:
    named = make_parameters(shapes)
    hidden = [p for n, p in named if is_hidden_matrix(n)]
    adamw = {"lr": adamw_lr, "weight_decay": 0.1, "betas": (0.9, 0.95)}
    muon = {"lr": muon_lr, "weight_decay": 0.1}
    # torch.optim.Muon's bfloat16 iteration for ours too, so that the pair compares the same arithmetic
    # (our default, "auto", is float32 on CPU); the report says so under config.
    ours = {
        **muon,
        "adamw_lr": adamw_lr,
        "adamw_weight_decay": 0.1,
        "adamw_betas": (0.9, 0.95),
        "ns_dtype": MUON_NS_DTYPE,
    }
    if variant == "adamw":
        return torch.optim.AdamW([p for _, p in named], **adamw)
    if variant == "adamw_corrected":
        return DelayCorrected(torch.optim.AdamW([p for _, p in named], **adamw))
    if variant == "torch_muon":
        return torch.optim.Muon(hidden, **muon)
    if variant == "muon_matrices":
        return Muon(hidden, **ours)
    if variant == "muon":
        return Muon(named, **ours)
    if variant == "muon_corrected":
        return DelayCorrected(Muon(named, **ours))
    raise ValueError(f"Unknown variant {variant!r}")


class AllocationCounter(TorchDispatchMode):
    """Tracks the bytes of tensors allocated by ops while the mode is active and still alive."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        results = out if isinstance(out, (tuple, list)) else (out,)
        for schema_return, result in zip(func._schema.returns, results):
            if schema_return.alias_info is not None:
                continue
            for tensor in result if isinstance(result, (tuple, list)) else (result,):
                if isinstance(tensor, torch.Tensor):
                    storage = tensor.untyped_storage()
                    self.live += storage.nbytes()
                    weakref.finalize(storage, self._freed, storage.nbytes())
        self.peak = max(self.peak, self.live)
        return out


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    seen: dict[int, int] = {}
    for state in optimizer.state_dict()["state"].values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                storage = value.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def measure_interleaved(
    optimizers: dict[str, torch.optim.Optimizer], rounds: int, warmup: int
) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, int]]:
    """Step the optimizers in turn.

    Returns per-round step times; for ``DelayCorrected`` variants, per-round times of the base optimizer's
    step inside the corrected step (from step hooks on the base optimizer), so that the correction's own cost
    is measured within the very same step; and the peak temporary bytes of each variant. The last warm-up
    round runs under :class:`AllocationCounter`, so memory is counted on a step that has state already
    (hence ``warmup >= 2``) and costs no extra step.
    """
    if warmup < 2:
        raise ValueError(f"`warmup` must be at least 2 (one step to create the state, one to count), got {warmup}")
    times: dict[str, list[float]] = {name: [] for name in optimizers}
    base_times: dict[str, list[float]] = {}
    peaks: dict[str, int] = {}
    base_started: list[float] = []
    base_elapsed: list[float] = []
    for name, optimizer in optimizers.items():
        if isinstance(optimizer, DelayCorrected):
            base_times[name] = []
            optimizer.base_optimizer.register_step_pre_hook(lambda *_: base_started.append(time.perf_counter()))
            optimizer.base_optimizer.register_step_post_hook(
                lambda *_: base_elapsed.append(time.perf_counter() - base_started.pop())
            )

    for round_index in range(warmup + rounds):
        for name, optimizer in optimizers.items():
            if round_index == warmup - 1:
                counter = AllocationCounter()
                with counter:
                    optimizer.step()
                peaks[name] = counter.peak
                continue
            start = time.perf_counter()
            optimizer.step()
            elapsed = time.perf_counter() - start
            if round_index >= warmup:
                times[name].append(elapsed)
                if name in base_times:
                    base_times[name].append(base_elapsed[-1])
    return times, base_times, peaks


def summarize(samples: Sequence[float]) -> dict[str, float]:
    quartiles = statistics.quantiles(samples, n=4) if len(samples) > 1 else [samples[0]] * 3
    return {
        "median_ms": statistics.median(samples) * 1e3,
        "q25_ms": quartiles[0] * 1e3,
        "q75_ms": quartiles[2] * 1e3,
        "rounds": len(samples),
    }


def run(
    vocab: int,
    width: int,
    blocks: int,
    adamw_rounds: int,
    muon_rounds: int,
    warmup: int,
    adamw_lr: float = 1e-3,
    muon_lr: float = 0.02,
    log: Callable[[str], Any] = print,
) -> dict[str, Any]:
    shapes = gpt_shapes(vocab, width, blocks)
    n_params = sum(torch.Size(shape).numel() for _, shape in shapes)
    n_hidden = sum(torch.Size(shape).numel() for name, shape in shapes if is_hidden_matrix(name))
    log(
        f"{n_params:,} parameters ({n_hidden:,} in hidden matrices), torch {torch.__version__},"
        f" {torch.get_num_threads()} threads"
    )

    families = ((ADAMW_FAMILY, adamw_rounds), (MUON_FAMILY, muon_rounds))
    results, samples, in_step_ratios = measure_families(families, shapes, warmup, adamw_lr, muon_lr)
    pairs = {
        "correction_on_adamw": ("adamw_corrected", "adamw"),
        "correction_on_muon": ("muon_corrected", "muon"),
        "ours_vs_torch_muon": ("muon_matrices", "torch_muon"),
    }
    ratios = {key: results[a]["median_ms"] / results[b]["median_ms"] for key, (a, b) in pairs.items()}
    # Both steps of a round ran back to back, so the median of per-round ratios is less sensitive to load
    # that drifts over the run than the ratio of the medians.
    paired_ratios = {
        key: statistics.median(x / y for x, y in zip(samples[a], samples[b])) for key, (a, b) in pairs.items()
    }
    # Corrected step / its own base step: the correction's cost without any noise between two steps.
    in_step = {
        "correction_on_adamw": in_step_ratios["adamw_corrected"],
        "correction_on_muon": in_step_ratios["muon_corrected"],
    }
    report = {
        "config": {
            "vocab": vocab,
            "width": width,
            "blocks": blocks,
            "parameters": n_params,
            "hidden_matrix_parameters": n_hidden,
            "adamw_rounds": adamw_rounds,
            "muon_rounds": muon_rounds,
            "warmup": warmup,
            "threads": torch.get_num_threads(),
            "muon_ns_dtype": f"{MUON_NS_DTYPE} (changed from Muon's default 'auto', float32 on CPU)",
            "torch": torch.__version__,
            "machine": platform.machine(),
            "processor": platform.processor(),
        },
        "variants": results,
        "ratios": ratios,
        "paired_ratios": paired_ratios,
        "in_step_ratios": in_step,
        "targets": TARGETS,
        "targets_met": {key: paired_ratios[key] <= limit for key, limit in TARGETS.items()},
    }
    log_report(report, log)
    return report


def measure_families(
    families: Sequence[tuple[Sequence[str], int]],
    shapes: list[tuple[str, tuple[int, ...]]],
    warmup: int,
    adamw_lr: float,
    muon_lr: float,
) -> tuple[dict[str, dict[str, Any]], dict[str, list[float]], dict[str, float]]:
    """Time each family's variants interleaved; returns their summaries, raw step times (seconds) and, for
    corrected variants, the median ratio of the corrected step to its own base step."""
    results: dict[str, dict[str, Any]] = {}
    samples: dict[str, list[float]] = {}
    in_step_ratios: dict[str, float] = {}
    for family, rounds in families:
        optimizers = {name: build(name, shapes, adamw_lr, muon_lr) for name in family}
        times, base_times, peaks = measure_interleaved(optimizers, rounds, warmup)
        samples.update(times)
        for name, optimizer in optimizers.items():
            results[name] = {
                **summarize(times[name]),
                "state_bytes": state_bytes(optimizer),
                "peak_temporary_bytes": peaks[name],
            }
            if name in base_times:
                within = [total - base for total, base in zip(times[name], base_times[name])]
                results[name]["base_step_median_ms"] = statistics.median(base_times[name]) * 1e3
                results[name]["correction_median_ms"] = statistics.median(within) * 1e3
                in_step_ratios[name] = statistics.median(t / b for t, b in zip(times[name], base_times[name]))
    return results, samples, in_step_ratios


def log_report(report: dict[str, Any], log: Callable[[str], Any]) -> None:
    """The variants' and the ratios' tables of a :func:`run` report, one line per call of ``log``."""
    ratios, paired_ratios, in_step = report["ratios"], report["paired_ratios"], report["in_step_ratios"]
    log(f"{'variant':<16}{'median ms':>11}{'q25':>9}{'q75':>9}{'state MiB':>10}{'peak temp MiB':>15}")
    for name, r in report["variants"].items():
        log(
            f"{name:<16}{r['median_ms']:>11.3f}{r['q25_ms']:>9.3f}{r['q75_ms']:>9.3f}"
            f"{r['state_bytes'] / 2**20:>10.2f}{r['peak_temporary_bytes'] / 2**20:>15.2f}"
        )
    log(f"{'ratio':<22}{'of medians':>11}{'paired':>9}{'in step':>9}  target")
    for key, value in ratios.items():
        within = f"{in_step[key]:>9.3f}" if key in in_step else f"{'':>9}"
        log(f"{key:<22}{value:>11.3f}{paired_ratios[key]:>9.3f}{within}  <= {TARGETS[key]}")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the results as JSON to this file")
    parser.add_argument("--quick", action="store_true", help="few repetitions; finishes in under a minute")
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--adamw-rounds", type=int, default=None, help="timed rounds of the AdamW pair")
    parser.add_argument("--muon-rounds", type=int, default=None, help="timed rounds of the Muon group")
    parser.add_argument("--warmup", type=int, default=None, help="untimed rounds before measuring (>= 2)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args(argv)

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    adamw_rounds = args.adamw_rounds or (60 if args.quick else 300)
    muon_rounds = args.muon_rounds or (2 if args.quick else 25)
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 4)
    report = run(args.vocab, args.width, args.blocks, adamw_rounds, muon_rounds, warmup)
    if args.out:
        with open(args.out, "w") as file:
            json.dump(report, file, indent=2)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
