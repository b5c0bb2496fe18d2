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

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_async_pp.models.hf import DecoderLayer, Head, SafetensorsFolder
from lightning_async_pp.runtime.auxiliary import attach_auxiliary_loss

SUPPORTED_MOE = ("mixtral", "qwen2_moe", "qwen3_moe")
"""Mixture-of-experts ``model_type`` values the adapter trains (each tested against ``transformers``' own loop)."""

EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")

# The names under which `save_pretrained` stores each expert's matrices (transformers keeps them stacked in memory
# and converts on loading): the gate, up and down projections.
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


class RoutedDecoderLayer(DecoderLayer):
    """A decoder layer of a mixture-of-experts model: it adds its routers' statistics to the totals.

    It takes and returns the hidden states alone until the first sparse layer, then
    ``(hidden, assigned, probability, rows)``; a dense layer (Qwen2-MoE's ``mlp_only_layers``) hands the totals on.

    Args:
        decoder: The pipeline layer it replaces.
        router_type: The router's class; its forward returns the router logits at ``index``.
        index: Where the router's output holds the logits.
        loss: The loss the totals are for.
    """

    def __init__(self, decoder: DecoderLayer, router_type: type, index: int, loss: RouterLoss) -> None:
        super().__init__(decoder.layer, decoder.rotary_emb, decoder.config, decoder.attention_type, decoder.context)
        self.router_loss = loss
        self.index = index
        self._logits: list[Tensor] = []
        self.sparse = False
        for module in self.layer.modules():
            if isinstance(module, router_type):
                # Read from the router's output as transformers' own OutputRecorder does: the decoder layer is run
                # as it is (or compiled), without copying its forward.
                module.register_forward_hook(self._record)
                self.sparse = True

    def _record(self, module: nn.Module, args: Any, output: Any) -> None:
        self._logits.append(output[self.index])

    def forward(self, x: Tensor | tuple[Tensor, ...], batch: Any = None) -> Tensor | tuple[Tensor, ...]:
        hidden, totals = (x, None) if isinstance(x, Tensor) else (x[0], x[1:])
        self._logits = []
        hidden = super().forward(hidden, batch)
        logits, self._logits = self._logits, []
        for layer_logits in logits:
            totals = self.router_loss.add(totals, layer_logits, batch)
        return hidden if totals is None else (hidden, *totals)


class RoutedHead(Head):
    """The head of a mixture-of-experts model: logits, followed by the totals it received."""

    def forward(self, x: Tensor | tuple[Tensor, ...]) -> Tensor | tuple[Tensor, ...]:
        if isinstance(x, Tensor):
            return super().forward(x)
        return (super().forward(x[0]), *x[1:])


def route(layers: list[nn.Module], model: nn.Module) -> tuple[list[nn.Module], RouterLoss | None]:
    """The pipeline layers of a ``transformers`` model, with the routers' statistics carried forward when its
    configuration asks for the load-balancing loss, and that loss (``None`` otherwise, and for dense models)."""
    config = model.config
    if not is_moe(config) or not getattr(config, "output_router_logits", False):
        return layers, None
    recorder = type(model)._can_record_outputs["router_logits"]
    num_experts = getattr(config, "num_local_experts", None) or config.num_experts
    loss = RouterLoss(num_experts, config.num_experts_per_tok, float(config.router_aux_loss_coef))
    routed: list[nn.Module] = []
    for layer in layers:
        if isinstance(layer, DecoderLayer):
            layer = RoutedDecoderLayer(layer, recorder.target_class, recorder.index, loss)
        elif isinstance(layer, Head):
            layer = RoutedHead(layer.norm, layer.lm_head)
        routed.append(layer)
    if not any(isinstance(layer, RoutedDecoderLayer) and layer.sparse for layer in routed):
        raise ValueError(
            f"This {config.model_type} configuration has no sparse layer (see decoder_sparse_step and "
            "mlp_only_layers), so there is no load-balancing loss to train: set output_router_logits=False."
        )
    return routed, loss


def expert_slices(name: str, param: Tensor, model_type: str) -> dict[str, Tensor]:
    """The per-expert tensors that ``save_pretrained`` stores for a stacked expert tensor, each mapped to the view
    of ``param`` it fills (``{}`` when ``name`` is not a stacked expert tensor of a supported family).

    ``transformers`` keeps a layer's experts stacked (``experts.gate_up_proj``: ``(E, 2I, H)``, gate rows first;
    ``experts.down_proj``: ``(E, H, I)``) and writes them per expert; a stage reads only its own layers' experts.
    """
    head, _, leaf = name.rpartition(".experts.")
    names = _PER_EXPERT_NAMES.get(model_type)
    if names is None or leaf not in ("gate_up_proj", "down_proj") or param.dim() != 3 or not head.endswith(".mlp"):
        return {}
    block, gate, up, down = names
    prefix = f"{head.removesuffix('.mlp')}.{block}.experts"
    if leaf == "down_proj":
        return {f"{prefix}.{e}.{down}.weight": param[e] for e in range(param.shape[0])}
    half = param.shape[1] // 2
    slices = {}
    for e in range(param.shape[0]):
        slices[f"{prefix}.{e}.{gate}.weight"] = param[e, :half]
        slices[f"{prefix}.{e}.{up}.weight"] = param[e, half:]
    return slices


def stored_expert_slices(
    checkpoint: SafetensorsFolder, name: str, param: Tensor, model_type: str
) -> dict[str, Tensor] | None:
    """:func:`expert_slices` when the folder holds every one of them, else ``None``."""
    slices = expert_slices(name, param, model_type)
    return slices if slices and all(key in checkpoint for key in slices) else None


__all__ = [
    "SUPPORTED_MOE",
    "RouterLoss",
    "RoutedDecoderLayer",
    "RoutedHead",
    "expert_slices",
    "is_moe",
    "refuse_unsupported_moe",
    "route",
]
