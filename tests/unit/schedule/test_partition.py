"""Stage partitioning: optimality, user split points, meta-device parameter counting."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch import nn

from lightning_async_pp.schedule.partition import (
    balanced_partition,
    count_parameters,
    partition_from_split_points,
    stage_ranges,
)


def stage_costs(costs, starts):
    return [sum(costs[i] for i in r) for r in stage_ranges(starts, len(costs))]


def brute_force(costs, num_stages):
    n = len(costs)
    return min(max(stage_costs(costs, [0, *cuts])) for cuts in itertools.combinations(range(1, n), num_stages - 1))


def test_optimal_against_brute_force():
    rng = random.Random(1234)
    for _ in range(400):
        n = rng.randint(1, 9)
        P = rng.randint(1, n)
        # Integers (with zeros and repeats, to exercise ties) and floats.
        if rng.random() < 0.5:
            costs = [rng.choice([0, 1, 1, 2, 3, 5, 8]) for _ in range(n)]
        else:
            costs = [rng.uniform(0, 10) for _ in range(n)]
        starts = balanced_partition(costs, P)
        assert len(starts) == P and starts[0] == 0
        assert all(len(r) > 0 for r in stage_ranges(starts, n))
        assert max(stage_costs(costs, starts)) == pytest.approx(brute_force(costs, P), abs=1e-9)
        assert balanced_partition(costs, P) == starts  # deterministic


def test_small_cases_by_hand():
    assert balanced_partition([1, 1, 1, 1], 2) == [0, 2]
    assert balanced_partition([5], 1) == [0]
    assert balanced_partition([1, 2, 3], 3) == [0, 1, 2]
    # One heavy layer gets a stage of its own.
    assert balanced_partition([1, 1, 10, 1, 1], 3) == [0, 2, 3]
    # Ties leave the spare layer to the later stage (fewer stashed activations there).
    assert balanced_partition([1, 1, 1], 2) == [0, 1]
    assert balanced_partition([1] * 7, 3) == [0, 2, 4]


def test_larger_input_is_fast_and_balanced():
    rng = random.Random(0)
    costs = [rng.uniform(1, 2) for _ in range(1000)]
    starts = balanced_partition(costs, 64)
    per_stage = stage_costs(costs, starts)
    # The optimum is at most the average plus the largest layer.
    assert max(per_stage) <= sum(costs) / 64 + max(costs)


def test_balanced_partition_errors():
    with pytest.raises(ValueError, match="pipeline has 5 stages but the model has only 3 layers; use fewer devices"):
        balanced_partition([1, 2, 3], 5)
    with pytest.raises(ValueError, match="num_stages must be >= 1"):
        balanced_partition([1, 2, 3], 0)
    with pytest.raises(ValueError, match="layer 1"):
        balanced_partition([1, -2, 3], 2)
    with pytest.raises(ValueError, match="layer 0"):
        balanced_partition([float("nan"), 1], 2)


def test_split_points():
    assert partition_from_split_points(10, [3, 7]) == [0, 3, 7]
    assert partition_from_split_points(10, [3, 7], num_stages=3) == [0, 3, 7]
    assert partition_from_split_points(4, []) == [0]
    with pytest.raises(ValueError, match="3 pipeline stages need 2 split points, got 1"):
        partition_from_split_points(10, [5], num_stages=3)
    with pytest.raises(ValueError, match="strictly increasing.*sort them"):
        partition_from_split_points(10, [7, 3])
    with pytest.raises(ValueError, match="strictly increasing"):
        partition_from_split_points(10, [3, 3])
    with pytest.raises(ValueError, match="split point 0 is outside 1..9"):
        partition_from_split_points(10, [0, 5])
    with pytest.raises(ValueError, match="split point 10 is outside"):
        partition_from_split_points(10, [5, 10])


def test_stage_ranges():
    assert stage_ranges([0, 3, 7], 10) == [range(0, 3), range(3, 7), range(7, 10)]
    with pytest.raises(ValueError, match="begin with 0"):
        stage_ranges([1, 3], 10)


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmRSS not found")


def test_meta_device_20b_model_partition_without_allocating():
    # ~20B parameters in 256 blocks of two widths; on "meta" only shapes exist.
    before = _rss_bytes()
    d = 2560
    with torch.device("meta"):
        blocks = [
            nn.Sequential(nn.Linear(d, h * d), nn.Linear(h * d, d))
            for h in itertools.islice(itertools.cycle([4, 8]), 256)
        ]
    costs = [count_parameters(b) for b in blocks]
    total = sum(costs)
    assert 19e9 < total < 21e9
    assert all(p.device.type == "meta" for b in blocks for p in b.parameters())

    starts = balanced_partition(costs, 64)
    per_stage = stage_costs(costs, starts)
    mean = total / 64
    assert max(per_stage) <= mean + max(costs)  # optimality bound
    assert max(per_stage) / mean < 1.15 and min(per_stage) / mean > 0.7

    grown = _rss_bytes() - before
    assert grown < 500 * 2**20, f"resident memory grew by {grown / 2**20:.0f} MiB"


def test_count_parameters_counts_shared_once():
    lin = nn.Linear(3, 4)
    assert count_parameters(lin) == 16
    assert count_parameters(nn.Sequential(lin, lin)) == 16
