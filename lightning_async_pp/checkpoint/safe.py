"""Reading a checkpoint as this strategy wrote it: no code run, no file outside it, no process-wide state.

What is trusted, and how each part of a checkpoint directory is read:

* DCP's index ``.metadata`` (a plain pickle that DCP's own reader loads with ``pickle.load``) must be a regular
  file (not a link, device or FIFO) of at most :data:`MAX_INDEX_BYTES`. :class:`SafeReader` unpickles it through
  an allow-list: the pickle may name only the classes an index holds, by their exact module and name
  (``Metadata``, ``TensorStorageMetadata``, ``BytesStorageMetadata``, ``ChunkStorageMetadata``,
  ``TensorProperties``, ``MetadataIndex``, ``StorageMeta`` and ``_MEM_FORMAT_ENCODING`` of
  ``torch.distributed.checkpoint.metadata``, ``_StorageInfo`` of ``torch.distributed.checkpoint.filesystem``,
  ``torch.Size``, ``collections.OrderedDict``, ``set``, ``frozenset`` and paths, rebuilt as pure paths), torch's
  dtypes and layouts by name, and nothing else: no dotted names, no other functions, no copyreg extension codes.
  Only those classes are called, each with arguments of the types it takes; only the index's dataclasses get
  state set, and only their own fields (never an enum member, which the whole process shares, a set or a size);
  items go only into lists, sets (of plain values) and dicts (keyed by names and storage keys). The only code
  that unpickling runs is theirs (constructors, ``TensorProperties.__setstate__``) and torch's look-up of a
  layout by name, and its cost is bounded by the file's size.
* The result is checked and rebuilt from plain values by
  :func:`~lightning_async_pp.checkpoint.index_check.checked_index` (exact types, chunks that tile each tensor,
  storage entries that are plain file names with disjoint regions big enough for their tensors, no
  compression), and its shard files must be regular files at least as long as the index says
  (:func:`~lightning_async_pp.checkpoint.index_check.check_shard_files`). The tensors read into are allocated
  as zeros, of the index's sizes: at most the bytes of the shard files.
* The tensors in the shards are read by DCP with ``torch.load(weights_only=True)``, other values (numbers,
  strings, random generator states) by :class:`SafeLoadPlanner` with ``torch.load(weights_only=True)``; shard
  files are opened only as regular files, never through a link.
* ``meta.pt`` (Lightning's loops, callbacks, hyperparameters) must be a regular file and is read with
  ``weights_only=True``.

A file that holds anything else is refused with an error that names its type, before any of it is used.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import pickle
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem
import torch.distributed.checkpoint.metadata as dcp_metadata
from lightning.fabric.utilities.types import _PATH
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata
from torch.serialization import _get_layout
from typing_extensions import override

from lightning_async_pp.checkpoint.index_check import (
    DamagedCheckpointError,
    UnsafeIndexError,
    check_shard_files,
    checked_index,
    open_regular,
    regular_file,
    type_name,
)

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

_SCALARS = (str, int, float, bool, type(None), bytes)
"""What a set may hold (hashing anything else may cost time exponential in its size)."""

_DATACLASSES = frozenset({Metadata, *(c for c in _INDEX_CLASSES.values() if dataclasses.is_dataclass(c))})
"""The dataclasses whose instances receive their fields as state (pickle's ``BUILD``); ``TensorProperties``
receives its 5-tuple. Never an enum member (a singleton shared by the process), a set, a size or a class."""

MAX_INDEX_BYTES = 256 * 2**20
"""The largest ``.metadata`` read (an index of a 10B-parameter model is a few MB)."""


_MEM_FORMAT = _INDEX_CLASSES[(dcp_metadata.__name__, "_MEM_FORMAT_ENCODING")]


class _Done(Exception):
    """The end of the pickle (``STOP``), carrying what it built."""

    def __init__(self, value: Any) -> None:
        super().__init__()
        self.value = value


class _MetadataUnpickler(pickle._Unpickler):  # type: ignore[name-defined]
    """Reads DCP's ``.metadata`` allowing only its own classes (see the module's docstring).

    Python's pure unpickler, so that besides the names (``find_class``) every call, state update and insertion
    can be checked: only an allowed class is called (with arguments of the types it takes), only the index's
    dataclasses get state (their own fields), items go only into lists, sets and dicts, and dict keys are names
    or storage keys (hashed only once checked). Refusals name types, never values.
    """

    dispatch = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self._data = data

    def load(self) -> Any:
        """The object the pickle ``data`` holds. Read from memory directly: ``FRAME`` opcodes, which only say how
        much a file reader may read ahead, are skipped (about a third of the pure unpickler's time)."""
        data = io.BytesIO(self._data)
        self.read, self.readinto, self.readline = data.read, data.readinto, data.readline
        self.metastack: list = []
        self.stack: list = []
        self.append = self.stack.append
        self.proto = 0
        read, dispatch = self.read, self.dispatch
        try:
            while True:
                key = read(1)
                if not key:
                    raise EOFError
                dispatch[key[0]](self)
        except _Done as done:
            return done.value

    def _load_stop(self) -> None:
        raise _Done(self.stack.pop())

    def _load_frame(self) -> None:
        if len(self.read(8)) != 8:
            raise EOFError

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        for allowed in (_INDEX_CLASSES, _PATHS, _DTYPES):
            if key in allowed:
                return allowed[key]
        if key == _LAYOUT:
            return _get_layout
        raise UnsafeIndexError(
            f"refers to {module[:100]}.{name[:100]}, which is not one of the classes a torch.distributed.checkpoint "
            "index holds"
        )

    def _call(self, function: Any, args: Any) -> Any:
        check = _ARGUMENTS.get(id(function))
        if check is None or check[0] is not function or type(args) is not tuple:
            raise UnsafeIndexError(
                f"calls {type_name(function)}, which is not a class a torch.distributed.checkpoint index holds"
            )
        if not check[1](args):
            raise UnsafeIndexError(f"calls {function.__name__} with arguments it never takes")
        return function(*args)

    def _load_reduce(self) -> None:
        stack = self.stack
        args = stack.pop()
        if stack[-1] is torch.Size and type(args) is tuple and len(args) == 1 and type(args[0]) is tuple:
            stack[-1] = torch.Size(args[0])  # the most frequent call: a size, from a tuple of integers
        else:
            stack[-1] = self._call(stack[-1], args)

    def _load_newobj(self) -> None:
        stack = self.stack
        args = stack.pop()
        cls = stack.pop()
        if isinstance(cls, type) and cls in _FIELD_NAMES and args == ():  # created empty, then given its fields
            stack.append(cls.__new__(cls))
        else:
            stack.append(self._call(cls, args))

    def _load_newobj_ex(self) -> None:
        kwargs = self.stack.pop()
        if kwargs:
            raise UnsafeIndexError("creates an object with keyword arguments, which an index never does")
        self._load_newobj()

    def _instantiate(self, klass: Any, args: Any) -> None:
        self.append(self._call(klass, tuple(args)))

    def _load_build(self) -> None:
        state = self.stack.pop()
        target = self.stack[-1]
        cls = type(target)
        if cls is TensorProperties:
            if not _properties_state(state):
                raise UnsafeIndexError("sets the properties of a tensor to values that are not a dtype and flags")
            target.__setstate__(state)
            return
        names = _FIELD_NAMES.get(cls)
        if names is None:
            raise UnsafeIndexError(
                f"sets attributes of {type_name(target)}, which only the index's dataclasses receive"
            )
        if type(state) is not dict or not state.keys() <= names:  # the keys are names: _set_items checked them
            raise UnsafeIndexError(f"sets attributes of a {cls.__name__} that are not its fields")
        vars(target).update(state)

    def _set_items(self, target: Any, items: list) -> None:
        if type(target) not in (dict, OrderedDict):
            raise UnsafeIndexError(f"sets items of {type_name(target)}, which is not a dict")
        keys = items[::2]
        for key in keys:
            if type(key) is not str:
                _check_key(key)
        target.update(zip(keys, items[1::2]))

    def _load_setitem(self) -> None:
        value = self.stack.pop()
        key = self.stack.pop()
        self._set_items(self.stack[-1], [key, value])

    def _load_setitems(self) -> None:
        items = self.pop_mark()
        self._set_items(self.stack[-1], items)

    def _load_dict(self) -> None:
        items = self.pop_mark()
        target: dict = {}
        self._set_items(target, items)
        self.append(target)

    def _load_append(self) -> None:
        value = self.stack.pop()
        self._extend(self.stack[-1], [value])

    def _load_appends(self) -> None:
        items = self.pop_mark()
        self._extend(self.stack[-1], items)

    def _extend(self, target: Any, items: list) -> None:
        if type(target) is not list:
            raise UnsafeIndexError(f"appends to {type_name(target)}, which is not a list")
        target.extend(items)

    def _load_additems(self) -> None:
        items = self.pop_mark()
        target = self.stack[-1]
        if type(target) is not set or not _scalars(items):
            raise UnsafeIndexError(f"adds items to {type_name(target)}, which is not a set of plain values")
        target.update(items)

    def _load_frozenset(self) -> None:
        items = self.pop_mark()
        if not _scalars(items):
            raise UnsafeIndexError("makes a frozenset of values that are not plain")
        self.append(frozenset(items))

    def _load_extension(self) -> None:
        raise UnsafeIndexError("refers to a class through copyreg's extension registry, which an index never does")

    dispatch[pickle.STOP[0]] = _load_stop
    dispatch[pickle.FRAME[0]] = _load_frame
    dispatch[pickle.REDUCE[0]] = _load_reduce
    dispatch[pickle.NEWOBJ[0]] = _load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = _load_newobj_ex
    dispatch[pickle.BUILD[0]] = _load_build
    dispatch[pickle.SETITEM[0]] = _load_setitem
    dispatch[pickle.SETITEMS[0]] = _load_setitems
    dispatch[pickle.DICT[0]] = _load_dict
    dispatch[pickle.APPEND[0]] = _load_append
    dispatch[pickle.APPENDS[0]] = _load_appends
    dispatch[pickle.ADDITEMS[0]] = _load_additems
    dispatch[pickle.FROZENSET[0]] = _load_frozenset
    for _opcode in (pickle.EXT1, pickle.EXT2, pickle.EXT4):
        dispatch[_opcode[0]] = _load_extension


def _scalars(items: Iterable[Any]) -> bool:
    return all(type(item) in _SCALARS for item in items)


def _check_key(key: Any) -> None:
    """A dict key of an index: a name, or a storage key whose fields are a name, a size and an index."""
    if type(key) is str:
        return
    if type(key) is MetadataIndex:
        fields = vars(key)
        offset, index = fields.get("offset"), fields.get("index")
        if (
            type(fields.get("fqn")) is str
            and (offset is None or type(offset) is torch.Size)
            and (index is None or type(index) is int)
        ):
            return
    raise UnsafeIndexError(f"uses {type_name(key)} as a key, which is not a name or a storage key")


def _properties_state(state: Any) -> bool:
    """Whether ``state`` is what ``TensorProperties.__getstate__`` returns."""
    return (
        type(state) is tuple
        and len(state) == 5
        and isinstance(state[0], torch.dtype)
        and isinstance(state[1], torch.layout)
        and type(state[2]) is bool
        and type(state[3]) is _MEM_FORMAT
        and type(state[4]) is bool
    )


def _sets(args: tuple) -> bool:
    return args == () or (len(args) == 1 and type(args[0]) is list and _scalars(args[0]))


def _one(kind: type) -> Any:
    return lambda args: len(args) == 1 and type(args[0]) is kind


_TAKES: dict[Any, Any] = {
    set: _sets,
    frozenset: _sets,
    OrderedDict: lambda args: args == (),
    _get_layout: _one(str),
    _MEM_FORMAT: _one(int),
    torch.Size: lambda args: args == () or (len(args) == 1 and type(args[0]) in (tuple, list)),
    **{cls: (lambda args: all(type(a) is str for a in args)) for cls in _PATHS.values()},
    **{cls: (lambda args: args == ()) for cls in _DATACLASSES},  # fields come as state, checked
}
_ARGUMENTS = {id(function): (function, takes) for function, takes in _TAKES.items()}
"""What the index may call (the constructors of its classes and the layout look-up, by identity) and the
arguments each takes, by type: nothing that a hash or a look-up could spend unbounded time on."""

_FIELD_NAMES = {cls: frozenset(f.name for f in dataclasses.fields(cls)) for cls in _DATACLASSES - {TensorProperties}}
"""The dataclasses given their fields as state, and the names of those fields."""


def _read_index_file(path: Path) -> Metadata:
    """The checked index of the checkpoint ``path``: ``.metadata`` read as a regular file of bounded size."""
    with open_regular(path / ".metadata") as f:
        size = os.fstat(f.fileno()).st_size
        data = f.read(size + 1) if size <= MAX_INDEX_BYTES else b""
    if size > MAX_INDEX_BYTES or len(data) > MAX_INDEX_BYTES:
        raise UnsafeIndexError(
            f"is larger than {MAX_INDEX_BYTES // 2**20} MiB, more than any index this strategy writes"
        )
    return checked_index(_MetadataUnpickler(data).load())


class _RegularFiles(dcp_filesystem.FileSystem):
    """DCP's file access, except that a shard is opened only if it is a regular file (never through a link)."""

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        if mode != "rb":
            raise ValueError(f"a checkpoint is read here, not written ({mode!r})")
        with open_regular(path) as stream:
            yield stream


class SafeReader(FileSystemReader):
    """A ``FileSystemReader`` that reads only what this strategy writes (DCP's own reader uses ``pickle.load``).

    The index is unpickled with an allow-list and rebuilt from plain values (:func:`checked_index`), its shard
    files checked (:func:`check_shard_files`), and only regular files are opened.

    Raises:
        UnsafeIndexError: If the index holds anything but what an index of this strategy holds (nothing of it is
            called), or a file is not a regular file.
        DamagedCheckpointError: If a shard file is missing or shorter than the index says.
    """

    def __init__(self, path: str | os.PathLike, *args: Any, **kwargs: Any) -> None:
        super().__init__(path, *args, **kwargs)
        self.fs = _RegularFiles()

    @override
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path)
        metadata = _read_index_file(path)
        check_shard_files(path, metadata)
        if metadata.storage_meta is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that non-tensor values are read with ``weights_only=True``."""

    @override
    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


def regular_checkpoint_file(path: _PATH) -> Path:
    """``path``, a file of a checkpoint directory (``meta.pt``), if it is a regular file: a link in a checkpoint is
    never followed, a device or FIFO never read.

    Raises:
        RuntimeError: If ``path`` is anything but a regular file.
    """
    path = Path(path)
    try:
        regular_file(path)
    except UnsafeIndexError as error:
        raise RuntimeError(
            f"Refused to read the checkpoint {path.parent}: it {error}. Nothing from it was read; the folder is "
            "damaged or crafted. Resume from a checkpoint this strategy wrote."
        ) from None
    return path


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
    except DamagedCheckpointError:
        raise
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


def shard_files(index: Metadata, keys: Iterable[str]) -> list[str]:
    """The shard files that hold ``keys``, for error messages."""
    wanted = set(keys)
    return sorted({info.relative_path for item, info in index.storage_data.items() if item.fqn in wanted})


def empty_like_saved(md: Any) -> Any:
    """A tensor to read the saved tensor described by ``md`` into; ``None`` (read as saved) for other values."""
    if isinstance(md, TensorStorageMetadata):
        return torch.zeros(tuple(md.size), dtype=md.properties.dtype)  # never stale memory, for any gap
    return None
