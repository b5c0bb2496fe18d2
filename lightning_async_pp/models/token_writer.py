"""Writing token files (:mod:`lightning_async_pp.models.tokens`) from local text, streaming, at constant memory.

    python -m lightning_async_pp tokenize corpus/ --out data/train.bin --tokenizer my-tokenizer/

Sources are text files (``.txt``, ``.md``, ...: one document each) and JSONL files (``.jsonl``: one document per
line, its ``"text"`` field), or folders of them (read in sorted order). Every document is followed by the
tokenizer's end-of-text id. Without a tokenizer the tokens are the UTF-8 bytes (ids 0-255) and end-of-text is
256, a vocabulary of 257. The file appears complete or not at all, its header last.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lightning_async_pp.files import atomic_file
from lightning_async_pp.models.data import TEXT_SUFFIXES, local_tokenizer
from lightning_async_pp.models.token_format import (
    DTYPES,
    FORMAT,
    TokenFileInfo,
    header_path,
    read_header_text,
    smallest_dtype,
)

JSONL_SUFFIXES = (".jsonl",)
BUILTIN = "builtin"
BYTE_EOS = 256
# Text is read and tokenized in pieces of about this many characters, so memory does not grow with a file.
PIECE_CHARS = 1 << 20
LINE_LIMIT = 1 << 28
"""The longest JSONL line read (characters): one document of 256 Mi characters."""


@dataclass
class Encoder:
    """Token ids for pieces of text, and what the header records about them.

    Args:
        encode: Token ids of each piece of a list.
        vocab_size: Ids it can produce.
        eos_token_id: The id written after each document.
        name: The tokenizer folder, ``None`` for bytes.
    """

    encode: Callable[[list[str]], list[Sequence[int]]]
    vocab_size: int
    eos_token_id: int
    name: str | None = None


def byte_encoder() -> Encoder:
    """UTF-8 bytes (ids 0-255), end-of-text 256."""

    def encode(pieces: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(piece.encode("utf-8"), dtype=np.uint8) for piece in pieces]

    return Encoder(encode, BYTE_EOS + 1, BYTE_EOS)


def tokenizer_encoder(folder: str | os.PathLike) -> Encoder:
    """A local ``transformers`` tokenizer folder (written by ``save_pretrained``), read without a network."""
    tokenizer = local_tokenizer(folder, byte_vocab_size=BYTE_EOS + 1)
    if tokenizer.eos_token_id is None:
        raise ValueError(
            f"The tokenizer in {folder} has no end-of-text token (eos_token), which is written between documents. "
            "Set one (`tokenizer.eos_token = ...`, then `save_pretrained`) or use another tokenizer."
        )

    def encode(pieces: list[str]) -> list[list[int]]:
        return tokenizer(pieces, add_special_tokens=False, return_attention_mask=False)["input_ids"]

    return Encoder(encode, len(tokenizer), int(tokenizer.eos_token_id), str(folder))


def source_files(sources: Sequence[str | os.PathLike]) -> list[Path]:
    """The text and JSONL files of ``sources`` (files, or folders searched recursively in sorted order)."""
    suffixes = TEXT_SUFFIXES + JSONL_SUFFIXES
    files: list[Path] = []
    for source in sources:
        path = Path(source).expanduser()
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in suffixes)
            if not found:
                raise FileNotFoundError(f"No text or JSONL files ({', '.join(suffixes)}) found under {path}.")
            files.extend(found)
        else:
            raise FileNotFoundError(f"Source {path} does not exist: give text or JSONL files, or folders of them.")
    return files


def pieces(sources: Sequence[str | os.PathLike] | str) -> Iterator[tuple[str, bool]]:
    """The text of ``sources`` as ``(piece, ends_a_document)``, each piece at most about ``PIECE_CHARS`` long
    (a text file is cut at line ends; a JSONL line is one document, whole)."""
    if sources == BUILTIN:
        from pydoc_data.topics import topics  # the English text that ships with every Python

        for key in sorted(topics):
            yield topics[key], True
        return
    for path in source_files([sources] if isinstance(sources, str | os.PathLike) else sources):
        with open(path, encoding="utf-8", errors="replace") as file:
            if path.suffix.lower() in JSONL_SUFFIXES:
                yield from _jsonl_documents(file, path)
                continue
            buffer: list[str] = []
            size = 0
            for line in file:
                buffer.append(line)
                size += len(line)
                if size >= PIECE_CHARS:
                    yield "".join(buffer), False
                    buffer, size = [], 0
            yield "".join(buffer), True


def _jsonl_documents(file, path: Path) -> Iterator[tuple[str, bool]]:
    for number, line in enumerate(iter(lambda: file.readline(LINE_LIMIT + 1), ""), 1):
        if len(line) > LINE_LIMIT:
            raise ValueError(
                f"{path}:{number} is longer than {LINE_LIMIT:,} characters; split the document over several lines "
                "(JSONL records are read one line at a time)."
            )
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number} is not a JSON object ({error}).") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise ValueError(f'{path}:{number} has no string field "text"; each JSONL line must be {{"text": ...}}.')
        yield record["text"], True


def write_token_file(
    sources: Sequence[str | os.PathLike] | str,
    out: str | os.PathLike,
    tokenizer: str | os.PathLike | None = None,
    dtype: str | None = None,
) -> TokenFileInfo:
    """Tokenize ``sources`` into the token file ``out`` and its header, streaming.

    Args:
        sources: Text or JSONL files or folders (see the module), or ``"builtin"`` for the English text that ships
            with Python (one document per help topic).
        out: The token file to write (``train.bin``); its header goes next to it (``train.json``).
        tokenizer: A local tokenizer folder; ``None`` for bytes.
        dtype: ``"uint16"`` or ``"uint32"``; ``None`` for the smallest that holds the vocabulary.

    Returns:
        The header written.

    Raises:
        ValueError: If ``out`` ends in ``.json`` (its header's name), or it or its header is one of the sources.
        FileExistsError: If a file that is not a token file's header is where the header goes.
    """
    if sources != BUILTIN:
        sources = source_files([sources] if isinstance(sources, str | os.PathLike) else sources)
    _check_out(sources, out)
    encoder = byte_encoder() if tokenizer is None else tokenizer_encoder(tokenizer)
    dtype = dtype or smallest_dtype(encoder.vocab_size)
    if dtype not in DTYPES:
        raise ValueError(f"`dtype` must be one of {sorted(DTYPES)}, got {dtype!r}.")
    limit = int(np.iinfo(DTYPES[dtype]).max)
    if encoder.vocab_size - 1 > limit:
        raise ValueError(f"A vocabulary of {encoder.vocab_size} ids does not fit in {dtype}; use uint32.")
    num_tokens = documents = max_id = 0
    with atomic_file(out) as file:
        for batch in _batches(pieces(sources)):
            ids = encoder.encode([piece for piece, _ in batch])
            for piece_ids, (_, ends) in zip(ids, batch, strict=True):
                array = np.asarray(piece_ids, dtype=np.int64)
                if ends:
                    array = np.append(array, encoder.eos_token_id)
                    documents += 1
                if len(array):
                    max_id = max(max_id, int(array.max()))
                    file.write(array.astype(DTYPES[dtype]).tobytes())
                    num_tokens += len(array)
        if max_id > limit:
            raise ValueError(f"The tokenizer produced id {max_id}, which does not fit in {dtype}; use uint32.")
    info = TokenFileInfo(dtype, num_tokens, encoder.vocab_size, max_id, encoder.eos_token_id, documents, encoder.name)
    info.write(out)
    return info


def _check_out(sources: Sequence[Path] | str, out: str | os.PathLike) -> None:
    """Refuse an ``out`` whose writing would replace something other than a token file and its header.

    Args:
        sources: The source files (:func:`source_files`), or ``"builtin"``.
        out: The token file to write.
    """
    out = Path(out)
    header = header_path(out)
    if out.suffix.lower() == ".json":
        raise ValueError(
            f"The token file cannot be {out}: its header is written next to it under the same name with the suffix "
            f".json, which would replace the tokens. Name the token file e.g. {out.with_suffix('.bin')}."
        )
    for written, what in ((out, "the token file"), (header, "its header")):
        for source in [] if sources == BUILTIN else sources:
            if written.exists() and os.path.samefile(written, source):
                raise ValueError(
                    f"{written} is one of the sources, and writing {what} there would replace it. Write the token "
                    "file elsewhere."
                )
    if header.exists() and not _is_token_header(header):
        raise FileExistsError(
            f"{header} exists and is not the header of a token file; writing the token file {out} would replace it "
            f"with its header. Move {header}, or give the token file another name."
        )


def _is_token_header(path: Path) -> bool:
    try:
        fields = json.loads(read_header_text(path))
    except (OSError, ValueError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return False
    return isinstance(fields, dict) and fields.get("format") == FORMAT


def _batches(stream: Iterator[tuple[str, bool]]) -> Iterator[list[tuple[str, bool]]]:
    # Several pieces per call: a fast tokenizer encodes a list in parallel.
    batch: list[tuple[str, bool]] = []
    size = 0
    for item in stream:
        batch.append(item)
        size += len(item[0])
        if size >= PIECE_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m lightning_async_pp tokenize SOURCE... --out FILE [--tokenizer DIR] [--dtype uint16|uint32]``.

    Args:
        argv: The arguments after ``tokenize``; ``None`` for the process's own.
    """
    parser = argparse.ArgumentParser(
        prog="python -m lightning_async_pp tokenize",
        description="Write a flat token file (nanoGPT's train.bin) and its JSON header from local text or JSONL "
        "files, for lightning_async_pp.models.TokenFileDataModule. Streams: memory does not grow with the input.",
    )
    parser.add_argument(
        "sources",
        nargs="+",
        help="text files (one document each), JSONL files (a 'text' field per line), folders of them, or "
        "'builtin' for the English text that ships with Python",
    )
    parser.add_argument("--out", required=True, help="the token file to write (its header: same name, .json)")
    parser.add_argument("--tokenizer", default=None, help="a local tokenizer folder (default: UTF-8 bytes)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: the smallest that fits")
    args = parser.parse_args(argv)
    sources = BUILTIN if args.sources == [BUILTIN] else args.sources
    info = write_token_file(sources, args.out, tokenizer=args.tokenizer, dtype=args.dtype)
    print(
        f"Wrote {args.out}: {info.num_tokens:,} {info.dtype} tokens, {info.documents:,} documents, vocabulary "
        f"{info.vocab_size:,} (end-of-text {info.eos_token_id}); header {header_path(args.out)}"
    )


if __name__ == "__main__":
    main()
