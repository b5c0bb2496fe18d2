"""A ``transformers`` causal LM's pieces as pipeline layers: ``[Embedding, DecoderLayer 0, ..., Head]``.

Only the hidden states travel between stages. The attention mask and the rotary position tensors are
rebuilt from the micro-batch on each stage (the decoder layers set ``reads_batch = True``), once per stage
and micro-batch (:class:`BatchContext`), as torchtitan does. At a Llama-8B-shaped boundary (batch 1, 4096
tokens, bf16) the hidden states are 32 MiB; sending the padding mask would add 16 MiB (bool, ``T x T``) and
the rotary tables 2 MiB, on every transfer, whereas rebuilding them costs a stage about the time of one
small kernel per micro-batch (``benchmarks/hf_boundary.py`` measures both; docs/user-guide.md section 11).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightning_async_pp.models.hf_structure import attention_types, find_structure


def input_ids(batch: Any) -> Tensor:
    if isinstance(batch, Tensor):
        return batch
    if isinstance(batch, Mapping) and "input_ids" in batch:
        return batch["input_ids"]
    raise TypeError(
        "CausalLM reads batches that are a tensor of token ids or a dict with 'input_ids' (and optionally "
        "'labels', 'attention_mask', 'position_ids'), as TokenizedTextDataModule and Hugging Face collators "
        f"produce; got {type(batch).__name__}. Labels are shifted inside the loss, as in transformers."
    )


def batch_value(batch: Any, key: str) -> Tensor | None:
    return batch.get(key) if isinstance(batch, Mapping) else None


def _position_ids(batch: Any, hidden: Tensor) -> Tensor:
    positions = batch_value(batch, "position_ids")
    if positions is None:
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
    return positions


class Embedding(nn.Module):
    """Token embedding (then the family's declared steps, learned positions, dropout): ids to hidden states."""

    reads_batch = True

    def __init__(
        self,
        embed_tokens: nn.Module,
        wpe: nn.Embedding | None = None,
        drop: nn.Module | None = None,
        steps: nn.Module | None = None,
    ):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.wpe = wpe
        self.drop = drop
        self.steps = steps

    def forward(self, input_ids: Tensor, batch: Any = None) -> Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.steps is not None:
            hidden = self.steps(hidden)
        if self.wpe is not None:
            hidden = hidden + self.wpe(_position_ids(batch, hidden))
        if self.drop is not None:
            hidden = self.drop(hidden)
        return hidden


class BatchContext:
    """The attention masks, positions and rotary tables of the micro-batch a stage is running.

    Built by the stage's first decoder layer that needs them and reused by the others, as ``transformers``
    builds them once per forward. The entry is kept for one micro-batch (matched by identity, shape and
    dtype), so a later forward of another micro-batch, or a recomputation, never sees stale values.
    """

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._values: dict[Any, Any] = {}

    def get(self, layer: DecoderLayer, hidden: Tensor, batch: Any) -> tuple[Any, Tensor, Any]:
        key = (hidden.shape, hidden.dtype, hidden.device, torch.is_grad_enabled())
        if self._key is None or self._key[0] is not batch or self._key[1] != key:
            self._key, self._values = (batch, key), {}
        position_ids = self._values.get("positions")
        if position_ids is None:
            position_ids = self._values["positions"] = _position_ids(batch, hidden)
        kind = layer.attention_type
        if kind not in self._values:
            attention_mask = batch_value(batch, "attention_mask")
            if attention_mask is not None and attention_mask.dim() < 4:
                attention_mask = attention_mask.view(hidden.shape[0], -1)
            # Imported here: lightning_async_pp.models.hf checks that transformers is installed, with a message.
            from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

            make_mask = create_sliding_window_causal_mask if kind == "sliding_attention" else create_causal_mask
            self._values[kind] = make_mask(
                config=layer.config,
                inputs_embeds=hidden,
                attention_mask=attention_mask,
                cache=None,
                position_ids=position_ids,
            )
        rotary = None
        if layer.rotary_emb is not None:
            args = (kind,) if layer.rotary_by_type else ()  # Gemma 3's tables differ for sliding layers
            rotary = self._values.get(("rotary", *args))
            if rotary is None:
                rotary = self._values[("rotary", *args)] = layer.rotary_emb(hidden, position_ids, *args)
        return self._values[kind], position_ids, rotary

    def __deepcopy__(self, memo: dict) -> BatchContext:
        return BatchContext()


class DecoderLayer(nn.Module):
    """One Hugging Face decoder layer; it rebuilds its attention mask and rotary tables from the micro-batch.

    Args:
        layer: The ``transformers`` decoder layer (``LlamaDecoderLayer``, ``GPT2Block``, ...).
        rotary_emb: This layer's own copy of the model's rotary embedding (``None`` for GPT-2).
        config: The model configuration (read by the mask functions).
        attention_type: ``"full_attention"`` or ``"sliding_attention"``.
        context: Shared by the decoder layers of a model, so a stage builds masks and tables once per
            micro-batch.
        rotary_by_type: The rotary embedding takes the attention type (its tables differ per type).
    """

    reads_batch = True

    def __init__(
        self,
        layer: nn.Module,
        rotary_emb: nn.Module | None,
        config: Any,
        attention_type: str,
        context: BatchContext | None = None,
        rotary_by_type: bool = False,
    ) -> None:
        super().__init__()
        self.layer = layer
        self.rotary_emb = rotary_emb
        self.config = config
        self.attention_type = attention_type
        self.context = context if context is not None else BatchContext()
        self.rotary_by_type = rotary_by_type

    def forward(self, hidden: Tensor, batch: Any = None) -> Tensor:
        mask, position_ids, rotary = self.context.get(self, hidden, batch)
        kwargs: dict[str, Any] = {} if rotary is None else {"position_embeddings": rotary}
        out = self.layer(hidden, attention_mask=mask, position_ids=position_ids, **kwargs)
        return out[0] if isinstance(out, tuple) else out


class Head(nn.Module):
    """Final norm, the projection to vocabulary logits, then the family's declared steps (soft-capping, ...)."""

    def __init__(self, norm: nn.Module, lm_head: nn.Linear, steps: nn.Module | None = None) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head
        self.steps = steps

    def forward(self, hidden: Tensor | tuple[Tensor, ...]) -> Tensor | tuple[Tensor, ...]:
        if isinstance(hidden, tuple):  # a mixture of experts' router totals follow the logits (hf_moe)
            return (self._logits(hidden[0]), *hidden[1:])
        return self._logits(hidden)

    def _logits(self, hidden: Tensor) -> Tensor:
        logits = self.lm_head(self.norm(hidden))
        return logits if self.steps is None else self.steps(logits)


def split_layers(model: nn.Module) -> list[nn.Module]:
    """The pipeline layers of a ``transformers`` causal LM (:func:`~.hf_structure.find_structure` finds them)."""
    config, found = model.config, find_structure(model)
    types, context, rotary = attention_types(config), BatchContext(), found.rotary
    decoders = [
        DecoderLayer(block, copy.deepcopy(rotary), config, types[i], context, found.rotary_by_type)
        for i, block in enumerate(found.layers[: config.num_hidden_layers])
    ]
    embedding = Embedding(found.embed_tokens, found.positions, found.dropout, found.embedding_steps)
    return [embedding, *decoders, Head(found.norm, found.lm_head, found.logit_steps)]


__all__ = ["BatchContext", "DecoderLayer", "Embedding", "Head", "batch_value", "input_ids", "split_layers"]
