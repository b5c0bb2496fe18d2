"""Splitting a sequence of layers into contiguous pipeline stages.

A partition is given by the *start index* of each stage: ``starts[k]`` is the
first layer of stage ``k``, ``starts[0] == 0``, and stage ``k`` holds layers
``starts[k] .. starts[k+1] - 1`` (the last stage runs to the end); see
:func:`stage_ranges`. Nothing here allocates parameters: costs usually come
from :func:`count_parameters`, which works on meta-device modules.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from itertools import accumulate

from lightning_async_pp.schedule.ir import is_int

__all__ = ["balanced_partition", "count_parameters", "partition_from_split_points", "stage_ranges"]


def _check_stage_count(num_stages: int, num_layers: int) -> None:
    if not is_int(num_stages):
        raise TypeError(f"num_stages must be an int, got {type(num_stages).__name__}")
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_stages > num_layers:
        raise ValueError(
            f"pipeline has {num_stages} stages but the model has only {num_layers} layers; "
            "use fewer devices or split the model into more layers"
        )


def balanced_partition(costs: Sequence[float], num_stages: int) -> list[int]:
    """Contiguous split minimizing the cost of the most expensive stage (exact).

    Dynamic programme over prefixes: ``best[k][j]`` is the smallest possible
    maximum stage cost when the first ``j`` layers form ``k`` stages. For fixed
    ``j`` the candidate ``max(best[k-1][i], cost(i..j))`` is the max of a
    non-decreasing and a non-increasing function of the split ``i``, so the
    optimum sits where they cross and is found by bisection: ``O(P n log n)``.
    Ties are broken deterministically: working back from the last stage, each
    stage starts at the earliest split reaching the optimum, which leaves spare
    layers to later stages; those keep fewer micro-batches' activations in
    flight (stage ``s`` stashes up to ``P - s`` under 1F1B/2BW).

    Args:
        costs: non-negative cost per layer (parameter count, measured time, ...).
        num_stages: number of non-empty stages.

    Returns:
        The start index of each stage (``len == num_stages``, first is 0).
    """
    n = len(costs)
    _check_stage_count(num_stages, n)
    for k, c in enumerate(costs):
        if not (isinstance(c, (int, float)) and math.isfinite(c) and c >= 0):
            raise ValueError(f"layer costs must be finite and >= 0, layer {k} has {c!r}")
    prefix = [0, *accumulate(costs)]

    def span(i: int, j: int) -> float:
        return prefix[j] - prefix[i]

    # best[j] for the current number of stages; choice[k][j] = start of stage k-1
    # (the last of k stages) in the optimum for the first j layers.
    best = [math.inf] * (n + 1)
    for j in range(1, n + 1):
        best[j] = span(0, j)
    choice: list[list[int]] = [[0] * (n + 1)]
    for k in range(2, num_stages + 1):
        new = [math.inf] * (n + 1)
        pick = [0] * (n + 1)
        # The remaining num_stages - k stages need at least one layer each.
        for j in range(k, n - (num_stages - k) + 1):
            new[j], pick[j] = _earliest_best_split(best, span, k - 1, j)
        best = new
        choice.append(pick)
    starts = [0] * num_stages
    j = n
    for k in range(num_stages - 1, 0, -1):
        starts[k] = choice[k][j]
        j = starts[k]
    return starts


def _earliest_best_split(best: list[float], span: Callable[[int, int], float], first: int, j: int) -> tuple[float, int]:
    """The smallest maximum stage cost of the first ``j`` layers when the last stage starts at a split
    ``i >= first`` (the layers before it in ``best[i]``), and the earliest split that attains it.

    ``max(best[i], span(i, j))`` is the max of a non-decreasing and a non-increasing function of ``i``: the
    optimum sits where they cross, found by bisection.
    """

    def split_cost(i: int) -> float:  # first i layers in the earlier stages, then i..j-1
        return max(best[i], span(i, j))

    # Smallest split i in [first, j-1] where the prefix cost reaches the last stage's cost.
    lo, hi = first, j - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if best[mid] >= span(mid, j):
            hi = mid
        else:
            lo = mid + 1
    value = split_cost(lo) if lo == first else min(split_cost(lo - 1), split_cost(lo))
    # split_cost does not increase before lo; equal values there come from
    # zero-cost layers, so walk back to the earliest split attaining the optimum.
    i = lo if split_cost(lo) == value else lo - 1
    while i - 1 >= first and split_cost(i - 1) == value:
        i -= 1
    return value, i


def partition_from_split_points(
    num_layers: int, split_points: Sequence[int], num_stages: int | None = None
) -> list[int]:
    """Stage starts from user-given split points: stage ``k`` starts at ``split_points[k-1]``.

    Args:
        num_layers: number of layers in the model.
        split_points: first layer of stages 1, 2, ...; strictly increasing, in ``(0, num_layers)``.
        num_stages: if given, ``len(split_points)`` must be ``num_stages - 1``.

    Returns:
        The start index of each stage, ``[0, *split_points]``.
    """
    points = list(split_points)
    if num_stages is not None and len(points) != num_stages - 1:
        raise ValueError(
            f"{num_stages} pipeline stages need {num_stages - 1} split points, got {len(points)} "
            f"({points}); give one split point per stage boundary"
        )
    for p in points:
        if not is_int(p):
            raise TypeError(f"split points must be ints, got {p!r}")
        if not 0 < p < num_layers:
            raise ValueError(
                f"split point {p} is outside 1..{num_layers - 1}: each stage needs at least one of the "
                f"{num_layers} layers; use split points between 1 and {num_layers - 1}"
            )
    for a, b in zip(points, points[1:]):
        if b <= a:
            raise ValueError(
                f"split points must be strictly increasing, got {points} ({a} then {b}); "
                "sort them and remove duplicates (an empty stage is not allowed)"
            )
    return [0, *points]


def stage_ranges(starts: Sequence[int], num_layers: int) -> list[range]:
    """The layer indices of each stage, ``range(starts[k], starts[k+1])``."""
    starts = list(starts)
    if not starts or starts[0] != 0:
        raise ValueError(f"stage starts must begin with 0, got {starts}")
    partition_from_split_points(num_layers, starts[1:])
    bounds = [*starts, num_layers]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def count_parameters(module) -> int:
    """Number of parameters of a ``torch.nn.Module`` (shared ones counted once).

    Only reads shapes, so it works on modules built on ``torch.device("meta")``
    without allocating anything.
    """
    return sum(p.numel() for p in module.parameters())
