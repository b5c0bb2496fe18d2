"""Byte-level text data: contiguous windows of a corpus, split by position into train and validation."""

from __future__ import annotations

from pathlib import Path

import torch
from lightning.pytorch import LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".text")


def builtin_corpus() -> bytes:
    """About 0.5 MB of English: the topic help that ships with every Python (``pydoc_data.topics``)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics)).encode("utf-8")


def read_corpus(path: str | Path) -> bytes:
    """Read one text file, or every text file under a folder (sorted, so the corpus is reproducible)."""
    path = Path(path).expanduser()
    if path.is_file():
        return path.read_bytes()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
        if not files:
            raise FileNotFoundError(f"No text files ({', '.join(TEXT_SUFFIXES)}) found under {path}.")
        return b"\n\n".join(p.read_bytes() for p in files)
    raise FileNotFoundError(
        f"Text corpus {path} does not exist. Set `data.path` to a file or folder, or leave it unset."
    )


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


class EpochShuffle(Sampler[int]):
    """A permutation drawn from ``seed + epoch``: every epoch reproducible on its own, also after a resume."""

    def __init__(self, size: int, seed: int = 0) -> None:
        self.size = size
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        # Drawn lazily, at the first index, after the trainer has set the epoch.
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        yield from torch.randperm(self.size, generator=generator).tolist()

    def __len__(self) -> int:
        return self.size


class TextDataModule(LightningDataModule):
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

    def __init__(
        self,
        path: str | None = None,
        block_size: int = 128,
        batch_size: int = 16,
        val_fraction: float = 0.1,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"`val_fraction` must be between 0 and 1, got {val_fraction}.")
        self.path = path
        self.block_size = block_size
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.num_workers = num_workers
        self.seed = seed
        self.train_set: ByteWindows | None = None
        self.val_set: ByteWindows | None = None

    def setup(self, stage: str | None = None) -> None:
        raw = builtin_corpus() if self.path is None else read_corpus(self.path)
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        split = int(len(data) * (1.0 - self.val_fraction))
        self.train_set = ByteWindows(data[:split], self.block_size)
        self.val_set = ByteWindows(data[split:], self.block_size)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set,
            batch_size=self.batch_size,
            sampler=EpochShuffle(len(self.train_set), self.seed),
            drop_last=True,
            num_workers=self.num_workers,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers)
