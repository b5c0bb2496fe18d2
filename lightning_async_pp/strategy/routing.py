"""Which part of the optimizer each parameter goes to, said once per stage when training starts.

An optimizer that splits its parameters between methods (:class:`~lightning_async_pp.optim.Muon`: Muon
and AdamW) describes its own split with ``describe_routing()`` and ``routing()``; it knows nothing of
stages. This module adds the stage to the line and looks across stages for a Muon part that is empty
everywhere, which means the model trains with AdamW alone.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.optim import Optimizer

log = logging.getLogger("lightning.pytorch.strategies.async_pp")


def _routing_optimizer(optimizer: Optimizer) -> Any | None:
    # DelayCorrected (and wrappers like it) keep the optimizer that routes as `base_optimizer`.
    inner = getattr(optimizer, "base_optimizer", optimizer)
    return inner if callable(getattr(inner, "describe_routing", None)) else None


def report_routing(strategy: Any, optimizers: list[Optimizer]) -> None:
    """Log one line per stage with the routing of each optimizer that describes it, and warn when a Muon
    optimizer has no parameter for its Muon part on any stage.

    A collective when ``strategy.multi_process``: every rank calls it with its stage's optimizers.
    """
    has_muon, muon_tensors = 0, 0
    for optimizer in optimizers:
        routing = _routing_optimizer(optimizer)
        if routing is None:
            continue
        if strategy.multi_process:
            if strategy.replica == 0:
                log.info(
                    f"[rank {strategy.global_rank}] pipeline stage {strategy.stage}/{strategy.num_stages}:"
                    f" {routing.describe_routing()}"
                )
        else:
            log.info(f"optimizer: {routing.describe_routing()}")
        summary = routing.routing()
        has_muon, muon_tensors = has_muon + 1, muon_tensors + summary["muon_tensors"]
    counts = torch.tensor([has_muon, muon_tensors], dtype=torch.float64, device=strategy.root_device)
    if strategy.multi_process:
        counts = strategy.reduce(counts, reduce_op="sum")
    if counts[0] > 0 and counts[1] == 0:
        rank_zero_warn(
            "The Muon optimizer has no parameter in its Muon part on any stage: every parameter went to AdamW,"
            " so this trains with AdamW alone. Muon takes matrices (2-D) and conv kernels; check"
            " `adamw_patterns`, `adamw_modules` and `muon_kernels`, or the routing line logged for each stage."
        )
