"""Files that appear complete or not at all: written under a hidden, unique sibling name, then renamed into place."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary sibling of ``path`` to write; renamed to ``path`` when the block ends without an error.

    A reader of ``path`` sees the previous file or the new one, never a partial write, and after a crash the
    renamed file holds the new content: it is flushed to disk before the rename, and the folder after it (where
    the file system allows). The temporary file is created empty, under a name of its own
    (``.{name}.{random}.partial``: hidden, so that a listing of the folder does not pick it up, and unique, so
    that two writers of ``path`` never write into one file); after an error it is removed. Prefer
    :func:`atomic_file`, which writes through the file created rather than reopening it by name.

    Args:
        path: The file to write. Its folder is created if missing.
    """
    with _committed(path) as (temporary, fd):
        os.close(fd)
        yield temporary
        fsync(temporary)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """As :func:`atomic_path`, but the temporary file is given open for writing (binary): it is written through
    the file created, never reopened by name (where something else could have been put meanwhile)."""
    with _committed(path) as (_, fd), os.fdopen(fd, "wb") as file:
        yield file
        file.flush()
        os.fsync(file.fileno())


@contextlib.contextmanager
def _committed(path: str | os.PathLike) -> Iterator[tuple[Path, int]]:
    """A new temporary sibling of ``path`` and its open descriptor; renamed to ``path`` after the block."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.partial")
    # Created exclusively (never an existing file or link), with the permissions of any new file (mkstemp's
    # would be 0600, and the renamed file would keep them).
    fd = os.open(temporary, os.O_CREAT | os.O_EXCL | os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0), 0o666)
    try:
        yield temporary, fd
        os.replace(temporary, path)
        fsync(path.parent)
    finally:
        temporary.unlink(missing_ok=True)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` through :func:`atomic_file`; returns ``path``."""
    with atomic_file(path) as file:
        file.write(text.encode())
    return Path(path)


def fsync(path: str | os.PathLike) -> None:
    """Flush the file or folder ``path`` to disk; nothing where the file system or OS does not allow it."""
    # A rename is durable only with the data and the folder's entry on disk.
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
