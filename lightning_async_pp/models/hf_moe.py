"""Mixture-of-experts Hugging Face models through the pipeline, with the routers' load-balancing loss, exactly.

Every expert of a layer lives on the stage that owns the layer: a stage runs its mixture-of-experts layers as
``transformers`` does on one device (no expert parallelism).

The load-balancing loss that ``transformers`` adds to the loss with ``output_router_logits=True``
(``load_balancing_loss_func`` of Mixtral, Qwen2-MoE and Qwen3-MoE) is, over the sparse layers ``l`` and the tokens
``t`` that the attention mask keeps, with ``E`` experts and ``R`` rows (tokens times sparse layers)::

    aux = E * sum_e (assigned_e / R) * (probability_e / R)
    assigned_e    = sum_{l,t} [e among the top-k experts of token t in layer l]
    probability_e = sum_{l,t} softmax(router logits of t in layer l)_e

It is the product of two means over *every* layer, not a sum of per-layer terms, so no stage can compute its
layers' share alone. Each sparse decoder layer therefore adds its routers' sums to three small float32 totals that
travel forward with the hidden states, ``(hidden, assigned, probability, rows)``: ``assigned`` carries no gradient,
``probability`` is differentiable, ``rows`` counts the tokens. The last stage turns the totals into the loss and
attaches it to the language-model loss (:func:`~lightning_async_pp.runtime.auxiliary.attach_auxiliary_loss`, with
``router_aux_loss_coef``): its gradient flows back through the differentiable sums, across the stages, into every
router, while the loss the stage returns and logs stays the language-model loss. Each boundary carries ``2E + 1``
floats more.

The statistics are computed only when the configuration asks for the loss (``output_router_logits=True``), as in
``transformers``, whose loss leaves it out otherwise.
"""

from __future__ import annotations

import warnings
from collections.abc import Container, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_async_pp.runtime.auxiliary import attach_auxiliary_loss

SUPPORTED_MOE = ("mixtral", "qwen2_moe", "qwen3_moe")
"""Mixture-of-experts ``model_type`` values the adapter trains (each tested against ``transformers``' own loop)."""

EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")

# Each family's router class (its forward returns the router logits first, as transformers' own OutputRecorder
# reads them), and the names under which `save_pretrained` stores its experts' matrices (transformers keeps them
# stacked in memory and converts on loading): the MoE block, the gate, up and down projections.
_ROUTERS = {"mixtral": "MixtralTopKRouter", "qwen2_moe": "Qwen2MoeTopKRouter", "qwen3_moe": "Qwen3MoeTopKRouter"}
_PER_EXPERT_NAMES = {
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
    "qwen2_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
}


def is_moe(config: Any) -> bool:
    """Whether a ``transformers`` configuration describes a mixture-of-experts model."""
    return any(getattr(config, key, None) for key in EXPERT_KEYS)


def refuse_unsupported_moe(config: Any) -> None:
    """Raise a ``ValueError`` unless the adapter trains this mixture-of-experts configuration exactly."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MOE:
        raise ValueError(
            f"CausalLM trains the mixture-of-experts model types {', '.join(SUPPORTED_MOE)}, not "
            f"model_type={model_type!r}: each family's routing and load-balancing loss is checked against "
            "transformers' own training loop before it is accepted."
        )


class RouterLoss:
    """``transformers``' load-balancing loss, from totals that each sparse layer adds to as the batch passes.

    Args:
        num_experts: Experts per sparse layer.
        top_k: Experts each token is routed to.
        coefficient: ``router_aux_loss_coef``: the loss's weight in the training loss.
    """

    def __init__(self, num_experts: int, top_k: int, coefficient: float) -> None:
        self.num_experts = num_experts
        self.top_k = top_k
        self.coefficient = coefficient

    def add(self, totals: Sequence[Tensor] | None, logits: Tensor, batch: Any) -> tuple[Tensor, Tensor, Tensor]:
        """``totals`` (``None`` before the first sparse layer) with one router's statistics added.

        The operations are ``load_balancing_loss_func``'s, in its order, so that the totals match it bitwise.
        """
        weights = torch.softmax(logits, dim=-1)
        _, selected = torch.topk(weights, self.top_k, dim=-1)
        kept = self._token_weights(batch, weights)
        assigned = torch.zeros(self.num_experts, dtype=torch.float32, device=logits.device).scatter_add_(
            0, selected.reshape(-1), kept.repeat_interleave(self.top_k)
        )
        probability = (weights.float() * kept.unsqueeze(-1)).sum(dim=0)
        rows = kept.sum().reshape(1)
        if totals is None:
            return assigned, probability, rows
        return totals[0] + assigned, totals[1] + probability, totals[2] + rows

    def _token_weights(self, batch: Any, weights: Tensor) -> Tensor:
        mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
        if mask is None:
            return torch.ones(weights.shape[0], dtype=torch.float32, device=weights.device)
        if mask.dim() > 2:
            raise ValueError(
                "The routers' load-balancing loss weighs tokens by a 2D padding mask (batch, tokens), as "
                f"transformers does; this batch's attention_mask has shape {tuple(mask.shape)}. Pass a 2D mask or "
                "set output_router_logits=False."
            )
        return mask.reshape(-1).to(device=weights.device, dtype=torch.float32)

    def __call__(self, totals: Sequence[Tensor]) -> Tensor:
        """The load-balancing loss of the totals of every sparse layer."""
        assigned, probability, rows = totals
        return torch.sum((assigned / rows) * (probability / rows).unsqueeze(0)) * self.num_experts

    def attach(self, loss: Tensor, totals: Sequence[Tensor]) -> Tensor:
        """``loss`` unchanged, with the load-balancing loss's gradient (times the coefficient) attached to it."""
        return attach_auxiliary_loss(loss, self(totals), weight=self.coefficient)


class RoutedDecoderLayer(nn.Module):
    """A decoder layer of a mixture-of-experts model that adds its routers' statistics to the totals.

    It takes and returns the hidden states alone until the first sparse layer, then
    ``(hidden, assigned, probability, rows)``; a dense layer (Qwen2-MoE's ``mlp_only_layers``) hands the totals on.

    Args:
        decoder: The pipeline layer it runs (``hf_layers.DecoderLayer``): its ``transformers`` layer and rotary
            embedding are registered here under the same names, so parameter names are those of a dense model.
        router_type: The name of the router's class; its forward returns the router logits first.
        loss: The loss the totals are for.
    """

    reads_batch = True

    def __init__(self, decoder: nn.Module, router_type: str, loss: RouterLoss) -> None:
        super().__init__()
        self.layer = decoder.layer
        self.rotary_emb = decoder.rotary_emb
        self._decoder = (decoder,)  # not registered: its modules are this module's
        self.router_loss = loss
        self._logits: list[Tensor] = []
        self.sparse = False
        for module in self.layer.modules():
            if type(module).__name__ == router_type:
                # Read from the router's output as transformers' own OutputRecorder does: the decoder layer is run
                # as it is (or compiled), without a copy of its forward.
                module.register_forward_hook(self._record)
                self.sparse = True

    def _record(self, module: nn.Module, args: Any, output: Any) -> None:
        self._logits.append(output[0])

    def forward(self, x: Tensor | tuple[Tensor, ...], batch: Any = None) -> Tensor | tuple[Tensor, ...]:
        hidden, totals = (x, None) if isinstance(x, Tensor) else (x[0], x[1:])
        self._logits = []
        hidden = self._decoder[0](hidden, batch)
        logits, self._logits = self._logits, []
        for layer_logits in logits:
            totals = self.router_loss.add(totals, layer_logits, batch)
        return hidden if totals is None else (hidden, *totals)


def route(layers: list[nn.Module], model: nn.Module) -> tuple[list[nn.Module], RouterLoss | None]:
    """The pipeline layers of a ``transformers`` model, with its decoder layers carrying the routers' statistics
    when its configuration asks for the load-balancing loss, and that loss (``None`` otherwise, and for dense
    models). The head hands the totals on after the logits."""
    config = model.config
    if not is_moe(config):
        return layers, None
    if not getattr(config, "output_router_logits", False):
        warnings.warn(
            f"This {config.model_type} model trains without its routers' load-balancing loss "
            "(output_router_logits=False, transformers' default), so nothing keeps its experts in use: set "
            "output_router_logits=True in the configuration to train it (router_aux_loss_coef weighs it).",
            UserWarning,
            stacklevel=3,
        )
        return layers, None
    num_experts = getattr(config, "num_local_experts", None) or config.num_experts
    loss = RouterLoss(num_experts, config.num_experts_per_tok, float(config.router_aux_loss_coef))
    blocks = {id(block) for block in model.model.layers}
    routed = [
        RoutedDecoderLayer(layer, _ROUTERS[config.model_type], loss)
        if id(getattr(layer, "layer", None)) in blocks
        else layer
        for layer in layers
    ]
    if not any(isinstance(layer, RoutedDecoderLayer) and layer.sparse for layer in routed):
        raise ValueError(
            f"This {config.model_type} configuration has no sparse layer (see decoder_sparse_step and "
            "mlp_only_layers), so there is no load-balancing loss to train: set output_router_logits=False."
        )
    return routed, loss


def stored_slices(name: str, param: Tensor, model_type: str) -> dict[str, Tensor]:
    """The tensors that ``save_pretrained`` stores for a parameter under other names, each mapped to the view of
    ``param`` it fills (``{}`` when it is stored under its own name).

    ``transformers`` keeps a layer's experts stacked (``experts.gate_up_proj``: ``(E, 2I, H)``, gate rows first;
    ``experts.down_proj``: ``(E, H, I)``) and writes them per expert, under Mixtral's older module name
    ``block_sparse_moe`` for its ``mlp``; it converts them on loading. A stage reads only its own layers' tensors.
    """
    names = _PER_EXPERT_NAMES.get(model_type)
    if names is None or ".mlp." not in name:
        return {}
    block, gate, up, down = names
    stored = name.replace(".mlp.", f".{block}.", 1)
    prefix, _, leaf = stored.rpartition(".experts.")
    if leaf == "down_proj" and param.dim() == 3:
        return {f"{prefix}.experts.{e}.{down}.weight": param[e] for e in range(param.shape[0])}
    if leaf == "gate_up_proj" and param.dim() == 3:
        half = param.shape[1] // 2
        slices = {}
        for e in range(param.shape[0]):
            slices[f"{prefix}.experts.{e}.{gate}.weight"] = param[e, :half]
            slices[f"{prefix}.experts.{e}.{up}.weight"] = param[e, half:]
        return slices
    return {} if stored == name else {stored: param}


def stored_elsewhere(checkpoint: Container[str], name: str, param: Tensor, model_type: str) -> dict[str, Tensor]:
    """:func:`stored_slices` when the folder holds every one of them, else ``{}``."""
    slices = stored_slices(name, param, model_type)
    return slices if all(key in checkpoint for key in slices) else {}


__all__ = [
    "SUPPORTED_MOE",
    "RouterLoss",
    "RoutedDecoderLayer",
    "stored_elsewhere",
    "stored_slices",
    "is_moe",
    "refuse_unsupported_moe",
    "route",
]
