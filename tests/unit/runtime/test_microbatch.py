"""Batches walked locally, on torch alone: any structure of tensors is mapped and split into micro-batches
(the runtime's import rule, no Lightning, is checked by tests/unit/test_architecture.py)."""

from __future__ import annotations

import collections
import dataclasses
from typing import NamedTuple

import torch

from lightning_async_pp.runtime.microbatch import map_tensors, split_microbatches, tensors_of


class Pair(NamedTuple):
    x: torch.Tensor
    label: str


@dataclasses.dataclass
class Batch:
    inputs: torch.Tensor
    extras: dict
    name: str = "b"


def test_map_tensors_keeps_the_structure():
    batch = {
        "a": [torch.arange(4), (torch.zeros(4, 2), "text")],
        "p": Pair(torch.ones(4), "keep"),
        "d": Batch(torch.arange(8).view(4, 2), collections.defaultdict(list, {"m": torch.ones(4)})),
        "n": 3,
    }
    out = map_tensors(batch, lambda t: t[:2])
    assert isinstance(out["a"], list) and isinstance(out["a"][1], tuple) and out["a"][1][1] == "text"
    assert isinstance(out["p"], Pair) and out["p"].label == "keep" and out["p"].x.shape == (2,)
    assert isinstance(out["d"], Batch) and out["d"].inputs.shape == (2, 2) and out["d"].name == "b"
    assert isinstance(out["d"].extras, collections.defaultdict) and out["d"].extras.default_factory is list
    assert out["d"].extras["m"].shape == (2,) and out["n"] == 3
    assert batch["d"].inputs.shape == (4, 2)  # the original is left alone
    assert [t.shape[0] for t in tensors_of(batch)] == [4, 4, 4, 4, 4]


def test_split_microbatches_of_a_nested_batch():
    batch = (torch.arange(6), {"y": torch.arange(6) * 10, "scale": torch.tensor(2.0)})
    parts = split_microbatches(batch, 3)
    assert [p[0].tolist() for p in parts] == [[0, 1], [2, 3], [4, 5]]
    assert [p[1]["y"].tolist() for p in parts] == [[0, 10], [20, 30], [40, 50]]
    assert all(p[1]["scale"].item() == 2.0 for p in parts)  # a 0-dim tensor is shared, not split
