"""The ``CheckpointIO`` of :class:`~lightning_async_pp.AsyncPipelineStrategy`: sharded checkpoint directories,
committed atomically.

Writes are atomic per checkpoint: the ranks write into a hidden sibling directory, and rank 0 renames it to
the checkpoint's name once every shard and ``meta.pt`` are on disk. A save killed midway leaves only the
hidden directory (removed by the next save to that name), never a checkpoint that looks complete.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.fabric.utilities.types import _PATH
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from typing_extensions import override

from lightning_async_pp.checkpoint.layout import META_FILE, SHARD_KEY, is_sharded_checkpoint


class ShardedCheckpointIO(CheckpointIO):
    """Writes and reads checkpoint directories: one DCP shard per pipeline stage plus Lightning's metadata.

    It is the default ``checkpoint_io`` of :class:`~lightning_async_pp.AsyncPipelineStrategy`. Every rank calls
    :meth:`save_checkpoint` with its own payload (its stage's tensors; rank 0 also Lightning's metadata), so it
    can be wrapped by Lightning's ``AsyncCheckpointIO``: the whole transaction, rename included, then runs in
    its background thread, on a process group of its own. A payload that is not a sharded one (a plain state
    dict) is written as one file by ``metadata_io``, as ``TorchCheckpointIO`` would.

    Args:
        metadata_io: Writes and reads ``meta.pt`` (and plain single-file checkpoints). Default:
            ``TorchCheckpointIO``. A custom checkpoint plugin given to the Trainer takes this place.
        async_save: Write through ``torch.distributed.checkpoint.async_save``: the tensors are copied (staged) in
            the caller's thread and written in the background; the next save, and the end of training, wait for
            the previous one. The checkpoint appears under its name only when complete.
    """

    def __init__(self, metadata_io: CheckpointIO | None = None, async_save: bool = False) -> None:
        self.metadata_io = metadata_io if metadata_io is not None else TorchCheckpointIO()
        self.async_save = async_save
        self.process_group: Any = None
        """Group of all ranks for DCP's planning collectives (set by the strategy; ``None`` on one process)."""
        self._pending: Future | None = None
        self.last_save_blocking_seconds: float | None = None
        """How long the last :meth:`save_checkpoint` held its caller."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        """Write ``checkpoint`` to ``path``.

        Args:
            checkpoint: ``{SHARD_KEY: True, "shard": {...}, "meta": {...} or None}`` from the strategy, or a plain
                state dict (written as one file by ``metadata_io``).
            path: The checkpoint directory (or file, for a plain state dict).
            storage_options: Passed on to ``metadata_io``.
        """
        if not checkpoint.get(SHARD_KEY):
            self.metadata_io.save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        if "://" in str(path):
            raise NotImplementedError(
                f"Sharded checkpoints are written to a local or mounted file system; got {path}. Save to a local "
                "directory and copy it, or consolidate it (`python -m lightning_async_pp consolidate`) first."
            )
        begin = time.perf_counter()
        self.wait()
        path = Path(path)
        partial = _partial_path(path)
        rank = _rank(self.process_group)
        if rank == 0:
            _prepare(path, partial)
        self._barrier()
        writer = FileSystemWriter(partial)
        planner = DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
        meta = checkpoint.get("meta")

        def commit() -> None:
            if rank == 0:
                self.metadata_io.save_checkpoint(meta, partial / META_FILE, storage_options=storage_options)
                _fsync(partial / META_FILE)
                _replace_directory(partial, path)

        no_dist = self.process_group is None
        if self.async_save:
            future = dcp.async_save(
                checkpoint["shard"],
                storage_writer=writer,
                planner=planner,
                process_group=self.process_group,
                no_dist=no_dist,
            )
            self._pending = _then(future, commit)
        else:
            try:
                dcp.save(
                    checkpoint["shard"],
                    storage_writer=writer,
                    planner=planner,
                    process_group=self.process_group,
                    no_dist=no_dist,
                )
            except CheckpointException as error:  # a BaseException: make it an ordinary error, on every rank
                raise RuntimeError(
                    f"Could not write the checkpoint {path} ({error}). The previous checkpoint at that name, if any, "
                    "is untouched."
                ) from error
            commit()
            self._barrier()  # every rank returns once the checkpoint is in place
        self.last_save_blocking_seconds = time.perf_counter() - begin

    def wait(self) -> None:
        """Wait for a pending asynchronous save; raise its error, if any."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    @override
    def load_checkpoint(
        self, path: _PATH, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Lightning's part of the checkpoint at ``path`` (``meta.pt``), or a plain single-file checkpoint."""
        self.wait()
        path = Path(path)
        if path.is_dir():
            if not (path / META_FILE).is_file():
                raise FileNotFoundError(
                    f"{path} is not a complete checkpoint ({META_FILE} is missing). Resume from another checkpoint."
                )
            path = path / META_FILE
        try:
            return self.metadata_io.load_checkpoint(path, map_location=map_location, weights_only=True)
        except FileNotFoundError:
            raise
        except Exception as error:
            if "Weights only load failed" in str(error):
                raise
            raise RuntimeError(
                f"Could not read the checkpoint {path}: it is truncated or corrupt ({type(error).__name__}: {error}). "
                "Resume from another checkpoint; checkpoints are written atomically, so the one saved before it is "
                "intact."
            ) from error

    @override
    def remove_checkpoint(self, path: _PATH) -> None:
        """Remove a checkpoint; after the pending asynchronous save, which may be the one writing it."""
        pending = self._pending
        if pending is not None and not pending.done():
            pending.add_done_callback(lambda _: self._remove(Path(path)))
        else:
            self._remove(Path(path))

    def _remove(self, path: Path) -> None:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            self.metadata_io.remove_checkpoint(path)

    @override
    def teardown(self) -> None:
        self.wait()
        self.metadata_io.teardown()

    def _barrier(self) -> None:
        if self.process_group is not None:
            dist.barrier(group=self.process_group)


def _prepare(path: Path, partial: Path) -> None:
    """Refuse to overwrite a directory that is not a checkpoint; make an empty ``partial`` to write into."""
    if path.is_dir() and not is_sharded_checkpoint(path) and any(path.iterdir()):
        raise IsADirectoryError(f"Cannot save a checkpoint to {path}: it is a directory that is not a checkpoint.")
    shutil.rmtree(partial, ignore_errors=True)  # left by a save that was killed
    partial.mkdir(parents=True)


def _then(saved: Future, commit: Callable[[], None]) -> Future:
    """A future done once ``saved`` is and ``commit`` has run after it, holding the first error of the two."""
    done: Future = Future()

    def finish(saved: Future) -> None:
        try:
            saved.result()
            commit()
            done.set_result(None)
        except BaseException as error:  # reported by the next save or by teardown
            done.set_exception(error)

    saved.add_done_callback(finish)
    return done


def _rank(group: Any) -> int:
    return dist.get_rank(group) if group is not None else 0


def _partial_path(path: Path) -> Path:
    # Hidden and without the `.ckpt` suffix: never taken for a checkpoint, nor for `last`.
    return path.with_name(f".{path.name}.partial")


def _fsync(path: Path) -> None:
    # Durability of a rename needs the data and the directory entry on disk; not every file system allows it.
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``); ``False`` where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


def _replace_directory(source: Path, target: Path) -> None:
    """Put the complete checkpoint ``source`` at ``target``, replacing what is there, atomically where possible."""
    if target.is_symlink() or target.is_file():
        target.unlink()
    if not target.exists():
        os.rename(source, target)
    elif _exchange(source, target):
        shutil.rmtree(source)  # now the old checkpoint
    else:
        # Without an atomic exchange: for a moment `target` is missing (never half-written).
        old = target.with_name(f".{target.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(target, old)
        os.rename(source, target)
        shutil.rmtree(old)
    _fsync(target.parent)
