"""Reading a checkpoint without running code from it: DCP's index through an allow-list unpickler, its other
values with ``torch.load(weights_only=True)``, and errors that name the damaged file."""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.types import _PATH
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from typing_extensions import override

_SAFE_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.planner", "WriteItemType"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # rebuilds a layout from its name
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Reads DCP's ``.metadata`` index allowing only its own plain classes, like ``torch.load(weights_only=True)``."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        if module == "torch.distributed.checkpoint.metadata" or module == "torch.distributed.checkpoint.filesystem":
            # A class DCP adds in a later torch: plain data like the others.
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"The checkpoint index refers to {module}.{name}, which a checkpoint index never contains; the file is "
            "damaged or was not written by torch.distributed.checkpoint. It is not loaded."
        )


class SafeReader(FileSystemReader):
    """A ``FileSystemReader`` that unpickles the index with an allow-list (DCP's own reader uses ``pickle.load``)."""

    @override
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that non-tensor values are read with ``weights_only=True``."""

    @override
    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


def read_index(path: _PATH) -> Metadata:
    """DCP's index of the checkpoint at ``path``, with an error that names the file if it cannot be read."""
    path = Path(path)
    try:
        return SafeReader(path).read_metadata()
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{path} is not a complete checkpoint: its index {path / '.metadata'} is missing. Resume from another "
            "checkpoint; checkpoints are renamed into place only once complete."
        ) from None
    except Exception as error:
        raise RuntimeError(
            f"Could not read the checkpoint {path}: its index {path / '.metadata'} is truncated or corrupt "
            f"({type(error).__name__}: {error}). Resume from another checkpoint."
        ) from error


def check_shard_files(path: _PATH, index: Metadata, keys: Iterable[str] | None = None) -> None:
    """Raise, naming the file, if a shard that holds one of ``keys`` (default: all) is missing or too short."""
    path = Path(path)
    needed: dict[str, int] = {}
    wanted = None if keys is None else set(keys)
    for item, info in index.storage_data.items():
        if wanted is not None and item.fqn not in wanted:
            continue
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, end in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            raise RuntimeError(
                f"The checkpoint {path} is damaged: its shard {file} is missing. Resume from another checkpoint."
            )
        size = file.stat().st_size
        if size < end:
            raise RuntimeError(
                f"The checkpoint {path} is damaged: its shard {file} is truncated ({size} bytes, the index needs "
                f"{end}). Resume from another checkpoint."
            )


def shard_files(index: Metadata, keys: Iterable[str]) -> list[str]:
    """The shard files that hold ``keys``, for error messages."""
    wanted = set(keys)
    return sorted({info.relative_path for item, info in index.storage_data.items() if item.fqn in wanted})


def empty_like_saved(md: Any) -> Any:
    """A tensor to read the saved tensor described by ``md`` into; ``None`` (read as saved) for other values."""
    if isinstance(md, TensorStorageMetadata):
        return torch.empty(tuple(md.size), dtype=md.properties.dtype)
    return None
