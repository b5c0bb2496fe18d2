"""Files that appear complete or not at all: written under a hidden sibling name, then renamed into place."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary sibling of ``path`` to write; renamed to ``path`` when the block ends without an error.

    A reader of ``path`` sees the previous file or the new one, never a partial write. The temporary name is
    hidden (``.{name}.partial``), so that a listing of the folder does not pick it up; after an error it is
    removed.

    Args:
        path: The file to write. Its folder is created if missing.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.partial")
    try:
        yield temporary
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` through :func:`atomic_path`; returns ``path``."""
    with atomic_path(path) as temporary:
        temporary.write_text(text)
    return Path(path)
