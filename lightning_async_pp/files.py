"""Files that appear complete or not at all: written under a hidden, unique sibling name, then renamed into place."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary sibling of ``path`` to write; renamed to ``path`` when the block ends without an error.

    A reader of ``path`` sees the previous file or the new one, never a partial write, and after a crash the
    renamed file holds the new content: it is flushed to disk before the rename, and the folder after it (where
    the file system allows). The temporary file is created empty, under a name of its own
    (``.{name}.{random}.partial``: hidden, so that a listing of the folder does not pick it up, and unique, so
    that two writers of ``path`` never write into one file); after an error it is removed.

    Args:
        path: The file to write. Its folder is created if missing.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.partial")
    # Created exclusively (never an existing file or link), with the permissions of any new file (mkstemp's
    # would be 0600, and the renamed file would keep them).
    os.close(os.open(temporary, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
    try:
        yield temporary
        fsync(temporary)
        os.replace(temporary, path)
        fsync(path.parent)
    finally:
        temporary.unlink(missing_ok=True)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` through :func:`atomic_path`; returns ``path``."""
    with atomic_path(path) as temporary:
        temporary.write_text(text)
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
