"""The token file format: a flat array of ``uint16`` or ``uint32`` ids and a JSON header that describes it.

A token file is nanoGPT's ``train.bin``: the token ids of every document one after the other, with an end-of-text
id after each document, and nothing else. The header next to it (``train.bin`` -> ``train.json``) records its
dtype, token count and vocabulary, so that a file that was cut short, is read with the wrong dtype, or holds ids
the model has no embedding for, is refused on load with a message that says what to do.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from lightning_async_pp.files import atomic_write_text

FORMAT = "lightning_async_pp.tokens"
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def header_path(path: str | os.PathLike) -> Path:
    """The JSON header of a token file: the same name with the suffix ``.json`` (``train.bin`` -> ``train.json``)."""
    return Path(path).with_suffix(".json")


def smallest_dtype(vocab_size: int) -> str:
    """``"uint16"`` for vocabularies up to 65,536 ids, ``"uint32"`` above."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


HEADER_LIMIT = 1 << 20
"""The most bytes of a token file's header read (one is a few hundred bytes)."""


def read_header_text(header: Path) -> str:
    """The text of the header file ``header``, at most :data:`HEADER_LIMIT` bytes of it.

    Raises:
        ValueError: If it is longer: not a header this package wrote.
    """
    with open(header, "rb") as file:
        data = file.read(HEADER_LIMIT + 1)
    if len(data) > HEADER_LIMIT:
        raise ValueError(f"{header} is larger than {HEADER_LIMIT} bytes: not the header of a token file.")
    return data.decode("utf-8")


@dataclass(frozen=True)
class TokenFileInfo:
    """What the header of a token file says about it.

    Args:
        dtype: ``"uint16"`` or ``"uint32"``.
        num_tokens: Tokens in the file; its size is ``num_tokens`` times the dtype's size.
        vocab_size: Ids the tokenizer can produce (the model's ``vocab_size`` must be at least this).
        max_token_id: The largest id in the file.
        eos_token_id: The id written after every document, ``None`` if none was.
        documents: Documents written.
        tokenizer: The tokenizer folder the file was written with; ``None`` for bytes.
    """

    dtype: str
    num_tokens: int
    vocab_size: int
    max_token_id: int
    eos_token_id: int | None = None
    documents: int = 0
    tokenizer: str | None = None

    def write(self, path: str | os.PathLike) -> Path:
        """Write this header next to the token file ``path`` (atomically); returns the header's path."""
        return atomic_write_text(header_path(path), json.dumps({"format": FORMAT, **asdict(self)}, indent=2) + "\n")

    @classmethod
    def read(cls, path: str | os.PathLike) -> TokenFileInfo:
        """Read and check the header of the token file ``path`` against the file itself.

        Raises:
            FileNotFoundError: The token file or its header is missing.
            ValueError: The header is not one of a token file, names another dtype, or the file's size is not
                ``num_tokens`` tokens of that dtype (a truncated or foreign file).
        """
        path = Path(path)
        write_one = f"Write one with `python -m lightning_async_pp tokenize SOURCE... --out {path}`."
        if not path.is_file():
            raise FileNotFoundError(f"Token file {path} does not exist. {write_one}")
        header = header_path(path)
        if not header.is_file():
            raise FileNotFoundError(
                f"Token file {path} has no header {header} (its dtype and token count). {write_one} A file that "
                "has no header may be a partial write."
            )
        try:
            fields = json.loads(read_header_text(header))
        except json.JSONDecodeError as error:
            raise ValueError(f"{header} is not valid JSON ({error}). {write_one}") from None
        if not isinstance(fields, dict) or fields.pop("format", None) != FORMAT:
            raise ValueError(f'{header} is not the header of a token file (no "format": "{FORMAT}"). {write_one}')
        try:
            info = cls(**fields)
        except TypeError as error:
            raise ValueError(f"{header} has unexpected fields ({error}). {write_one}") from None
        if info.dtype not in DTYPES:
            raise ValueError(f"{header} gives dtype {info.dtype!r}; token files are one of {sorted(DTYPES)}.")
        itemsize = np.dtype(info.dtype).itemsize
        size = path.stat().st_size
        if size != info.num_tokens * itemsize:
            raise ValueError(
                f"Token file {path} holds {size:,} bytes, but its header gives {info.num_tokens:,} {info.dtype} tokens "
                f"({info.num_tokens * itemsize:,} bytes): the file was cut short, is still being written, or belongs "
                f"to another header. {write_one}"
            )
        return info

    def check_vocab(self, model_vocab_size: int | None, path: str | os.PathLike) -> None:
        """Refuse a file whose ids reach past the model's embedding (``model_vocab_size``; ``None``: unknown)."""
        if model_vocab_size is None:
            return
        needed = max(self.vocab_size, self.max_token_id + 1)
        if needed > model_vocab_size:
            raise ValueError(
                f"Token file {path} was written with a vocabulary of {self.vocab_size} ids (largest id "
                f"{self.max_token_id}), but the model's vocab_size is {model_vocab_size}. Set the model's "
                f"vocab_size to at least {needed}, or write the file with the model's tokenizer."
            )

    def check_ids(self, tokens: np.ndarray, offset: int, path: str | os.PathLike) -> None:
        """Refuse ``tokens``, read from token ``offset`` of the file ``path``, if one is above ``max_token_id``.

        The header's vocabulary is what :meth:`check_vocab` holds against the model's; an id past it would reach
        past the embedding (an ``IndexError``, a device-side assert on CUDA) steps into training.
        """
        if not len(tokens) or int(tokens.max()) <= self.max_token_id:
            return
        first = int(np.flatnonzero(tokens > self.max_token_id)[0])
        raise ValueError(
            f"Token file {path} holds id {int(tokens[first]):,} at token {offset + first:,}, above the largest id "
            f"its header {header_path(path)} gives (max_token_id {self.max_token_id:,}, vocab_size "
            f"{self.vocab_size:,}): the header belongs to another file or was edited. Write both again with "
            f"`python -m lightning_async_pp tokenize SOURCE... --out {path}`."
        )
