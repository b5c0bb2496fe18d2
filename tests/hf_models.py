"""Tiny Hugging Face models, batches and a plain single-device training loop for the adapter tests."""

from __future__ import annotations

import torch

VOCAB = 96

CONFIGS = {
    "llama": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
    ),
    # GPT-2 ties its head to the token embedding; no dropout, so that every path computes the same thing.
    "gpt2": dict(
        n_embd=32,
        n_layer=4,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    ),
    "gpt2_untied": dict(
        n_embd=32,
        n_layer=4,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=False,
    ),
    "mistral": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        sliding_window=8,
    ),
    "qwen2": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=1,
    ),
    "qwen3": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        head_dim=8,
    ),
}


def model_type(family: str) -> str:
    return family.split("_")[0]


def tiny_causal_lm(family: str = "llama", optimizer=None, **kwargs):
    from lightning_async_pp.models import CausalLM

    return CausalLM(
        model_type=model_type(family), config=CONFIGS[family], optimizer=optimizer, lr_schedule="constant", **kwargs
    )


def token_batches(num: int, batch_size: int = 8, seq: int = 16, seed: int = 0, padding: bool = False) -> list[dict]:
    """Random token batches; with ``padding`` some rows start with padding (mask 0, label -100)."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(num):
        ids = torch.randint(0, VOCAB, (batch_size, seq), generator=generator)
        batch = {"input_ids": ids}
        if padding:
            lengths = torch.randint(seq // 2, seq + 1, (batch_size,), generator=generator)
            mask = (torch.arange(seq)[None, :] >= (seq - lengths)[:, None]).long()  # left padding
            batch["attention_mask"] = mask
            batch["labels"] = ids.masked_fill(mask == 0, -100)
        batches.append(batch)
    return batches


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def plain_hf_training(hf_model, batches, microbatches: int, make_optimizer=adamw) -> list[float]:
    """Synchronous training of a ``transformers`` model with its own forward and loss: the 1F1B reference.

    Each batch is cut into ``microbatches`` equal slices whose losses are averaged, as a pipeline step does.
    """
    optimizer = make_optimizer(hf_model.parameters())
    losses = []
    for batch in batches:
        optimizer.zero_grad()
        total = 0.0
        for index in range(microbatches):
            size = batch["input_ids"].shape[0] // microbatches
            part = {k: v[index * size : (index + 1) * size] for k, v in batch.items()}
            part.setdefault("labels", part["input_ids"])
            loss = hf_model(**part).loss
            (loss / microbatches).backward()
            total += float(loss) / microbatches
        optimizer.step()
        losses.append(total)
    return losses
