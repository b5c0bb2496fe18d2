"""Which part of the optimizer each parameter goes to, said once per stage when training starts.

An optimizer that splits its parameters between methods (:class:`~lightning_async_pp.optim.Muon`: Muon
and AdamW) describes its own split with ``describe_routing()`` and ``routing()``; it knows nothing of
stages. This module adds the stage to the line and looks across stages for a Muon part that is empty
everywhere, which means the model trains with AdamW alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer

from lightning_async_pp.strategy.topology import PipelineDims

log = logging.getLogger("lightning.pytorch.strategies.async_pp")


def _routing_optimizer(optimizer: Optimizer) -> Any | None:
    # DelayCorrected (and wrappers like it) keep the optimizer that routes as `base_optimizer`.
    inner = getattr(optimizer, "base_optimizer", optimizer)
    return inner if callable(getattr(inner, "describe_routing", None)) else None


def report_routing(
    optimizers: list[Optimizer],
    device: torch.device,
    dims: PipelineDims,
    rank: int,
    sum_over_ranks: Callable[[Tensor], Tensor],
) -> None:
    """Log one line per stage with the routing of each optimizer that describes it, and warn when a Muon
    optimizer has no parameter for its Muon part on any stage.

    Args:
        optimizers: This stage's optimizers.
        device: Where the counts are summed.
        dims: The job's stages and replicas (one process: one stage, one replica).
        rank: This process's global rank; replica 0 of each stage logs its line.
        sum_over_ranks: Sums the counts across processes (the strategy's ``reduce``): with several processes
            every rank calls this (a collective).
    """
    prefix = "optimizer:"
    if dims.world_size > 1:
        stage = dims.stage_of(rank)
        prefix = f"[rank {rank}] pipeline stage {stage}/{dims.num_stages}:" if dims.replica_of(rank) == 0 else None
    has_muon, muon_tensors = 0, 0
    for optimizer in optimizers:
        routing = _routing_optimizer(optimizer)
        if routing is None:
            continue
        if prefix is not None:
            log.info(f"{prefix} {routing.describe_routing()}")
        summary = routing.routing()
        has_muon, muon_tensors = has_muon + 1, muon_tensors + summary["muon_tensors"]
    counts = torch.tensor([has_muon, muon_tensors], dtype=torch.float64, device=device)
    if dims.world_size > 1:
        counts = sum_over_ranks(counts)
    if counts[0] > 0 and counts[1] == 0:
        rank_zero_warn(
            "The Muon optimizer has no parameter in its Muon part on any stage: every parameter went to AdamW,"
            " so this trains with AdamW alone. Muon takes matrices (2-D) and conv kernels; check"
            " `adamw_patterns`, `adamw_modules` and `muon_kernels`, or the routing line logged for each stage."
        )
