"""Text corpora as datasets, offline: the text that ships with Python or local files, as bytes or as the tokens
of a local tokenizer, split by position into training and validation text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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


def local_tokenizer(folder: str | Path, byte_vocab_size: int = 256) -> Any:
    """A ``transformers`` tokenizer from a local folder written by ``save_pretrained``, read without a network.

    Args:
        folder: The folder.
        byte_vocab_size: The vocabulary the caller uses without a tokenizer, for the error message.
    """
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(
            f"`tokenizer` must be a local folder written by `tokenizer.save_pretrained`; {folder} does not exist. "
            f"Leave it unset for byte-level tokens (vocab_size {byte_vocab_size})."
        )
    refuse_custom_code(folder / "tokenizer_config.json")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)


def refuse_custom_code(file: Path) -> None:
    """Refuse a ``transformers`` folder whose ``file`` (``config.json``, ``tokenizer_config.json``) names Python
    code of its own (``auto_map``): folders are loaded with ``trust_remote_code=False``, and this says so first.

    Raises:
        ValueError: If ``file`` has an ``auto_map``.
    """
    try:
        fields = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return  # missing or unreadable: transformers' own error names it
    if isinstance(fields, dict) and fields.get("auto_map"):
        raise ValueError(
            f"{file} names Python code of its own (auto_map: {fields['auto_map']}), which lightning_async_pp does "
            "not run: Hugging Face folders are loaded with trust_remote_code=False. Use a model and tokenizer that "
            "transformers implements itself."
        )


def tokenize(text: bytes, tokenizer: str | None) -> tuple[Tensor, int]:
    """Token ids of ``text`` and the vocabulary size: raw bytes (256) or a local ``transformers`` tokenizer folder."""
    if tokenizer is None:
        return torch.frombuffer(bytearray(text), dtype=torch.uint8).long(), 256
    tok = local_tokenizer(tokenizer)
    ids = tok(text.decode("utf-8", errors="replace"), add_special_tokens=False, return_attention_mask=False)[
        "input_ids"
    ]
    return torch.tensor(ids, dtype=torch.long), len(tok)


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


class CorpusDataModule(LightningDataModule):
    """A text corpus cut into training and validation windows; a subclass says how (:meth:`encode`, :meth:`windows`).

    The first ``1 - val_fraction`` of the encoded corpus trains and the rest validates, so validation always
    reads text the model never trained on. Every pipeline stage draws the same shuffled order (a permutation of
    ``seed + epoch``), so the stages of a pipeline see the same batches.

    Args:
        path: A text file or a folder of text files. ``None`` uses the English text that ships with Python.
        block_size: Tokens per window.
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
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None

    def encode(self, text: bytes) -> Tensor:
        """The corpus as a 1-D tensor of token ids."""
        raise NotImplementedError

    def windows(self, ids: Tensor) -> Dataset:
        """The dataset of one part (training or validation) of the encoded corpus."""
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        ids = self.encode(builtin_corpus() if self.path is None else read_corpus(self.path))
        split = int(len(ids) * (1.0 - self.val_fraction))
        self.train_set = self.windows(ids[:split])
        self.val_set = self.windows(ids[split:])

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


class TokenizedTextDataModule(CorpusDataModule):
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

    def encode(self, text: bytes) -> Tensor:
        ids, self.vocab_size = tokenize(text, self.tokenizer)
        self._check_vocab(ids)
        return ids

    def windows(self, ids: Tensor) -> Dataset:
        return PackedSequences(ids, self.block_size)

    def _check_vocab(self, ids: Tensor) -> None:
        model = self.trainer.lightning_module if self.trainer is not None else None
        config = getattr(model, "hf_config", None)
        if config is not None and len(ids) and int(ids.max()) >= config.vocab_size:
            raise ValueError(
                f"The tokens go up to id {int(ids.max())} but the model's vocab_size is {config.vocab_size}. Set the "
                f"model's `config.vocab_size` to at least {self.vocab_size}."
            )
