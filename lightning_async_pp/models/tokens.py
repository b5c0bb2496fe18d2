"""Pre-tokenized corpora in flat token files, read through a memory map at constant memory.

A token file is nanoGPT's ``train.bin`` with a JSON header next to it
(:mod:`lightning_async_pp.models.token_format`); :mod:`lightning_async_pp.models.token_writer` writes both.

Training reads random windows: each epoch cuts the file into windows of ``block_size + 1`` tokens at an offset
drawn from ``seed + epoch``, and visits them in an order drawn from the same seed (a keyed permutation computed
index by index, so no list of windows is ever built). Every pipeline stage computes the same order, replicas take
disjoint shares of it, and a resumed epoch starts at the first window it had not trained on without reading
the windows before it.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_async_pp.models.token_format import TokenFileInfo, header_path

BatchFormat = Literal["input_ids", "pairs"]
# The span of file one page table maps (512 pages of 4 KiB); a multiple of any page size.
_FAULT_SPAN = 2 << 20


class TokenWindows(Dataset):
    """Windows of ``block_size + 1`` tokens of a token file, read through a memory map.

    Item ``start`` holds tokens ``[begin + start, begin + start + block_size + 1)`` as ``int64``: with
    ``batch_format="input_ids"`` a dict ``{"input_ids": window}`` (``transformers`` shifts the labels, so
    ``block_size`` tokens are predicted), with ``"pairs"`` the pair ``(window[:-1], window[1:])``.

    The map is opened in the process that reads (each DataLoader worker its own), without read-ahead
    (``MADV_RANDOM``: the windows are scattered), and the pages of each window are dropped from the process once
    copied (``MADV_DONTNEED``; the operating system's page cache keeps them), so resident memory stays flat
    however much of the file an epoch reads.

    Args:
        path: The token file.
        info: Its header.
        block_size: Tokens predicted per window.
        begin: The first token of the part of the file to read (a held-out tail starts later).
        end: One past its last token; ``None`` for the end of the file.
        batch_format: ``"input_ids"`` or ``"pairs"``.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        info: TokenFileInfo,
        block_size: int,
        begin: int = 0,
        end: int | None = None,
        batch_format: BatchFormat = "input_ids",
    ) -> None:
        if batch_format not in ("input_ids", "pairs"):
            raise ValueError(f"`batch_format` must be 'input_ids' or 'pairs', got {batch_format!r}.")
        self.path = Path(path)
        self.info = info
        self.dtype = np.dtype(info.dtype)
        self.block_size = block_size
        self.begin = begin
        self.end = info.num_tokens if end is None else end
        self.batch_format = batch_format
        self._map: mmap.mmap | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens in the part of the file this dataset reads."""
        return self.end - self.begin

    def __len__(self) -> int:
        # Every start at which a whole window fits; samplers pick among them.
        return max(0, self.num_tokens - self.block_size)

    def __getitem__(self, start: int) -> dict[str, Tensor] | tuple[Tensor, Tensor]:
        if not 0 <= start < len(self):
            raise IndexError(f"window start {start} outside [0, {len(self)})")
        window = torch.from_numpy(self.read(self.begin + start, self.block_size + 1))
        if self.batch_format == "pairs":
            return window[:-1], window[1:]
        return {"input_ids": window}

    def read(self, offset: int, count: int) -> np.ndarray:
        """``count`` tokens from token ``offset`` of the file, copied out of the map as ``int64``.

        Raises:
            ValueError: If one is above the header's ``max_token_id``.
        """
        if self._map is None:
            with open(self.path, "rb") as file:
                self._map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
            if hasattr(self._map, "madvise") and hasattr(mmap, "MADV_RANDOM"):
                # Windows are read at random: reading ahead of each would read ~128 KiB from disk per window.
                self._map.madvise(mmap.MADV_RANDOM)
        lo, hi = offset * self.dtype.itemsize, (offset + count) * self.dtype.itemsize
        raw = np.frombuffer(self._map, dtype=self.dtype, count=count, offset=lo)
        # One max over the window, which is being copied anyway: a header that understates the ids stops here,
        # with the file and the offset, not as an index error in the embedding.
        self.info.check_ids(raw, offset, self.path)
        tokens = raw.astype(np.int64)
        if hasattr(self._map, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            # A page fault maps the cached pages around it too ("fault-around", up to the 2 MiB that one page
            # table covers), so drop the whole 2 MiB-aligned span, not only the window's own pages.
            first = lo - lo % _FAULT_SPAN
            self._map.madvise(mmap.MADV_DONTNEED, first, min(hi - hi % -_FAULT_SPAN, len(self._map)) - first)
        return tokens

    def __getstate__(self) -> dict[str, Any]:
        # A DataLoader worker opens its own map; an open one cannot be pickled.
        return {**self.__dict__, "_map": None}


_MASK64 = (1 << 64) - 1


def _mix(value: int) -> int:
    """SplitMix64's finaliser: a 64-bit integer hash whose every output bit depends on every input bit."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


class KeyedPermutation:
    """A pseudo-random permutation of ``range(size)`` computed one index at a time, in constant memory.

    A four-round Feistel network on the smallest even number of bits that holds ``size`` permutes
    ``range(4 ** k) >= size``; indices that land outside ``range(size)`` are encrypted again until they fall
    inside (cycle walking, fewer than four rounds on average), which keeps it a permutation of ``range(size)``.

    Args:
        size: How many indices to permute.
        seed: The key: equal seeds give equal permutations.
    """

    def __init__(self, size: int, seed: int) -> None:
        if size < 1:
            raise ValueError(f"Cannot permute {size} indices.")
        self.size = size
        self.half = max(1, ((size - 1).bit_length() + 1) // 2)
        self.mask = (1 << self.half) - 1
        self.keys = [_mix((seed * 4 + round_) & _MASK64) for round_ in range(4)]

    def __call__(self, index: int) -> int:
        if not 0 <= index < self.size:
            raise IndexError(f"index {index} outside [0, {self.size})")
        while True:
            left, right = index >> self.half, index & self.mask
            for key in self.keys:
                left, right = right, left ^ (_mix(right ^ key) & self.mask)
            index = (left << self.half) | right
            if index < self.size:
                return index


class WindowSampler(DistributedSampler):
    """The window starts one replica reads in an epoch, from ``seed + epoch`` alone.

    ``shuffle=True`` (training): the epoch's offset ``o < block_size`` and the order of the windows
    ``o + k * block_size`` are drawn from ``seed + epoch``; ``shuffle=False`` (validation): the windows at
    ``k * block_size`` in order. Windows overlap by one token, so every next-token pair of the file is predicted
    once per epoch (up to one window lost to the offset). Replica ``r`` of ``D`` takes the epoch's samples
    ``r, r + D, r + 2D, ...``: disjoint windows, the same number on every replica. It is a
    ``DistributedSampler``, so Lightning does not wrap it in another one.

    Args:
        num_tokens: Tokens of the part of the file the windows are cut from.
        block_size: Tokens predicted per window (a window reads ``block_size + 1``).
        num_replicas: Data-parallel replicas ``D``.
        rank: This process's replica.
        shuffle: Random offset and order per epoch (training) or fixed windows in order (validation).
        seed: The epoch's order is drawn from ``seed + epoch``.
        samples_per_epoch: Windows per epoch over all replicas; ``None`` for every window of the file.
    """

    def __init__(
        self,
        num_tokens: int,
        block_size: int,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        samples_per_epoch: int | None = None,
    ) -> None:
        # With any offset below block_size this many windows fit; without an offset, one more may.
        windows = (num_tokens - block_size) // block_size if shuffle else (num_tokens - 1) // block_size
        if windows < 1:
            needed = 2 * block_size if shuffle else block_size + 1
            raise ValueError(
                f"{num_tokens} tokens hold no window of block_size + 1 = {block_size + 1} tokens at every offset "
                f"(at least {needed} are needed). Use a larger token file or a smaller `block_size`."
            )
        if samples_per_epoch is not None and not 0 < samples_per_epoch <= windows:
            raise ValueError(
                f"`samples_per_epoch` must be between 1 and the {windows} windows of block_size + 1 = "
                f"{block_size + 1} tokens the data holds, got {samples_per_epoch}."
            )
        total = samples_per_epoch or windows
        if total < num_replicas:
            raise ValueError(f"{total} windows per epoch cannot be shared by {num_replicas} replicas.")
        super().__init__(range(windows), num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        self.block_size = block_size
        self.windows = windows
        self.num_samples = total // num_replicas
        self.total_size = self.num_samples * num_replicas
        self._skip = 0

    def resume_after(self, samples: int) -> None:
        """Start the next iteration after this replica's first ``samples`` samples (a resumed epoch)."""
        self._skip = samples

    def epoch_offset(self) -> int:
        """The first token of this epoch's first window position."""
        return _mix(_mix(self.seed + self.epoch) ^ 0x0FF5E7) % self.block_size if self.shuffle else 0

    def __iter__(self):
        skip, self._skip = self._skip, 0
        offset = self.epoch_offset()
        order = KeyedPermutation(self.windows, self.seed + self.epoch) if self.shuffle else None
        for sample in range(skip, self.num_samples):
            window = sample * self.num_replicas + self.rank
            yield offset + (order(window) if order is not None else window) * self.block_size

    def __len__(self) -> int:
        return self.num_samples


class TokenFileDataModule(LightningDataModule):
    """Random windows of a flat token file (``uint16`` or ``uint32``, nanoGPT's ``train.bin``) for causal LMs.

    The file is read through a memory map, so memory stays the same whatever its size. Each training epoch
    visits ``samples_per_epoch`` windows (default: all of them, once) in an order drawn from ``seed + epoch``,
    the same on every pipeline stage and disjoint across replicas (:class:`WindowSampler`); a run resumed
    mid-epoch from a checkpoint continues at the next window it had not trained on. Validation reads a
    separate file (``val_path``) or the file's last ``val_fraction`` of tokens, which training never reads.

    Batches are ``{"input_ids": (batch_size, block_size + 1)}`` for
    :class:`~lightning_async_pp.models.CausalLM` (which shifts the labels; its ``max_position_embeddings``
    must be at least ``block_size + 1``) or, with ``batch_format="pairs"``, ``(inputs, targets)`` of
    ``(batch_size, block_size)`` each, shifted by one, as the demo GPT reads.

    Args:
        path: The token file; its header (``train.bin`` -> ``train.json``) must be next to it.
        val_path: A token file to validate on; ``None`` holds out the tail of ``path``.
        val_fraction: Share of ``path``'s tokens, from its end, held out for validation when ``val_path`` is
            ``None``; 0 for no validation.
        block_size: Tokens predicted per window; a window reads ``block_size + 1``.
        batch_size: Windows per batch on each replica (split into micro-batches by the pipeline strategy).
        samples_per_epoch: Windows per training epoch over all replicas; ``None`` for all of them.
        batch_format: ``"input_ids"`` (dicts for ``CausalLM``) or ``"pairs"`` (``(inputs, targets)``).
        source: What :meth:`prepare_data` writes ``path`` from when it is missing: text or JSONL files or
            folders (see :func:`~lightning_async_pp.models.token_writer.write_token_file`), or ``"builtin"``
            for the English text that ships with Python. ``None``: ``path`` must exist.
        tokenizer: With ``source``: a local tokenizer folder (``save_pretrained``); ``None`` for bytes.
        num_workers: DataLoader worker processes.
        seed: Seed of the training order (each epoch's is drawn from ``seed + epoch``).
    """

    def __init__(
        self,
        path: str,
        val_path: str | None = None,
        val_fraction: float = 0.01,
        block_size: int = 128,
        batch_size: int = 16,
        samples_per_epoch: int | None = None,
        batch_format: BatchFormat = "input_ids",
        source: str | list[str] | None = None,
        tokenizer: str | None = None,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"`val_fraction` must be in [0, 1), got {val_fraction}.")
        if block_size < 1:
            raise ValueError(f"`block_size` must be at least 1, got {block_size}.")
        if batch_format not in ("input_ids", "pairs"):
            raise ValueError(f"`batch_format` must be 'input_ids' or 'pairs', got {batch_format!r}.")
        self.path = path
        self.val_path = val_path
        self.val_fraction = val_fraction
        self.block_size = block_size
        self.batch_size = batch_size
        self.samples_per_epoch = samples_per_epoch
        self.batch_format = batch_format
        self.source = source
        self.tokenizer = tokenizer
        self.num_workers = num_workers
        self.seed = seed
        self.info: TokenFileInfo | None = None
        self.train_set: TokenWindows | None = None
        self.val_set: TokenWindows | None = None

    def prepare_data(self) -> None:
        """Write ``path`` from ``source`` if the file or its header is missing (nothing when ``source`` is None)."""
        if self.source is None or (Path(self.path).is_file() and header_path(self.path).is_file()):
            return
        from lightning_async_pp.models.token_writer import write_token_file

        write_token_file(self.source, self.path, tokenizer=self.tokenizer)

    def setup(self, stage: str | None = None) -> None:
        self.info = TokenFileInfo.read(self.path)
        model_vocab, model_positions = self._model_limits()
        self.info.check_vocab(model_vocab, self.path)
        if self.batch_format == "input_ids" and model_positions is not None and self.block_size + 1 > model_positions:
            raise ValueError(
                f"Windows of block_size + 1 = {self.block_size + 1} tokens are longer than the model's "
                f"max_position_embeddings = {model_positions}. Set `block_size` to at most {model_positions - 1} "
                "or raise the model's max_position_embeddings."
            )
        if self.val_path is not None:
            val_info = TokenFileInfo.read(self.val_path)
            val_info.check_vocab(model_vocab, self.val_path)
            split = self.info.num_tokens
            self.val_set = self._windows(self.val_path, val_info)
        else:
            split = self.info.num_tokens - int(self.info.num_tokens * self.val_fraction)
            if self.val_fraction and self.info.num_tokens - split <= self.block_size:
                raise ValueError(
                    f"The validation tail (val_fraction = {self.val_fraction} of {self.info.num_tokens:,} tokens) "
                    f"holds {self.info.num_tokens - split} tokens, fewer than one window of block_size + 1 = "
                    f"{self.block_size + 1}. Raise `val_fraction`, give a `val_path`, or set `val_fraction: 0`."
                )
            self.val_set = self._windows(self.path, self.info, begin=split) if self.val_fraction else None
        self.train_set = self._windows(self.path, self.info, end=split)

    def _windows(self, path: str, info: TokenFileInfo, begin: int = 0, end: int | None = None) -> TokenWindows:
        return TokenWindows(path, info, self.block_size, begin, end, self.batch_format)

    def _model_limits(self) -> tuple[int | None, int | None]:
        # The vocabulary and context length of the model being trained, where it says them.
        model = self.trainer.lightning_module if self.trainer is not None else None
        config = getattr(model, "hf_config", None)
        if config is not None:
            return getattr(config, "vocab_size", None), getattr(config, "max_position_embeddings", None)
        hparams = getattr(model, "hparams", {})
        return hparams.get("vocab_size"), None

    def _sampler(self, data: TokenWindows, shuffle: bool) -> WindowSampler:
        # The strategy's replicas (a pipeline's data-parallel dimension, DDP's processes); none on one device.
        kwargs = (self.trainer.distributed_sampler_kwargs if self.trainer is not None else None) or {}
        return WindowSampler(
            data.num_tokens,
            self.block_size,
            num_replicas=kwargs.get("num_replicas", 1),
            rank=kwargs.get("rank", 0),
            shuffle=shuffle,
            seed=self.seed,
            samples_per_epoch=self.samples_per_epoch if shuffle else None,
        )

    def train_dataloader(self) -> DataLoader:
        sampler = self._sampler(self.train_set, shuffle=True)
        return DataLoader(
            self.train_set, self.batch_size, sampler=sampler, drop_last=True, num_workers=self.num_workers
        )

    def val_dataloader(self) -> DataLoader | list:
        if self.val_set is None:
            return []
        sampler = self._sampler(self.val_set, shuffle=False)
        return DataLoader(self.val_set, self.batch_size, sampler=sampler, num_workers=self.num_workers)
