"""Mixture-of-experts Hugging Face models through the pipeline, with the routers' terms of the objective, exactly.

A mixture of experts is found by its structure, as dense families are: the modules whose output ``transformers``
records as ``router_logits`` (the model's ``can_record_outputs``: its router of each sparse layer, whatever the
family names it), and the load-balancing loss its causal-LM head adds to ``.loss`` when it has one (the model's
``num_experts``, ``num_experts_per_tok`` and ``router_aux_loss_coef``, or JetMoE's ``aux_loss_coef``). Families
whose ``.loss`` has no router term (DeepSeek-V3, GLM-4-MoE, Hunyuan-MoE: their routers balance by a bias that
training does not learn) train on the language-model loss alone, as in ``transformers``. Whatever was found is
proved when the model is built (:func:`~lightning_async_pp.models.hf_structure.prove_cut`: the pipeline layers'
objective and gradients against ``transformers``' own ``.loss`` on a small copy), so a family whose objective has
another term is refused with what differed.

Every expert of a layer lives on the stage that owns the layer: a stage runs its mixture-of-experts layers as
``transformers`` does on one device (no expert parallelism).

The load-balancing loss (``load_balancing_loss_func``, the same function in every family of ``transformers``
5.24 that has one) is, over the sparse layers ``l`` and the tokens ``t`` that the attention mask keeps, with ``E``
experts and ``R`` rows (tokens times routers)::

    aux = E * sum_e (assigned_e / R) * (probability_e / R)
    assigned_e    = sum_{l,t} [e among the top-k experts of token t in layer l]
    probability_e = sum_{l,t} softmax(router logits of t in layer l)_e

It is the product of two means over *every* layer, not a sum of per-layer terms, so no stage can compute its
layers' share alone. Each sparse decoder layer therefore adds its routers' sums to three small float32 totals that
travel forward with the hidden states, ``(hidden, assigned, probability, rows)``: ``assigned`` carries no gradient,
``probability`` is differentiable, ``rows`` counts the tokens. A stage without a sparse layer hands them on (or,
before the first sparse layer, sends the hidden states alone). The last stage turns the totals into the loss and
attaches it to the language-model loss (:func:`~lightning_async_pp.runtime.auxiliary.attach_auxiliary_loss`, with
the family's coefficient): its gradient flows back through the differentiable sums, across the stages, into every
router, while the loss the stage returns and logs stays the language-model loss. Each boundary carries ``2E + 1``
floats more, and, for every mixture of experts, a table of what each sparse layer's routing did
(:mod:`~lightning_async_pp.models.hf_router_stats`, ``2E + 2`` floats per sparse layer so far), which the last
stage logs.

The load-balancing totals are computed only when the configuration asks for the loss
(``output_router_logits=True``), as in ``transformers``, whose loss leaves it out otherwise.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_async_pp.models.hf_router_stats import layer_row
from lightning_async_pp.runtime.auxiliary import attach_auxiliary_loss

COEFFICIENTS = ("router_aux_loss_coef", "aux_loss_coef")
"""The attributes under which a ``transformers`` causal LM keeps its load-balancing loss's weight."""


def routers(model: nn.Module) -> list[Any]:
    """The ``transformers`` output recorders of a model's router logits (empty for a dense model): each names the
    router's class, the index of the logits in its output and optionally the name the router's module has."""
    recorders = getattr(model, "can_record_outputs", None) or {}
    found = recorders.get("router_logits")
    if found is None:
        return []
    return list(found) if isinstance(found, (list, tuple)) else [found]


def load_balancing(model: nn.Module) -> RouterLoss | None:
    """The load-balancing loss a ``transformers`` causal LM adds to its ``.loss`` (``None`` when it has no
    coefficient for one), from the attributes its forward reads."""
    coefficient = next((getattr(model, name) for name in COEFFICIENTS if hasattr(model, name)), None)
    num_experts, top_k = getattr(model, "num_experts", None), getattr(model, "num_experts_per_tok", None)
    if coefficient is None or not isinstance(num_experts, int) or not isinstance(top_k, int):
        return None
    return RouterLoss(num_experts, top_k, float(coefficient))


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
        """The load-balancing loss of the totals of every sparse layer (what follows them is ignored)."""
        assigned, probability, rows = totals[0], totals[1], totals[2]
        return torch.sum((assigned / rows) * (probability / rows).unsqueeze(0)) * self.num_experts

    def attach(self, loss: Tensor, totals: Sequence[Tensor]) -> Tensor:
        """``loss`` unchanged, with the load-balancing loss's gradient (times the coefficient) attached to it."""
        return attach_auxiliary_loss(loss, self(totals), weight=self.coefficient)


def _recorded(recorder: Any, name: str, module: nn.Module) -> bool:
    """Whether ``transformers`` records ``module`` (named ``name`` in its decoder layer) with ``recorder``."""
    target = getattr(recorder, "target_class", None)
    if target is None or not isinstance(module, target):
        return False
    layer_name = getattr(recorder, "layer_name", None)
    return layer_name is None or f".{layer_name.strip('.')}." in f".{name}."


class RoutedDecoderLayer(nn.Module):
    """A decoder layer of a mixture-of-experts model that adds its routers' statistics to the totals.

    It takes and returns the hidden states alone until the first sparse layer, then
    ``(hidden, assigned, probability, rows, statistics)`` (``(hidden, statistics)`` without a load-balancing loss);
    a dense layer (Qwen2-MoE's ``mlp_only_layers``, DeepSeek-V3's first layers) hands them on. ``statistics`` has
    one row per sparse layer so far (:mod:`~lightning_async_pp.models.hf_router_stats`).

    Args:
        decoder: The pipeline layer it runs (``hf_layers.DecoderLayer``): its ``transformers`` layer and rotary
            embedding are registered here under the same names, so parameter names are those of a dense model.
        recorders: ``transformers``' recorders of the router logits (:func:`routers`).
        loss: The loss the totals are for (``None``: the statistics alone travel).
        top_k: Experts per token, for the statistics of a layer whose experts module does not say which.
    """

    reads_batch = True

    def __init__(self, decoder: nn.Module, recorders: Sequence[Any], loss: RouterLoss | None, top_k: int) -> None:
        super().__init__()
        self.layer = decoder.layer
        self.rotary_emb = decoder.rotary_emb
        self._decoder = (decoder,)  # not registered: its modules are this module's
        self.router_loss = loss
        self.top_k = top_k
        self._logits: list[Tensor] = []
        self._selected: list[Tensor] = []
        self.sparse = False
        for name, module in self.layer.named_modules():
            if name.rpartition(".")[2].endswith("experts"):  # called with the tokens' experts (top_k_index)
                module.register_forward_pre_hook(self._select)
            for recorder in recorders:
                if _recorded(recorder, name, module):
                    # Read from the router's output as transformers' own recorder does: the decoder layer is run
                    # as it is (or compiled), without a copy of its forward.
                    module.register_forward_hook(self._recorder(getattr(recorder, "index", 0)))
                    self.sparse = True

    def _recorder(self, index: int) -> Callable[[nn.Module, Any, Any], None]:
        def record(module: nn.Module, args: Any, output: Any) -> None:
            self._logits.append(output[index] if isinstance(output, tuple) else output)

        return record

    def _select(self, module: nn.Module, args: Any) -> None:
        if len(args) > 1 and isinstance(args[1], Tensor) and not args[1].is_floating_point():
            self._selected.append(args[1].detach())

    def forward(self, x: Tensor | tuple[Tensor, ...], batch: Any = None) -> Tensor | tuple[Tensor, ...]:
        hidden, totals, table = (x, None, None) if isinstance(x, Tensor) else (x[0], x[1:-1] or None, x[-1])
        self._logits, self._selected = [], []
        hidden = self._decoder[0](hidden, batch)
        (logits, self._logits), (selected, self._selected) = (self._logits, []), (self._selected, [])
        for layer_logits in logits if self.router_loss is not None else ():
            totals = self.router_loss.add(totals, layer_logits, batch)
        if logits:
            row = layer_row(logits, selected, batch, self.top_k).unsqueeze(0)
            table = row if table is None else torch.cat([table, row])
        return hidden if table is None else (hidden, *(totals or ()), table)


def route(layers: list[nn.Module], model: nn.Module) -> tuple[list[nn.Module], RouterLoss | None]:
    """The pipeline layers of a ``transformers`` model, with the decoder layers of a mixture of experts carrying
    their routing statistics and, when its objective has a load-balancing loss and its configuration asks for it,
    the loss's totals; and that loss (``None`` otherwise, and for dense models). The head hands them on after the
    logits."""
    config = model.config
    recorders, loss = routers(model), load_balancing(model)
    if not recorders:
        return layers, None
    if loss is not None and not getattr(config, "output_router_logits", False):
        warnings.warn(
            f"This {config.model_type} model trains without its routers' load-balancing loss "
            "(output_router_logits=False, transformers' default), so nothing keeps its experts in use: set "
            "output_router_logits=True in the configuration to train it (router_aux_loss_coef weighs it).",
            UserWarning,
            stacklevel=3,
        )
        loss = None
    blocks = {id(block) for block in model.base_model.get_submodule(_layers_name(model))}
    top_k = getattr(model, "num_experts_per_tok", None) or getattr(config, "num_experts_per_tok", None) or 1
    top_k = max(top_k) if isinstance(top_k, (list, tuple)) else int(top_k)
    routed = [
        RoutedDecoderLayer(layer, recorders, loss, top_k) if id(getattr(layer, "layer", None)) in blocks else layer
        for layer in layers
    ]
    if not any(isinstance(layer, RoutedDecoderLayer) and layer.sparse for layer in routed):
        if loss is None:
            return layers, None
        raise ValueError(
            f"This {config.model_type} configuration has no sparse layer (see decoder_sparse_step, "
            "mlp_only_layers, first_k_dense_replace), so there is no load-balancing loss to train: set "
            "output_router_logits=False."
        )
    return routed, loss


class Objective:
    """A causal LM's training objective on its pipeline layers' output: ``transformers``' loss function on the
    logits and, where the model's layers carry router totals, the load-balancing loss, as its ``.loss`` adds them.

    Args:
        model: The ``transformers`` causal LM (its ``loss_function`` and vocabulary size are used).
        router_loss: The load-balancing loss the layers' totals are for (:func:`route`), or ``None``.
    """

    def __init__(self, model: nn.Module, router_loss: RouterLoss | None) -> None:
        self.loss_function = model.loss_function
        self.vocab_size = model.config.vocab_size
        self.router_loss = router_loss

    def _parts(self, output: Tensor | tuple[Tensor, ...], labels: Tensor) -> tuple[Tensor, Sequence[Tensor] | None]:
        logits, totals = (output, None) if isinstance(output, Tensor) else (output[0], output[1:-1])
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.vocab_size)
        return loss, (totals if self.router_loss is not None and totals else None)

    def __call__(self, output: Tensor | tuple[Tensor, ...], labels: Tensor) -> Tensor:
        """The language-model loss, with the load-balancing loss's gradient (times its coefficient) attached."""
        loss, totals = self._parts(output, labels)
        return loss if totals is None or self.router_loss is None else self.router_loss.attach(loss, totals)

    def value(self, output: Tensor | tuple[Tensor, ...], labels: Tensor) -> Tensor:
        """The whole objective's value: the language-model loss plus the coefficient times the load-balancing loss
        (``transformers``' ``.loss``)."""
        loss, totals = self._parts(output, labels)
        if totals is None or self.router_loss is None:
            return loss
        return loss + self.router_loss.coefficient * self.router_loss(totals)


def _layers_name(model: nn.Module) -> str:
    return next(name for name, child in model.base_model.named_children() if isinstance(child, nn.ModuleList))


__all__ = [
    "COEFFICIENTS",
    "Objective",
    "RouterLoss",
    "RoutedDecoderLayer",
    "load_balancing",
    "route",
    "routers",
]
