"""What an index (DCP's ``.metadata``) may hold, checked exactly after unpickling, and its shard files.

:func:`checked_index` takes what :class:`~lightning_async_pp.checkpoint.safe.SafeReader` unpickled and returns a
new ``Metadata`` built from plain values: exact container types (``dict``, ``list``, ``torch.Size``), every entry a
tensor or a plain value, every tensor's chunks tiling it exactly, every storage entry a plain file name in the
checkpoint with a non-negative integer offset and length and no ``transform_descriptors`` (this strategy never
writes them: they would make DCP decompress a shard), the storage regions of a file disjoint, and a tensor's
bytes within its region. :func:`check_shard_files` then ties the index to the files: each shard a regular file
(no link, no device, no FIFO) at least as long as its regions, so that what the index sizes (the tensors
allocated to read into, a consolidated file) is bounded by the bytes on disk.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import stat
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path, PurePath
from typing import Any

import torch
from lightning.fabric.utilities.types import _PATH
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

MAX_CHUNKS = 64
"""Chunks of one tensor an index may list (this strategy writes one; DCP at most one per saving rank)."""


class UnsafeIndexError(pickle.UnpicklingError):
    """The index holds something a DCP index of this strategy never holds; nothing of it was called or used."""


class DamagedCheckpointError(RuntimeError):
    """A shard file the index names is missing or shorter than the index says."""


def type_name(obj: Any) -> str:
    """How a refusal names a value: by its type only (never its ``repr``, which a crafted value makes huge)."""
    return f"the class {obj.__name__}" if isinstance(obj, type) else f"a {type(obj).__name__}"


def _fields(obj: Any, cls: type) -> dict[str, Any]:
    """The dataclass fields of ``obj`` (exactly a ``cls``), defaults filled in.

    The unpickler gives a dataclass no attribute but its fields, so all of them set means exactly them.
    """
    if type(obj) is not cls:
        raise UnsafeIndexError(f"holds {type_name(obj)} where a {cls.__name__} belongs")
    values = vars(obj)
    names, defaults = _FIELDS[cls]
    if len(values) == len(names) and values.keys() == names:
        return values
    if not values.keys() <= names:
        raise UnsafeIndexError(f"holds a {cls.__name__} with attributes that are not its fields")
    out = {**defaults, **values}
    missing = names - out.keys()
    if missing:
        raise UnsafeIndexError(f"holds a {cls.__name__} without its field {sorted(missing)[0]!r}")
    return out


def _field_defaults(cls: type) -> tuple[frozenset[str], dict[str, Any]]:
    fields = dataclasses.fields(cls)
    defaults = {f.name: f.default for f in fields if f.default is not dataclasses.MISSING}
    defaults.update({f.name: f.default_factory() for f in fields if f.default_factory is not dataclasses.MISSING})
    return frozenset(f.name for f in fields), defaults


_FIELDS = {
    cls: _field_defaults(cls)
    for cls in (
        Metadata,
        TensorStorageMetadata,
        BytesStorageMetadata,
        ChunkStorageMetadata,
        TensorProperties,
        MetadataIndex,
        StorageMeta,
        _StorageInfo,
    )
}
"""Each class's field names and defaults (a default list is shared: only read, never stored)."""


def _mapping(obj: Any, what: str) -> dict:
    if type(obj) not in (dict, OrderedDict):
        raise UnsafeIndexError(f"holds {type_name(obj)} as its {what}, not a dict")
    return obj


def _size(obj: Any, what: str, ndim: int | None = None) -> torch.Size:
    if type(obj) is not torch.Size or min(obj, default=0) < 0 or (ndim is not None and len(obj) != ndim):
        raise UnsafeIndexError(f"holds {type_name(obj)} as the {what}, not a size of non-negative integers")
    return obj


def _properties(obj: Any, fqn: str) -> TensorProperties:
    """Its type only: the unpickler creates ``TensorProperties`` with its defaults and sets them only from the
    5-tuple ``__getstate__`` writes, checked type by type."""
    if type(obj) is not TensorProperties:
        raise UnsafeIndexError(f"holds {type_name(obj)} as the properties of {fqn!r}")
    return obj


def _tensor(obj: Any, fqn: str) -> TensorStorageMetadata:
    """A tensor entry whose chunks tile the tensor exactly: inside it, not overlapping, covering it."""
    f = _fields(obj, TensorStorageMetadata)
    size = _size(f["size"], f"size of {fqn!r}")
    chunks = f["chunks"]
    if type(chunks) is not list or not 1 <= len(chunks) <= MAX_CHUNKS:
        raise UnsafeIndexError(f"lists the chunks of {fqn!r} as {type_name(chunks)}, not 1 to {MAX_CHUNKS} of them")
    for chunk in chunks:
        c = _fields(chunk, ChunkStorageMetadata)
        offsets, sizes = c["offsets"], c["sizes"]
        if sizes == size and type(sizes) is torch.Size and type(offsets) is torch.Size and not any(offsets):
            if len(offsets) == len(size):
                continue  # the whole tensor, as DCP writes it
        _size(offsets, f"chunk offsets of {fqn!r}", len(size))
        _size(sizes, f"chunk sizes of {fqn!r}", len(size))
        if any(o + n > d for o, n, d in zip(offsets, sizes, size)):
            raise UnsafeIndexError(f"has a chunk of {fqn!r} outside the tensor")
    if len(chunks) > 1 and (_overlapping(chunks) or sum(c.sizes.numel() for c in chunks) != size.numel()):
        raise UnsafeIndexError(f"has chunks of {fqn!r} that do not tile the tensor exactly")
    if len(chunks) == 1 and chunks[0].sizes != size:
        raise UnsafeIndexError(f"has chunks of {fqn!r} that do not tile the tensor exactly")
    _properties(f["properties"], fqn)
    return TensorStorageMetadata(f["properties"], size, list(chunks))


def _overlapping(chunks: list[ChunkStorageMetadata]) -> bool:
    def meet(a: ChunkStorageMetadata, b: ChunkStorageMetadata) -> bool:
        return all(
            max(oa, ob) < min(oa + na, ob + nb) for oa, na, ob, nb in zip(a.offsets, a.sizes, b.offsets, b.sizes)
        )

    return any(meet(a, b) for i, a in enumerate(chunks) for b in chunks[i + 1 :])


def _entry(obj: Any, fqn: Any) -> TensorStorageMetadata | BytesStorageMetadata:
    if type(fqn) is not str:
        raise UnsafeIndexError(f"has {type_name(fqn)} as a key, not a name")
    if type(obj) is BytesStorageMetadata:
        _fields(obj, BytesStorageMetadata)
        return obj
    return _tensor(obj, fqn)


def plain_file_name(name: Any) -> bool:
    """Whether ``name`` is a file name (no folder, no ``..``), the only kind of path an index or a weight map
    may give."""
    if type(name) is not str or name in ("", ".", ".."):
        return False
    return "/" not in name and "\\" not in name and "\0" not in name and ":" not in name


def _storage(key: Any, value: Any) -> tuple[str, torch.Size | None]:
    """The name and offset that ``key`` stands for, if it and its storage entry ``value`` are what DCP writes."""
    if type(key) is not MetadataIndex or type(value) is not _StorageInfo:
        raise UnsafeIndexError(f"holds {type_name(key)} and {type_name(value)} as a storage key and entry")
    k, v = vars(key), vars(value)  # the unpickler sets no other attributes than their fields
    fqn, offset, index = k.get("fqn"), k.get("offset"), k.get("index")
    if (
        type(fqn) is not str
        or not (index is None or (type(index) is int and index >= 0))
        or not (offset is None or (type(offset) is torch.Size and min(offset, default=0) >= 0))
    ):
        raise UnsafeIndexError("has a storage key that is not a name, offset and index")
    start, length = v.get("offset"), v.get("length")
    if not plain_file_name(v.get("relative_path")):
        raise UnsafeIndexError("names a shard file that is not a plain file name in the checkpoint")
    if not (type(start) is int and start >= 0 and type(length) is int and length >= 0):
        raise UnsafeIndexError(f"gives {fqn!r} a storage offset or length that is not a non-negative integer")
    if v.get("transform_descriptors") is not None:
        raise UnsafeIndexError(f"gives {fqn!r} storage transforms (compression), which this strategy never writes")
    return fqn, offset


def _check_storage(entries: dict[str, Any], storage: dict[MetadataIndex, _StorageInfo]) -> None:
    """Each entry has its storage regions and nothing else has any; a tensor's bytes fit its region, and the
    regions of a file are disjoint (so that the bytes all tensors need are at most the shard files' sizes)."""
    where = {_storage(key, info): info for key, info in storage.items()}
    if len(where) != len(storage):
        raise UnsafeIndexError("lists a storage entry twice")
    expected = 0
    for fqn, md in entries.items():
        if type(md) is BytesStorageMetadata:
            expected += 1
            if (fqn, None) not in where:
                raise UnsafeIndexError(f"has no storage for {fqn!r}")
            continue
        itemsize = md.properties.dtype.itemsize
        for chunk in md.chunks:
            expected += 1
            info = where.get((fqn, chunk.offsets))
            if info is None:
                raise UnsafeIndexError(f"has no storage for a chunk of {fqn!r}")
            if chunk.sizes.numel() * itemsize > info.length:
                raise UnsafeIndexError(f"gives a chunk of {fqn!r} more bytes than its storage region holds")
    if len(storage) != expected:
        raise UnsafeIndexError("has storage entries for keys it does not list")
    regions = sorted((info.relative_path, info.offset, info.length) for info in storage.values())
    for (file, start, length), (next_file, next_start, _) in zip(regions, regions[1:]):
        if file == next_file and start + length > next_start:
            raise UnsafeIndexError(f"gives overlapping storage regions in {file}")


def _planner_data(obj: Any) -> Any:
    """``None``, or DCP's flattening map: names to paths of names and indices (plain values only)."""
    if obj is None:
        return None
    out = {}
    for key, value in _mapping(obj, "planner data").items():
        if type(key) is not str or type(value) not in (tuple, list) or any(type(p) not in (str, int) for p in value):
            raise UnsafeIndexError("holds planner data that is not a map of names to key paths")
        out[key] = tuple(value)
    return out


def _storage_meta(obj: Any) -> StorageMeta | None:
    if obj is None:
        return None
    f = _fields(obj, StorageMeta)
    text = (f["save_id"], f["load_id"])
    modules = f["modules"]
    if (
        not (f["checkpoint_id"] is None or isinstance(f["checkpoint_id"], (str, PurePath)))
        or any(t is not None and type(t) is not str for t in text)
        or type(modules) is not list
        or any(type(m) is not str for m in modules)
    ):
        raise UnsafeIndexError("holds a StorageMeta whose fields are not paths and names")
    return StorageMeta(f["checkpoint_id"], f["save_id"], f["load_id"], list(modules))


def checked_index(metadata: Any) -> Metadata:
    """A new ``Metadata`` of plain values equal to ``metadata``, if it holds only what an index holds (see the
    module's docstring); raises :class:`UnsafeIndexError` naming what it holds otherwise."""
    if type(metadata) is not Metadata:
        raise UnsafeIndexError(f"holds {type_name(metadata)}, not a torch.distributed.checkpoint Metadata")
    f = _fields(metadata, Metadata)
    entries = {fqn: _entry(md, fqn) for fqn, md in _mapping(f["state_dict_metadata"], "entries").items()}
    storage = dict(_mapping(f["storage_data"], "storage data"))
    _check_storage(entries, storage)
    version = f["version"]
    if version is not None and type(version) is not str:
        raise UnsafeIndexError(f"holds {type_name(version)} as its version")
    return Metadata(entries, _planner_data(f["planner_data"]), storage, _storage_meta(f["storage_meta"]), version)


def regular_file(path: _PATH) -> os.stat_result:
    """``lstat`` of ``path`` if it is a regular file; raises if it is a link, a device, a FIFO or a folder.

    Raises:
        FileNotFoundError: If ``path`` does not exist.
        UnsafeIndexError: If it is anything but a regular file (a checkpoint this strategy wrote holds no other).
    """
    info = os.lstat(path)
    if not stat.S_ISREG(info.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(info.st_mode) else "not a regular file"
        raise UnsafeIndexError(f"has {Path(path).name}, which is {kind}; a checkpoint holds regular files only")
    return info


def open_regular(path: _PATH) -> Any:
    """``path`` opened for reading, refused unless a regular file: never through a link, never blocking on a FIFO
    (checked on the opened file, so that it cannot be swapped between the check and the open)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as error:
        if os.path.islink(path):
            raise UnsafeIndexError(f"has {Path(path).name}, which is a symbolic link") from None
        raise error
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafeIndexError(f"has {Path(path).name}, which is not a regular file")
    return os.fdopen(fd, "rb")


def check_shard_files(path: _PATH, index: Metadata, keys: Iterable[str] | None = None) -> None:
    """Raise, naming the file, if a shard that holds one of ``keys`` (default: all) is missing, too short, or not
    a regular file."""
    path = Path(path)
    needed: dict[str, int] = {}
    wanted = None if keys is None else set(keys)
    for item, info in index.storage_data.items():
        if wanted is not None and item.fqn not in wanted:
            continue
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(needed.items()):
        file = path / name
        try:
            size = regular_file(file).st_size
        except FileNotFoundError:
            raise DamagedCheckpointError(
                f"The checkpoint {path} is damaged: its shard {file} is missing. Resume from another checkpoint."
            ) from None
        if size < end:
            raise DamagedCheckpointError(
                f"The checkpoint {path} is damaged: its shard {file} is truncated ({size} bytes, the index needs "
                f"{end}). Resume from another checkpoint."
            )
