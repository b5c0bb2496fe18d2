"""What a mixture of experts' routing did, per sparse layer, logged where ``train/loss`` is.

Each sparse decoder layer adds one row to a small float32 table that travels with the hidden states, after the
load-balancing totals where the family trains that loss (:mod:`~lightning_async_pp.models.hf_moe`), so that the
last stage, which logs, holds every layer's row whichever stage ran it::

    [tokens each expert received (E) | router probability per expert (E) | sum of z (1) | tokens (1)]

"Tokens each expert received" counts the experts that the layer's experts module was called with (its
``top_k_index``: the family's own routing, bias and groups included), or, where the experts module does not take
one (JetMoE), the top-k of the router's probabilities; tokens that the attention mask drops are not counted, as
in the load-balancing loss. ``z`` is ``logsumexp(router logits)^2`` per token (the router z-loss, a measure of the
logits' growth). The last stage sums the rows over a step's micro-batches on the device and logs, per sparse layer
``d`` (its decoder index), device tensors that the loggers read when they log (no host sync per step):

- ``moe/layer{d}/max_share``: the most loaded expert's share of the layer's assignments (``1/E`` when balanced,
  1 when every token goes to one expert);
- ``moe/layer{d}/idle_experts``: experts that received no token in the step;
- ``moe/layer{d}/balance_loss``: the layer's own load-balancing term, ``E * sum_e f_e P_e`` (f: share of the
  assignments, P: mean probability), from the tokens the experts received;
- ``moe/layer{d}/z_loss``: the mean of ``z`` over the layer's tokens.

``train/aux_loss`` stays the objective's load-balancing loss over all layers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["RouterStatistics", "layer_row", "token_weights"]


def token_weights(batch: Any, rows: int, device: torch.device) -> Tensor:
    """Each token's weight (1, or 0 where the 2D attention mask drops it), flat, as float32."""
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    if mask is None or mask.dim() != 2:
        return torch.ones(rows, dtype=torch.float32, device=device)
    return mask.reshape(-1).to(device=device, dtype=torch.float32)


@torch.no_grad()
def layer_row(logits: Sequence[Tensor], selected: Sequence[Tensor], batch: Any, top_k: int) -> Tensor:
    """One sparse layer's row: its routers' ``logits`` and the experts ``selected`` per token (``top_k`` of the
    probabilities where nothing was recorded)."""
    experts = logits[0].shape[-1]
    device = logits[0].device
    counts = torch.zeros(experts, dtype=torch.float32, device=device)
    probability = torch.zeros(experts, dtype=torch.float32, device=device)
    z = torch.zeros(1, dtype=torch.float32, device=device)
    tokens = torch.zeros(1, dtype=torch.float32, device=device)
    for router in logits:
        kept = token_weights(batch, router.shape[0], device)
        weights = torch.softmax(router.float(), dim=-1)
        probability += (weights * kept.unsqueeze(-1)).sum(dim=0)
        z += (torch.logsumexp(router.float(), dim=-1).square() * kept).sum()
        tokens += kept.sum()
    chosen = list(selected) or [torch.topk(torch.softmax(r.float(), dim=-1), top_k, dim=-1)[1] for r in logits]
    for indices in chosen:
        indices = indices.reshape(-1, indices.shape[-1])
        kept = token_weights(batch, indices.shape[0], device)
        counts.scatter_add_(0, indices.reshape(-1).long(), kept.repeat_interleave(indices.shape[-1]))
    return torch.cat([counts, probability, z, tokens])


class RouterStatistics:
    """The rows of a step's micro-batches, summed on the device, and the metrics they make.

    Args:
        layers: The decoder index of each sparse layer, in the order of the rows.
    """

    def __init__(self, layers: Sequence[int]) -> None:
        self.layers = list(layers)
        self._sums: Tensor | None = None

    def add(self, rows: Tensor) -> None:
        """Add one micro-batch's table (one row per sparse layer)."""
        rows = rows.detach()
        self._sums = rows.clone() if self._sums is None else self._sums + rows

    def metrics(self) -> dict[str, Tensor]:
        """The step's metrics (empty when no row was added since the last call), and a fresh sum."""
        sums, self._sums = self._sums, None
        if sums is None:
            return {}
        experts = (sums.shape[1] - 2) // 2
        counts, probability = sums[:, :experts], sums[:, experts : 2 * experts]
        z, tokens = sums[:, -2], sums[:, -1].clamp(min=1)
        assigned = counts.sum(dim=1).clamp(min=1)
        share = counts.amax(dim=1) / assigned
        idle = (counts == 0).sum(dim=1).float()
        balance = experts * ((counts / tokens.unsqueeze(1)) * (probability / tokens.unsqueeze(1))).sum(dim=1)
        out: dict[str, Tensor] = {}
        for row, layer in enumerate(self.layers):
            out[f"moe/layer{layer}/max_share"] = share[row]
            out[f"moe/layer{layer}/idle_experts"] = idle[row]
            out[f"moe/layer{layer}/balance_loss"] = balance[row]
            out[f"moe/layer{layer}/z_loss"] = z[row] / tokens[row]
        return out
