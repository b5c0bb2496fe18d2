"""The model summary of a whole pipeline: one table on rank 0 with every stage's layers, parameters and ranks.

Lightning's ``ModelSummary`` and ``RichModelSummary`` callbacks summarise the module of the process they run in.
Under a multi-stage pipeline that is one stage (rank 0 holds the last one), so they report a fraction of the
model's parameters, and 0 FLOPs, since the cut module cannot run ``example_input_array`` through ``forward``.
:func:`use_pipeline_summary` swaps them for a :class:`PipelineSummary`, which gathers each stage's counts from
replica 0 on rank 0 and prints one table: per stage its layer indices and types, its trainable and total
parameters, their size and the ranks holding it (one per replica), then the whole model's totals.

A weight tied across stages (see :mod:`lightning_async_pp.runtime.ties`) has a copy on each stage that uses it:
each stage's row counts its copy, and the whole model's total counts it once, as
``sum(p.numel() for p in model.parameters())`` of the unsplit model does.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelSummary, RichModelSummary
from lightning.pytorch.utilities.model_summary import get_human_readable_count
from torch import nn
from typing_extensions import override

from lightning_async_pp.runtime.contract import is_pipeline_module
from lightning_async_pp.runtime.ties import Tie

__all__ = [
    "PipelineSummary",
    "PipelineTotals",
    "StageCounts",
    "pipeline_table",
    "pipeline_totals",
    "stage_counts",
    "use_pipeline_summary",
]

log = logging.getLogger("lightning.pytorch.strategies.async_pp")

_HEADER = ("Stage", "Ranks", "Layers", "Types", "Trainable", "Total", "Size (MB)")
_NUMERIC = {"Trainable", "Total", "Size (MB)"}


@dataclass  # plain fields, not frozen: `gather_stages` rebuilds the dataclasses it sends
class StageCounts:
    """What one stage holds, as its rank counts it.

    Attributes:
        stage: The stage's index.
        first_layer: The index of its first pipeline layer (its layers are contiguous).
        types: The class name of each of its layers, in order.
        trainable: Its parameters with ``requires_grad`` (a parameter shared by two of its layers counted once).
        total: All its parameters.
        bytes: Their size.
    """

    stage: int
    first_layer: int
    types: tuple[str, ...]
    trainable: int
    total: int
    bytes: int

    @property
    def layers(self) -> range:
        """The indices of its pipeline layers."""
        return range(self.first_layer, self.first_layer + len(self.types))


def stage_counts(stage: int, indices: range, layers: Sequence[nn.Module]) -> StageCounts:
    """Count the parameters of one stage's layers.

    Args:
        stage: The stage's index.
        indices: The indices of its layers among the model's pipeline layers.
        layers: Its layers, in order (may live on the meta device).
    """
    unique = {id(p): p for layer in layers for p in layer.parameters()}.values()
    return StageCounts(
        stage=stage,
        first_layer=indices.start,
        types=tuple(type(layer).__name__ for layer in layers),
        trainable=sum(p.numel() for p in unique if p.requires_grad),
        total=sum(p.numel() for p in unique),
        bytes=sum(p.numel() * p.element_size() for p in unique),
    )


@dataclass(frozen=True)
class PipelineTotals:
    """The whole model's parameters, each tied weight counted once.

    Attributes:
        trainable: Trainable parameters.
        total: All parameters.
        bytes: Their size.
        tied: How many parameters the stages' rows count more than once (the extra copies of tied weights).
    """

    trainable: int
    total: int
    bytes: int
    tied: int


def pipeline_totals(stages: Sequence[StageCounts], ties: Sequence[Tie]) -> PipelineTotals:
    """Sum the stages' counts, removing the extra copies of the weights tied across stages.

    Args:
        stages: Every stage's counts.
        ties: The weights shared across stages (each owning stage counts its own copy).
    """
    extra = [(math.prod(t.shape) * (len(t.owners) - 1), t) for t in ties]
    tied = sum(n for n, _ in extra)
    itemsize = sum(n * torch.empty((), dtype=t.dtype).element_size() for n, t in extra)
    return PipelineTotals(
        trainable=sum(s.trainable for s in stages) - sum(n for n, t in extra if t.requires_grad),
        total=sum(s.total for s in stages) - tied,
        bytes=sum(s.bytes for s in stages) - itemsize,
        tied=tied,
    )


def _run_lengths(types: Sequence[str]) -> str:
    """``Embedding, 4 x Block, Head``: consecutive layers of one type counted."""
    runs: list[list[Any]] = []
    for name in types:
        if runs and runs[-1][0] == name:
            runs[-1][1] += 1
        else:
            runs.append([name, 1])
    return ", ".join(name if count == 1 else f"{count} x {name}" for name, count in runs)


def _ranks(ranks: Sequence[int]) -> str:
    if len(ranks) <= 4:
        return ", ".join(map(str, ranks))
    return f"{ranks[0]}, {ranks[1]}, ..., {ranks[-1]}"


def _span(layers: range) -> str:
    return str(layers.start) if len(layers) == 1 else f"{layers.start}-{layers[-1]}"


def pipeline_table(
    stages: Sequence[StageCounts], ranks: Sequence[Sequence[int]], ties: Sequence[Tie], title: str = ""
) -> str:
    """The summary's text: one row per stage, then the whole model's totals.

    Args:
        stages: Every stage's counts, in stage order.
        ranks: Per stage, the global ranks holding it (one per replica).
        ties: The weights shared across stages.
        title: A first line (the pipeline's shape).
    """
    rows = [
        (
            str(s.stage),
            _ranks(ranks[s.stage]),
            _span(s.layers),
            _run_lengths(s.types),
            f"{s.trainable:,}",
            f"{s.total:,}",
            f"{s.bytes / 1e6:.2f}",
        )
        for s in stages
    ]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(_HEADER)]

    def line(cells: Sequence[str]) -> str:
        return " | ".join(
            c.rjust(w) if h in _NUMERIC else c.ljust(w) for c, w, h in zip(cells, widths, _HEADER, strict=True)
        ).rstrip()

    rule = "-+-".join("-" * w for w in widths)
    totals = pipeline_totals(stages, ties)
    lines = [title] if title else []
    lines += [line(_HEADER), rule, *map(line, rows), rule]
    lines += [
        f"{get_human_readable_count(totals.trainable):<10} Trainable params ({totals.trainable:,})",
        f"{get_human_readable_count(totals.total - totals.trainable):<10} Non-trainable params "
        f"({totals.total - totals.trainable:,})",
        f"{get_human_readable_count(totals.total):<10} Total params ({totals.total:,})",
        f"{totals.bytes / 1e6:<10.3f} Total estimated model params size (MB)",
    ]
    if ties:
        held = "; ".join(f"{math.prod(t.shape):,} on stages {', '.join(map(str, t.owners))}" for t in ties)
        lines.append(f"Tied weights (each stage's row counts its copy, the totals count it once): {held}")
    return "\n".join(lines)


class PipelineSummary(Callback):
    """Prints :func:`pipeline_table` on rank 0 when ``fit`` starts, in place of Lightning's ``ModelSummary``.

    Every rank calls ``on_fit_start`` (callbacks run on all ranks), which gathers the stages' counts: a
    collective over all ranks, once per ``fit``.

    Args:
        max_depth: 0 turns the summary off, as for Lightning's ``ModelSummary``; any other value prints the
            pipeline's table (one row per stage).
    """

    def __init__(self, max_depth: int = 1) -> None:
        self.max_depth = max_depth

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.max_depth:
            return
        strategy = trainer.strategy
        stage = getattr(strategy, "pipeline_stage", None)  # an AsyncPipelineStrategy's placed stage
        placement = stage.placement if stage is not None else None
        if placement is not None and strategy.multi_process:
            counts = stage_counts(strategy.stage, placement.stage_layers, placement.modules)
            ties = placement.ties
            gathered = strategy.gather_stages(counts)
        else:  # the one-device path: the whole model is one stage
            layers = list(pl_module.pipeline_layers())
            counts = stage_counts(0, range(len(layers)), layers)
            ties, gathered = [], [counts] if trainer.is_global_zero else None
        if gathered is None:
            return
        dims = strategy.dims
        ranks = [dims.replicas(s) for s in range(dims.num_stages)]
        replicas = "" if dims.data_parallel_size == 1 else f" x {dims.data_parallel_size} replicas"
        plural = "s" if dims.num_stages > 1 else ""
        title = f"Pipeline of {dims.num_stages} stage{plural}{replicas}, schedule {strategy.schedule!r}:"
        log.info("\n" + pipeline_table(gathered, ranks, ties, title))


def use_pipeline_summary(trainer: Trainer) -> None:
    """Replace Lightning's ``ModelSummary`` / ``RichModelSummary`` callbacks by :class:`PipelineSummary`.

    Only for a pipeline-ready module (any other module runs on one device, where Lightning's summary is right).
    A user's own subclass of ``ModelSummary`` is left alone. Call before ``on_fit_start``.
    """
    if not is_pipeline_module(trainer.lightning_module):
        return
    for index, callback in enumerate(trainer.callbacks):
        if type(callback) in (ModelSummary, RichModelSummary):
            trainer.callbacks[index] = PipelineSummary(callback._max_depth)
