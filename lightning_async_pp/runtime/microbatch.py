"""Splitting a batch into equal micro-batches along its first dimension."""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor


def batch_size_of(batch: Any) -> int:
    sizes: list[int] = []
    apply_to_collection(batch, Tensor, lambda t: sizes.append(t.shape[0]) if t.dim() > 0 else None)
    if not sizes:
        raise ValueError("The batch holds no tensor with a batch dimension, so it cannot be split into micro-batches.")
    if len(set(sizes)) != 1:
        raise ValueError(f"The tensors of a batch must share their first (batch) dimension, got sizes {sizes}.")
    return sizes[0]


def split_microbatches(batch: Any, num_microbatches: int) -> list[Any]:
    """Cut every tensor of ``batch`` into ``num_microbatches`` equal slices along dimension 0.

    Raises:
        ValueError: If the batch size is not a multiple of ``num_microbatches``.
    """
    size = batch_size_of(batch)
    if size % num_microbatches != 0:
        raise ValueError(
            f"A batch of {size} samples cannot be split into num_microbatches={num_microbatches} equal "
            "micro-batches. Make the batch size a multiple of `num_microbatches` (and drop the last "
            "incomplete batch, e.g. DataLoader(drop_last=True)), or change `num_microbatches`."
        )
    if num_microbatches == 1:
        return [batch]
    step = size // num_microbatches
    return [
        apply_to_collection(batch, Tensor, lambda t, i=i: t[i * step : (i + 1) * step] if t.dim() > 0 else t)
        for i in range(num_microbatches)
    ]


def auto_num_microbatches(batch_size: int, num_stages: int) -> int:
    """The smallest number of micro-batches that is at least ``num_stages`` and divides ``batch_size``.

    That is the fewest "2bw" allows (one per stage), with equal micro-batches; on one stage it is 1.

    Raises:
        ValueError: If the batch is smaller than the number of stages.
    """
    for count in range(num_stages, batch_size + 1):
        if batch_size % count == 0:
            return count
    raise ValueError(
        f"num_microbatches='auto' needs at least one sample per pipeline stage, got batches of {batch_size} samples "
        f"for {num_stages} stages. Use a batch size that is a multiple of {num_stages}."
    )
