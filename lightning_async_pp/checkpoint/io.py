"""The ``CheckpointIO`` of :class:`~lightning_async_pp.AsyncPipelineStrategy`: sharded checkpoint directories and
single files, committed atomically.

Writes are atomic per checkpoint: the ranks write into a hidden sibling directory, and rank 0 renames it to
the checkpoint's name once every shard and ``meta.pt`` are on disk (or, for the single-file form of several
processes, reads the shards back, writes the file beside it and renames that). A single file is written under a
hidden name and renamed too. A save killed midway leaves only the hidden directory or file (removed by the next
save to that name), never a checkpoint that looks complete.

Removal deletes only checkpoints: paths that, with symbolic links and ``..`` resolved, lie directly in a folder
of the trainer's ``ModelCheckpoint`` callbacks (given by :meth:`ShardedCheckpointIO.setup`), and hold a checkpoint
(see :meth:`ShardedCheckpointIO.remove_checkpoint`). The paths to remove come from ``ModelCheckpoint``'s state,
which a resumed run reads from the checkpoint itself.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.fabric.utilities.types import _PATH
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from typing_extensions import override

from lightning_async_pp.checkpoint.compat import check_checkpoint_path
from lightning_async_pp.checkpoint.layout import FILE_ORDER_KEY, META_FILE, SHARD_KEY, is_sharded_checkpoint
from lightning_async_pp.checkpoint.safe import regular_checkpoint_file
from lightning_async_pp.checkpoint.single_file import read_entries, single_file_checkpoint
from lightning_async_pp.checkpoint.snapshot import snapshot_to_cpu, use_device
from lightning_async_pp.files import fsync


class ShardedCheckpointIO(CheckpointIO):
    """Writes and reads checkpoint directories: one DCP shard per pipeline stage plus Lightning's metadata.

    It is the default ``checkpoint_io`` of :class:`~lightning_async_pp.AsyncPipelineStrategy`. Every rank calls
    :meth:`save_checkpoint` with its own payload (its stage's tensors; rank 0 also Lightning's metadata), so it
    can be wrapped by Lightning's ``AsyncCheckpointIO``: the whole transaction, rename included, then runs in
    its background thread, on a process group of its own (the strategy first waits for the previous save and
    copies the payload to host memory, see :mod:`~lightning_async_pp.checkpoint.snapshot`). A payload that is
    not a sharded one (Lightning's checkpoint of one process) is written as one file by ``metadata_io``, as
    ``TorchCheckpointIO`` would, atomically for a local path; an fsspec URL is accepted for it.

    Args:
        metadata_io: Writes and reads ``meta.pt`` (and plain single-file checkpoints). Default:
            ``TorchCheckpointIO``. A custom checkpoint plugin given to the Trainer takes this place.
        async_save: Write in a background thread: the caller waits for the previous save (one in flight at a
            time), copies the payload to host memory and returns; the thread writes the copy, from the stage's
            CUDA device. The end of training and a load wait for it; its error, if any, is raised by the next
            save. The checkpoint appears under its name only when complete. One copy of the stage's state in
            host memory, none on the GPU (Lightning's ``AsyncCheckpointIO`` takes a second one).
    """

    def __init__(self, metadata_io: CheckpointIO | None = None, async_save: bool = False) -> None:
        self.metadata_io = metadata_io if metadata_io is not None else TorchCheckpointIO()
        self.async_save = async_save
        self.process_group: Any = None
        """Group of all ranks for DCP's planning collectives (set by the strategy; ``None`` on one process)."""
        self.device: torch.device | None = None
        """The stage's device, made the current CUDA device of the thread that writes (set by the strategy)."""
        self._pending: Future | None = None
        self._executor: ThreadPoolExecutor | None = None
        self.last_save_blocking_seconds: float | None = None
        """How long the last :meth:`save_checkpoint` held its caller."""
        self._folders: set[Path] = set()  # resolved ModelCheckpoint folders: the only ones removal deletes in
        self._url_folders: set[str] = set()  # remote ModelCheckpoint folders
        self._urls: set[str] = set()  # remote single-file checkpoints saved by this IO

    def setup(self, process_group: Any, checkpoint_folders: list[str]) -> None:
        """What the strategy decides in its ``setup``, before anything is saved or removed.

        Args:
            process_group: Group of all ranks for DCP's planning collectives (``None`` on one process).
            checkpoint_folders: The ``dirpath`` of each of the trainer's ``ModelCheckpoint`` callbacks, which alone
                remove checkpoints: the only folders :meth:`remove_checkpoint` deletes in. A checkpoint saved
                anywhere else (``trainer.save_checkpoint``) is never removed.
        """
        self.process_group = process_group
        self._url_folders = {folder.rstrip("/") for folder in checkpoint_folders if "://" in folder}
        self._folders = {Path(folder).absolute().resolve() for folder in checkpoint_folders if "://" not in folder}

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        """Write ``checkpoint`` to ``path``.

        Args:
            checkpoint: ``{SHARD_KEY: True, "shard": {...}, "meta": {...} or None}`` from the strategy (with
                ``FILE_ORDER_KEY``: written as one file, see :mod:`~lightning_async_pp.checkpoint.single_file`), or
                a plain state dict (written as one file by ``metadata_io``).
            path: The checkpoint directory or file.
            storage_options: Passed on to ``metadata_io``.
        """
        if "://" in str(path):
            self._urls.add(str(path))
        sharded = bool(checkpoint.get(SHARD_KEY))
        if sharded and "://" in str(path):
            raise NotImplementedError(
                f"Checkpoints of several processes are written to a local or mounted file system; got {path}. Save "
                "to a local directory and copy it, or consolidate it (`python -m lightning_async_pp consolidate`) "
                "first. One process writes its single-file checkpoint to any fsspec URL."
            )
        begin = time.perf_counter()
        self.wait()  # one save in flight: at most one copy of the stage's state exists besides the live one
        write = self._write if sharded else self._write_file
        if self.async_save:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="async_pp-checkpoint")
            self._pending = self._executor.submit(write, snapshot_to_cpu(checkpoint), path, storage_options)
        else:
            write(checkpoint, path, storage_options)
        self.last_save_blocking_seconds = time.perf_counter() - begin

    def _write(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None) -> None:
        """The transaction: every rank writes its shard into the hidden directory, rank 0 the metadata and the
        rename (or, for the single-file form, the file made of every shard); every rank returns once the checkpoint
        is in place (collectives on :attr:`process_group`)."""
        use_device(self.device)
        path = Path(path)
        partial = _partial_path(path)
        rank = _rank(self.process_group)
        if rank == 0:
            _prepare(path, partial)
        self._barrier()
        try:
            dcp.save(
                checkpoint["shard"],
                storage_writer=FileSystemWriter(partial),
                planner=DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
                process_group=self.process_group,
                no_dist=self.process_group is None,
            )
        except CheckpointException as error:  # a BaseException: make it an ordinary error, on every rank
            raise RuntimeError(
                f"Could not write the checkpoint {path} ({error}). The previous checkpoint at that name, if any, "
                "is untouched."
            ) from error
        if rank == 0 and checkpoint.get(FILE_ORDER_KEY) is not None:
            entries = read_entries(partial)
            whole = single_file_checkpoint(checkpoint["meta"], entries, checkpoint[FILE_ORDER_KEY])
            del entries
            self._write_file(whole, path, storage_options)  # its hidden name is the shards' directory's: removed
        elif rank == 0:
            self.metadata_io.save_checkpoint(
                checkpoint.get("meta"), partial / META_FILE, storage_options=storage_options
            )
            fsync(partial / META_FILE)
            _replace(partial, path)
        self._barrier()

    def _write_file(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None) -> None:
        """One ``torch.save`` file (by ``metadata_io``), into a hidden sibling first and renamed into place, so that
        it too appears complete or not at all (an fsspec URL is written by ``metadata_io`` directly)."""
        use_device(self.device)
        if "://" in str(path):
            self.metadata_io.save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        path = Path(path)
        _check_target(path)
        partial = _partial_path(path)
        _remove_path(partial)  # left by a save that was killed
        self.metadata_io.save_checkpoint(checkpoint, partial, storage_options=storage_options)
        fsync(partial)
        _replace(partial, path)

    def wait(self) -> None:
        """Wait for a pending asynchronous save; raise its error, if any."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    @override
    def load_checkpoint(
        self, path: _PATH, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Lightning's part of the checkpoint at ``path`` (``meta.pt`` of a directory), or a single-file checkpoint
        (a local path or an fsspec URL).

        Args:
            path: The checkpoint.
            map_location: As ``torch.load``'s; by default ``metadata_io``'s (Lightning's: on the CPU).
            weights_only: As ``torch.load``'s; ``None`` reads with ``True`` (torch's default). ``False`` runs the
                code the file names: only for a checkpoint whose origin you trust.
        """
        self.wait()
        if "://" not in str(path):
            path = Path(path)
            if path.is_dir():
                if not (path / META_FILE).is_file():
                    raise FileNotFoundError(
                        f"{path} is not a complete checkpoint ({META_FILE} is missing). Resume from another checkpoint."
                    )
                path = regular_checkpoint_file(path / META_FILE)
        where = {} if map_location is None else {"map_location": map_location}
        weights_only = True if weights_only is None else weights_only
        try:
            return self.metadata_io.load_checkpoint(path, weights_only=weights_only, **where)
        except FileNotFoundError:
            raise
        except Exception as error:
            if "Weights only load failed" in str(error):
                raise _not_weights_only(path, error) from error
            raise RuntimeError(
                f"Could not read the checkpoint {path}: it is truncated or corrupt ({type(error).__name__}: {error}). "
                "Resume from another checkpoint; checkpoints are written atomically, so the one saved before it is "
                "intact."
            ) from error

    @override
    def remove_checkpoint(self, path: _PATH) -> None:
        """Remove a checkpoint; after the pending asynchronous save, which may be the one writing it.

        Only a checkpoint is removed: ``path``, with symbolic links and ``..`` resolved, must lie directly in a
        folder of a ``ModelCheckpoint`` (its ``dirpath``, see :meth:`setup`; a URL must also be saved by this IO),
        and be a checkpoint directory of this strategy (``.metadata`` and ``meta.pt``) or a ``torch.save`` file. A
        symbolic link there (``save_last="link"``) is removed itself, never what it points to. Anything else is
        left in place with a warning that says why: a resumed run reads the paths to remove from the checkpoint.
        """
        pending = self._pending
        if pending is not None and not pending.done():
            pending.add_done_callback(lambda _: self._remove(path))
        else:
            self._remove(path)

    def _remove(self, path: _PATH) -> None:
        if "://" in str(path):
            if str(path) in self._urls and str(path).rsplit("/", 1)[0] in self._url_folders:
                self.metadata_io.remove_checkpoint(path)
            else:
                _refuse(path, "this run did not save it into a ModelCheckpoint folder")
            return
        path = Path(path).absolute()
        if not os.path.lexists(path):
            return
        if path.is_symlink():
            folder = path.parent.resolve()
            if folder in self._folders:
                path.unlink()  # the link only
            else:
                _refuse(path, f"it is a link in {folder}, which is no ModelCheckpoint's folder")
            return
        target = path.resolve()
        if target.parent not in self._folders:
            _refuse(path, f"it is {target}, outside the ModelCheckpoint folders of this run")
        elif target.is_dir():
            if is_sharded_checkpoint(target) and (target / META_FILE).is_file():
                shutil.rmtree(target)
            else:
                _refuse(path, f"the directory {target} is not a checkpoint (no .metadata and {META_FILE})")
        else:
            try:
                check_checkpoint_path(target)
            except ValueError:
                _refuse(path, f"{target} is not a torch.save file")
                return
            self.metadata_io.remove_checkpoint(target)

    @override
    def teardown(self) -> None:
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            self.metadata_io.teardown()

    def _barrier(self) -> None:
        if self.process_group is not None:
            dist.barrier(group=self.process_group)


def _refuse(path: _PATH, reason: str) -> None:
    warnings.warn(
        f"Did not remove {path}: {reason}. Only checkpoints in the folders of the trainer's ModelCheckpoint "
        "callbacks (their dirpath) are removed; a path that ModelCheckpoint read from a resumed checkpoint "
        "(best_k_models, last_model_path) and that points elsewhere is left in place.",
        stacklevel=2,
    )


def _not_weights_only(path: _PATH, error: Exception) -> RuntimeError:
    reason = next((line.strip() for line in str(error).splitlines() if "WeightsUnpickler error" in line), "")
    return RuntimeError(
        f"Could not read the checkpoint {path} with weights_only=True: it holds objects other than tensors and plain "
        f"Python values ({reason or type(error).__name__}). If you trust where it comes from, pass "
        "weights_only=False with the path: `trainer.fit(model, ckpt_path=..., weights_only=False)` (validate, "
        "test and predict take it too); loading it runs the code it names."
    )


def _check_target(path: Path) -> None:
    """Refuse to overwrite a directory that is not a checkpoint."""
    if path.is_dir() and not path.is_symlink() and not is_sharded_checkpoint(path) and any(path.iterdir()):
        raise IsADirectoryError(f"Cannot save a checkpoint to {path}: it is a directory that is not a checkpoint.")


def _prepare(path: Path, partial: Path) -> None:
    """Refuse to overwrite a directory that is not a checkpoint; make an empty ``partial`` to write into."""
    _check_target(path)
    _remove_path(partial)  # left by a save that was killed
    partial.mkdir(parents=True)


def _remove_path(path: Path) -> None:
    """Remove a file, link or directory tree, if there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()


def _rank(group: Any) -> int:
    return dist.get_rank(group) if group is not None else 0


def _partial_path(path: Path) -> Path:
    # Hidden and without the `.ckpt` suffix: never taken for a checkpoint, nor for `last`.
    return path.with_name(f".{path.name}.partial")


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


def _replace(source: Path, target: Path) -> None:
    """Put the complete checkpoint ``source`` (a directory or a file) at ``target``, replacing what is there,
    atomically where possible."""
    if source.is_file() and (target.is_symlink() or not target.is_dir()):
        os.replace(source, target)  # one step, over a file or a link too
    elif not os.path.lexists(target):
        os.rename(source, target)
    elif _exchange(source, target):
        _remove_path(source)  # now the old checkpoint
    else:
        # Without an atomic exchange: for a moment `target` is missing (never half-written).
        old = target.with_name(f".{target.name}.old")
        _remove_path(old)
        os.rename(target, old)
        os.rename(source, target)
        _remove_path(old)
    fsync(target.parent)
