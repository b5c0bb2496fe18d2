"""A step's fingerprints in one pass equal the per-micro-batch fingerprints (the reference), and a mismatch names
the first differing micro-batch."""

from __future__ import annotations

import pytest
import torch

from lightning_async_pp.runtime.fingerprint import DataOrderError, FingerprintCheck, fingerprint, step_fingerprints
from lightning_async_pp.runtime.microbatch import split_microbatches


@pytest.mark.parametrize(
    "make, M",
    [
        (lambda: {"ids": torch.randint(0, 9, (8, 5)), "x": torch.randn(8, 3, 9000), "t": torch.tensor(3.0)}, 4),
        (lambda: torch.randn(6, 7).to(torch.bfloat16), 3),
        (lambda: (torch.randn(4, 2, dtype=torch.complex64), torch.ones(4, dtype=torch.bool), torch.randn(4, 0)), 2),
        (lambda: [torch.randn(5, 3)], 1),
    ],
)
def test_step_fingerprints_equal_each_micro_batch_fingerprint(make, M):
    torch.manual_seed(0)
    batch = make()
    expected = torch.stack([fingerprint(mb) for mb in split_microbatches(batch, M)])
    assert torch.equal(step_fingerprints(batch, M), expected)


def test_mismatch_names_the_first_differing_micro_batch():
    torch.manual_seed(0)
    batch = torch.randn(8, 4)
    other = batch.clone()
    other[5] += 1  # micro-batch 2 of 4
    mine, theirs = step_fingerprints(batch, 4), step_fingerprints(other, 4)
    FingerprintCheck(mine, mine.clone(), 3, 1).raise_if_different()
    with pytest.raises(DataOrderError, match="read different data for step 3, micro-batch 2"):
        FingerprintCheck(mine, theirs, 3, 1).raise_if_different()
