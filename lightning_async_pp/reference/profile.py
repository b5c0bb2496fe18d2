"""Per-stage gradient delays on one device: simulate the original PipeDream's growing staleness.

PipeDream-2BW gives every stage the same one-step delay (see :mod:`lightning_async_pp.reference.delayed`).
The original PipeDream (weight stashing, no flushes) does not: stage ``s`` of ``P`` computes its gradient on
weights that are ``P - 1 - s`` steps old, so the first stage is the stalest and the last stage is not delayed
at all. This module reproduces such *delay profiles* on a single process, for any grouping of the parameters
and any non-negative delay per group::

    w_g[t+1] = w_g[t] - u_g(grad_g f(w_0[t-d_0], ..., w_{G-1}[t-d_{G-1}]), batch t),    w[-k] = w[0]

Each group ``g`` keeps a ring of its last ``d_g`` weight versions. One forward and backward pass runs with every
group swapped to its own delayed version (each stage's forward and backward see the same stashed version, as
with weight stashing), so group ``g`` gets its gradient at ``w_g[t-d_g]`` while the other groups sit at their
own delayed versions; then the current weights are swapped back and the optimizer steps them as usual. The
optimizer state advances once per step and is never rewound. With every delay equal to 1 this is exactly the
2BW trajectory of :class:`~lightning_async_pp.reference.delayed.DelayedWeights`; with every delay 0 it is
synchronous training.

Simplification: PipeDream proper applies an update after every micro-batch; here the unit of delay is one
optimizer step (a whole batch), as in 2BW. Memory: ``d_g`` extra copies of group ``g``'s parameters.

This is a research tool, independent of the pipeline runtime. It plugs into any training loop, and into
Lightning through ``LightningModule.optimizer_step``::

    profile = DelayProfile.pipedream(model.pipeline_layers(), num_stages=8)

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        optimizer.step(closure=profile.wrap_closure(optimizer_closure))
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn

from lightning_async_pp.schedule.ir import is_int
from lightning_async_pp.schedule.partition import balanced_partition, stage_ranges

__all__ = ["DelayProfile", "pipedream_delays", "split_into_stages"]


def pipedream_delays(num_stages: int) -> list[int]:
    """The original PipeDream's delay of each stage: ``P - 1 - s`` steps for stage ``s`` of ``P``."""
    if not is_int(num_stages) or num_stages < 1:
        raise ValueError(f"`num_stages` must be a positive integer, got {num_stages!r}.")
    return [num_stages - 1 - s for s in range(num_stages)]


def split_into_stages(
    layers: Sequence[nn.Module] | nn.Module,
    num_stages: int,
    granularity: Literal["layer", "parameter"] = "layer",
) -> list[list[nn.Parameter]]:
    """Cut a model into ``num_stages`` contiguous groups of trainable parameters, balanced by parameter count.

    Args:
        layers: The model's layers in forward order (e.g. ``pipeline_layers()``), or one module whose
            parameters are taken in registration order.
        num_stages: Number of groups (stages).
        granularity: ``"layer"`` cuts only between layers, as a pipeline does (needs ``num_stages <=
            len(layers)``). ``"parameter"`` cuts between parameter tensors in forward order, which emulates a
            pipeline deeper than the model has layers (a boundary may fall inside a layer).

    Returns:
        One list of trainable parameters per stage, stage 0 (the input side) first.
    """
    if isinstance(layers, nn.Module):
        layers = [layers] if granularity == "parameter" else list(layers.children())
    if granularity == "layer":
        units = [[p for p in layer.parameters() if p.requires_grad] for layer in layers]
    elif granularity == "parameter":
        seen: set[int] = set()
        units = []
        for layer in layers:
            for p in layer.parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    units.append([p])
    else:
        raise ValueError(f"`granularity` must be 'layer' or 'parameter', got {granularity!r}.")
    costs = [float(sum(p.numel() for p in unit)) for unit in units]
    starts = balanced_partition(costs, num_stages)
    return [[p for i in r for p in units[i]] for r in stage_ranges(starts, len(units))]


class DelayProfile:
    """Computes each parameter group's gradient at its own delayed weight version.

    Args:
        groups: Lists of parameters, one per group (stage). A parameter may appear in one group only.
        delays: Delay of each group in optimizer steps (``>= 0``), same length as ``groups``.

    Example, a 4-stage original PipeDream on a model with a ``layers`` list::

        profile = DelayProfile.pipedream(model.layers, num_stages=4)   # delays 3, 2, 1, 0
        loss = optimizer.step(profile.wrap_closure(closure))
    """

    def __init__(self, groups: Sequence[Iterable[nn.Parameter]], delays: Sequence[int]) -> None:
        groups = [list(g) for g in groups]
        delays = list(delays)
        if len(groups) != len(delays):
            raise ValueError(f"Got {len(groups)} parameter groups but {len(delays)} delays; give one delay per group.")
        for d in delays:
            if not is_int(d) or d < 0:
                raise ValueError(f"Delays must be non-negative integers (steps), got {delays}.")
        seen: set[int] = set()
        for g in groups:
            for p in g:
                if id(p) in seen:
                    raise ValueError("A parameter appears in more than one group; each must have a single delay.")
                seen.add(id(p))
        self.groups = groups
        self.delays = delays
        # history[g] holds [w_g[t-d], ..., w_g[t-1]] (oldest first); w[-k] = w[0].
        self.history: list[deque[list[Tensor]]] = [
            deque([p.detach().clone() for p in g] for _ in range(d)) for g, d in zip(groups, delays)
        ]
        self.steps = 0

    @classmethod
    def pipedream(
        cls,
        layers: Sequence[nn.Module] | nn.Module,
        num_stages: int,
        granularity: Literal["layer", "parameter"] = "layer",
    ) -> DelayProfile:
        """The original PipeDream profile: ``num_stages`` balanced stages, stage ``s`` delayed ``P-1-s`` steps."""
        return cls(split_into_stages(layers, num_stages, granularity), pipedream_delays(num_stages))

    @classmethod
    def uniform(
        cls,
        layers: Sequence[nn.Module] | nn.Module,
        num_stages: int,
        delay: int = 1,
        granularity: Literal["layer", "parameter"] = "layer",
    ) -> DelayProfile:
        """Every stage delayed by ``delay`` steps (``1``: PipeDream-2BW, whatever ``num_stages`` is)."""
        return cls(split_into_stages(layers, num_stages, granularity), [delay] * num_stages)

    @property
    def max_delay(self) -> int:
        return max(self.delays, default=0)

    def extra_copies_numel(self) -> int:
        """Number of stored weight elements (the memory cost beyond the model)."""
        return sum(d * sum(p.numel() for p in g) for g, d in zip(self.groups, self.delays))

    def wrap_closure(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """Return a closure that runs ``closure`` (forward and backward) with each group at its delayed version.

        Afterwards the parameters hold the current weights ``w[t]`` again, with their ``.grad`` computed at the
        delayed versions, and each group's history has advanced by one step (``w[t]`` stored, the oldest
        version dropped). Call it exactly once per optimizer step: a second call of the same returned closure
        raises, since an optimizer that evaluates its closure several times per step (``LBFGS``) has no delayed
        trajectory (each evaluation would advance the history).
        """
        calls = 0

        def delayed_closure() -> Any:
            nonlocal calls
            calls += 1
            if calls > 1:
                raise RuntimeError(
                    "The optimizer evaluated its closure a second time in one step. The delayed trajectory computes "
                    "one gradient per step on the stale weights, so an optimizer that re-evaluates the closure "
                    "(LBFGS, a line search) cannot follow it: use an optimizer that calls the closure at most once, "
                    "or train without a delay (schedule='1f1b')."
                )
            with self.delayed():
                result = closure()
            self._advance()
            return result

        return delayed_closure

    @contextlib.contextmanager
    def delayed(self) -> Iterator[None]:
        """Inside, each group holds its delayed version (gradients computed there land in ``.grad``); afterwards
        the current weights again. The history does not advance: several batches whose gradients accumulate
        into one step (gradient accumulation) each run inside, and the step's :meth:`wrap_closure` advances it
        once."""
        swapped: list[tuple[nn.Parameter, Tensor]] = []
        with torch.no_grad():
            for g, d, hist in zip(self.groups, self.delays, self.history):
                if d == 0:
                    continue
                for p, old in zip(g, hist[0]):
                    swapped.append((p, p.data))
                    p.data = old
        try:
            with torch.enable_grad():
                yield
        finally:
            for p, now in swapped:
                p.data = now

    @torch.no_grad()
    def _advance(self) -> None:
        for g, d, hist in zip(self.groups, self.delays, self.history):
            if d == 0:
                continue
            oldest = hist.popleft()  # reuse its storage for w[t]
            for buf, p in zip(oldest, g):
                buf.copy_(p.data)
            hist.append(oldest)
        self.steps += 1
