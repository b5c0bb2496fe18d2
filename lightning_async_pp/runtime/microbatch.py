"""Splitting a batch into equal micro-batches along its first dimension, and walking the tensors of a batch;
:class:`StepMicrobatches`, the micro-batches of a stage's steps."""

from __future__ import annotations

import copy
import dataclasses
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor


def map_tensors(data: Any, fn: Callable[[Tensor], Any]) -> Any:
    """``data`` with every tensor ``t`` in it replaced by ``fn(t)``, visited in order.

    Walks what a batch is made of: mappings (their type kept, ``defaultdict`` with its factory), named tuples,
    lists, tuples and other sequences (not strings), and dataclass instances (a shallow copy with the fields
    that ``__init__`` takes mapped). Anything else is returned as it is.

    Args:
        data: A tensor or a collection of tensors.
        fn: Applied to each tensor.
    """
    if isinstance(data, Tensor):
        return fn(data)
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        result = copy.copy(data)
        for f in dataclasses.fields(data):
            if f.init:
                object.__setattr__(result, f.name, map_tensors(getattr(data, f.name), fn))
        return result
    if isinstance(data, Mapping):
        items = {k: map_tensors(v, fn) for k, v in data.items()}
        return type(data)(data.default_factory, items) if isinstance(data, defaultdict) else type(data)(items)
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # a named tuple
        return type(data)(*(map_tensors(d, fn) for d in data))
    if isinstance(data, Sequence) and not isinstance(data, str):
        return type(data)([map_tensors(d, fn) for d in data])
    return data


def tensors_of(data: Any) -> list[Tensor]:
    """The tensors in ``data``, in the order :func:`map_tensors` visits them."""
    tensors: list[Tensor] = []
    map_tensors(data, tensors.append)
    return tensors


def batch_size_of(batch: Any) -> int:
    sizes = [t.shape[0] for t in tensors_of(batch) if t.dim() > 0]
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
        map_tensors(batch, lambda t, i=i: t[i * step : (i + 1) * step] if t.dim() > 0 else t)
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


class StepMicrobatches:
    """The micro-batches of the steps a stage is running: each step's batches, each cut into ``num_microbatches``,
    what their losses are divided by, and (last stage) their losses; the running step's auxiliary losses.

    A step of gradient accumulation has several batches; each micro-batch's loss is divided by ``accumulation *
    num_microbatches``, by default the step's micro-batches (their mean). Every step of a run has the same count
    (:attr:`per_step`), the schedule's micro-batches per step.
    """

    def __init__(self, num_microbatches: int) -> None:
        self.num_microbatches = num_microbatches
        self.per_step = num_microbatches
        """Micro-batches per step of the current (or last) run."""
        self._microbatches: dict[int, list[Any]] = {}
        self._divisors: dict[int, int] = {}
        self._losses: dict[int, list[Tensor]] = {}
        self.aux: list[Tensor] = []
        """The auxiliary losses of each forward of the running step on this stage."""

    def count(self, batches: Sequence[Any]) -> int:
        """The micro-batches of a step of ``batches``."""
        return len(batches) * self.num_microbatches

    def start(self, step: int, batches: Sequence[Any], accumulation: int | None = None) -> None:
        """Cut ``step``'s batches; each micro-batch's loss is divided by ``accumulation`` (default: the number of
        batches) times ``num_microbatches``."""
        self._divisors[step] = (accumulation or len(batches)) * self.num_microbatches
        self._microbatches[step] = [mb for batch in batches for mb in split_microbatches(batch, self.num_microbatches)]
        self._divisors.pop(step - 3, None)
        self.aux = []  # forwards of a flush are not part of the step

    def __getitem__(self, key: tuple[int, int]) -> Any:
        """Micro-batch ``key[1]`` of step ``key[0]`` (while the step runs)."""
        return self._microbatches[key[0]][key[1]]

    def divisor(self, step: int) -> int:
        """What the losses of ``step``'s micro-batches are divided by."""
        return self._divisors[step]

    def add_loss(self, step: int, loss: Tensor) -> None:
        """The loss of one of ``step``'s micro-batches (last stage)."""
        self._losses.setdefault(step, []).append(loss.detach())

    def losses(self, step: int) -> Tensor:
        """``step``'s micro-batch losses, stacked, once its segment ran (last stage)."""
        return torch.stack(self._losses.pop(step))

    def add_aux(self, total: Tensor | None) -> None:
        """The total auxiliary loss of one forward of the running step (``None``: it attached none)."""
        if total is not None:
            self.aux.append(total)

    def aux_mean(self) -> Tensor | None:
        """The mean of the running step's auxiliary losses (``None`` without any)."""
        return torch.stack(self.aux).mean() if self.aux else None

    def end(self, step: int) -> None:
        """``step``'s segment ran: its forwards are done."""
        del self._microbatches[step]

    def clear(self) -> None:
        """The pipeline drained: no step is in flight."""
        self._divisors.clear()
