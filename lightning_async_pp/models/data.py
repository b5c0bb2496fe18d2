"""Tokenized text as packed sequences for causal LMs, offline: bytes by default, or a local tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor
from torch.utils.data import Dataset

from lightning_async_pp.demos.data import TextDataModule, builtin_corpus, read_corpus


def tokenize(text: bytes, tokenizer: str | None) -> tuple[Tensor, int]:
    """Token ids of ``text`` and the vocabulary size: raw bytes (256) or a local ``transformers`` tokenizer folder."""
    if tokenizer is None:
        return torch.frombuffer(bytearray(text), dtype=torch.uint8).long(), 256
    folder = Path(tokenizer).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(
            f"`tokenizer` must be a local folder written by `tokenizer.save_pretrained`; {folder} does not exist. "
            "Leave it unset for byte-level tokens (vocab_size 256)."
        )
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    ids = tok(text.decode("utf-8", errors="replace"), add_special_tokens=False, return_attention_mask=False)[
        "input_ids"
    ]
    return torch.tensor(ids, dtype=torch.long), len(tok)


class PackedSequences(Dataset):
    """Windows of ``block_size`` tokens that overlap by one, so every next-token pair is predicted once.

    Items are ``{"input_ids": (block_size,)}``; the model shifts the labels itself, as ``transformers`` does.
    """

    def __init__(self, ids: Tensor, block_size: int) -> None:
        if block_size < 2:
            raise ValueError(f"`block_size` must be at least 2, got {block_size}.")
        if len(ids) < block_size:
            raise ValueError(
                f"The text has {len(ids)} tokens, fewer than block_size = {block_size}. Use a larger corpus or a "
                "smaller `block_size`."
            )
        self.ids = ids
        self.block_size = block_size

    def __len__(self) -> int:
        return (len(self.ids) - 1) // (self.block_size - 1)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        start = index * (self.block_size - 1)
        return {"input_ids": self.ids[start : start + self.block_size]}


class TokenizedTextDataModule(TextDataModule):
    """A text corpus as packed token sequences for :class:`~lightning_async_pp.models.CausalLM`.

    Works offline: the default corpus is the English text that ships with Python and the default tokens are
    bytes. The first ``1 - val_fraction`` of the tokens train, the rest validate. Every pipeline stage draws
    the same shuffled order (a permutation of ``seed + epoch``), so the stages of a pipeline see the same
    batches. Batches are ``{"input_ids": (batch_size, block_size)}``.

    Args:
        path: A text file or a folder of text files. ``None`` uses the English text that ships with Python.
        tokenizer: A local folder written by ``tokenizer.save_pretrained``; ``None`` for bytes (256 ids).
            The model's ``vocab_size`` must be at least the tokenizer's.
        block_size: Tokens per sequence.
        batch_size: Sequences per batch (split into micro-batches by the pipeline strategy).
        val_fraction: Share of the tokens, taken from the end, used for validation.
        num_workers: DataLoader worker processes.
        seed: Seed of the training shuffle.
    """

    def __init__(
        self,
        path: str | None = None,
        tokenizer: str | None = None,
        block_size: int = 128,
        batch_size: int = 16,
        val_fraction: float = 0.1,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__(path, block_size, batch_size, val_fraction, num_workers, seed)
        self.tokenizer = tokenizer
        self.vocab_size: int | None = None

    def setup(self, stage: str | None = None) -> None:
        raw = builtin_corpus() if self.path is None else read_corpus(self.path)
        ids, self.vocab_size = tokenize(raw, self.tokenizer)
        self._check_vocab(ids)
        split = int(len(ids) * (1.0 - self.val_fraction))
        self.train_set = PackedSequences(ids[:split], self.block_size)
        self.val_set = PackedSequences(ids[split:], self.block_size)

    def _check_vocab(self, ids: Tensor) -> None:
        model = self.trainer.lightning_module if self.trainer is not None else None
        config = getattr(model, "hf_config", None)
        if config is not None and len(ids) and int(ids.max()) >= config.vocab_size:
            raise ValueError(
                f"The tokens go up to id {int(ids.max())} but the model's vocab_size is {config.vocab_size}. Set the "
                f"model's `config.vocab_size` to at least {self.vocab_size}."
            )
