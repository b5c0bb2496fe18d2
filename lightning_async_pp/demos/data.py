"""Byte-level text data: contiguous windows of a corpus, split by position into train and validation."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.data import Dataset

from lightning_async_pp.models.data import CorpusDataModule


class ByteWindows(Dataset):
    """Non-overlapping windows of ``block_size + 1`` bytes, returned as ``(input, target)`` shifted by one."""

    def __init__(self, data: Tensor, block_size: int) -> None:
        if len(data) < block_size + 1:
            raise ValueError(
                f"The text has {len(data)} bytes, fewer than block_size + 1 = {block_size + 1}. "
                "Use a larger corpus or a smaller `block_size`."
            )
        self.data = data
        self.block_size = block_size

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        start = index * self.block_size
        chunk = self.data[start : start + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


class TextDataModule(CorpusDataModule):
    """Bytes of a text corpus as next-byte prediction windows.

    The first ``1 - val_fraction`` of the corpus is the training text and the rest the validation text,
    so validation always reads text the model never trained on.

    Args:
        path: A text file or a folder of text files. ``None`` uses the English text that ships with Python.
        block_size: Tokens (bytes) per window; must not exceed the model's ``block_size``.
        batch_size: Windows per batch (split into micro-batches by the pipeline strategy).
        val_fraction: Share of the corpus, taken from its end, used for validation.
        num_workers: DataLoader worker processes.
        seed: Seed of the training shuffle.
    """

    def encode(self, text: bytes) -> Tensor:
        return torch.frombuffer(bytearray(text), dtype=torch.uint8)

    def windows(self, ids: Tensor) -> Dataset:
        return ByteWindows(ids, self.block_size)


def random_token_batches(
    num_batches: int, batch_size: int, block_size: int, vocab_size: int = 256, seed: int = 0
) -> list[tuple[Tensor, Tensor]]:
    """Batches of uniformly random tokens as ``(inputs, targets)`` pairs, the targets shifted by one, from a
    seeded generator: the same batches on every process, for tests and benchmarks that need no text."""
    generator = torch.Generator().manual_seed(seed)
    data = torch.randint(0, vocab_size, (num_batches, batch_size, block_size + 1), generator=generator)
    return [(row[:, :-1].clone(), row[:, 1:].clone()) for row in data]
