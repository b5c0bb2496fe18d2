"""Reading a checkpoint without running code from it.

What is trusted, and how each part of a checkpoint directory is read:

* DCP's index ``.metadata`` (a plain pickle that DCP's own reader loads with ``pickle.load``) is unpickled by
  :class:`SafeReader` through an allow-list: the pickle may name only the classes an index holds, by their exact
  module and name (``Metadata``, ``TensorStorageMetadata``, ``BytesStorageMetadata``, ``ChunkStorageMetadata``,
  ``TensorProperties``, ``MetadataIndex``, ``StorageMeta`` and ``_MEM_FORMAT_ENCODING`` of
  ``torch.distributed.checkpoint.metadata``, ``_StorageInfo`` of ``torch.distributed.checkpoint.filesystem``,
  ``torch.Size``, ``collections.OrderedDict``, ``set``, ``frozenset`` and paths, rebuilt as pure paths), torch's
  dtypes and layouts by name, and nothing else: no dotted names, no other functions. Only those classes are
  called, and only their instances get state set, so the only code that unpickling runs is theirs
  (constructors, ``__setstate__``) and torch's look-up of a layout by name. The result must be a ``Metadata``
  whose shard files are plain names inside the checkpoint directory.
* The tensors in the shards are read by DCP with ``torch.load(weights_only=True)``, other values (numbers,
  strings, random generator states) by :class:`SafeLoadPlanner` with ``torch.load(weights_only=True)``.
* ``meta.pt`` (Lightning's loops, callbacks, hyperparameters) is read with ``weights_only=True``.

A file that names anything else is refused with an error that names it, before any of it runs.
"""

from __future__ import annotations

import io
import pickle
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem
import torch.distributed.checkpoint.metadata as dcp_metadata
from lightning.fabric.utilities.types import _PATH
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.serialization import _get_layout
from typing_extensions import override

_INDEX_CLASSES: dict[tuple[str, str], type] = {
    **{
        (dcp_metadata.__name__, name): getattr(dcp_metadata, name)
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
    },
    (dcp_filesystem.__name__, "_StorageInfo"): dcp_filesystem._StorageInfo,
    ("torch", "Size"): torch.Size,
    ("collections", "OrderedDict"): OrderedDict,
    ("builtins", "set"): set,  # sets and frozensets under pickle protocols 2 and 3
    ("builtins", "frozenset"): frozenset,
}
"""The classes DCP's index holds, by the (module, name) a pickle names them with (checked against the installed
torch by the tests: each is a class defined under that name in that module)."""

_PATHS: dict[tuple[str, str], type] = {
    (module, name): PureWindowsPath if "Windows" in name else PurePosixPath
    for module in ("pathlib", "pathlib._local")  # Python 3.13 pickles paths from pathlib._local
    for name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")
}
"""``StorageMeta.checkpoint_id``: a path, rebuilt as a pure path (no file system access, and readable on any OS)."""

_DTYPES: dict[tuple[str, str], torch.dtype] = {
    ("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)
}

_LAYOUT = ("torch.serialization", "_get_layout")
"""How a ``torch.layout`` pickles itself: ``_get_layout("torch.strided")``, a look-up among torch's layouts (the
one function allowed, as ``torch.load(weights_only=True)`` allows it)."""

_CALLABLE = {id(c): c for c in (*_INDEX_CLASSES.values(), *_PATHS.values(), _get_layout)}
"""What the index may call: the constructors of its classes and the layout look-up."""

_STATEFUL = frozenset(_INDEX_CLASSES.values())
"""The classes whose instances may receive state (pickle's ``BUILD``); never a class itself."""


class UnsafeIndexError(pickle.UnpicklingError):
    """The index names something a DCP index never holds; nothing of it was called."""


class _MetadataUnpickler(pickle._Unpickler):  # type: ignore[name-defined]
    """Reads DCP's ``.metadata`` index allowing only its own classes (see the module's docstring).

    Python's pure unpickler, so that besides the names (``find_class``) the calls and state updates can be checked
    too: an allowed class called or given state is the only code the file can reach. Slower than the C one (an
    index of 10,000 entries takes under a second).
    """

    dispatch = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        for allowed in (_INDEX_CLASSES, _PATHS, _DTYPES):
            if key in allowed:
                return allowed[key]
        if key == _LAYOUT:
            return _get_layout
        raise UnsafeIndexError(
            f"refers to {module}.{name}, which is not one of the classes a torch.distributed.checkpoint index holds"
        )

    def _callable(self, obj: Any, what: str) -> Any:
        if _CALLABLE.get(id(obj)) is not obj:
            raise UnsafeIndexError(
                f"{what} {_short(obj)}, which is not a class a torch.distributed.checkpoint index holds"
            )
        return obj

    def _load_reduce(self) -> None:
        args = self.stack.pop()
        self.stack[-1] = self._callable(self.stack[-1], "calls")(*args)

    def _load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self._callable(self.stack.pop(), "creates")
        self.append(cls.__new__(cls, *args))

    def _load_newobj_ex(self) -> None:
        kwargs = self.stack.pop()
        args = self.stack.pop()
        cls = self._callable(self.stack.pop(), "creates")
        self.append(cls.__new__(cls, *args, **kwargs))

    def _instantiate(self, klass: Any, args: Any) -> None:
        self.append(self._callable(klass, "creates")(*args))

    def _load_build(self) -> None:
        target = self.stack[-2]  # under the state
        if type(target) not in _STATEFUL:
            raise UnsafeIndexError(
                f"sets attributes of {_short(target)}, which is not an instance of a class an index holds"
            )
        pickle._Unpickler.load_build(self)  # type: ignore[attr-defined]

    dispatch[pickle.REDUCE[0]] = _load_reduce
    dispatch[pickle.NEWOBJ[0]] = _load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = _load_newobj_ex
    dispatch[pickle.BUILD[0]] = _load_build


def _short(obj: Any) -> str:
    text = repr(obj)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_index(metadata: Any) -> Metadata:
    """``metadata`` if it is an index whose shard files are plain names in the checkpoint directory."""
    if not isinstance(metadata, Metadata):
        raise UnsafeIndexError(f"holds a {type(metadata).__name__}, not a torch.distributed.checkpoint Metadata")
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
            raise UnsafeIndexError(f"names the shard file {name!r}, which is not a file name in the checkpoint")
    return metadata


class SafeReader(FileSystemReader):
    """A ``FileSystemReader`` that unpickles the index with an allow-list (DCP's own reader uses ``pickle.load``).

    Raises:
        UnsafeIndexError: If the index names anything but the classes an index holds (nothing of it is called).
    """

    @override
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"
        with open(path, "rb") as f:
            metadata = _check_index(_MetadataUnpickler(f).load())
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
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
    except UnsafeIndexError as error:
        raise RuntimeError(
            f"Refused to read the checkpoint {path}: its index {path / '.metadata'} {error}. Nothing from it was "
            "run; the file is damaged or crafted. Resume from a checkpoint this strategy wrote."
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
