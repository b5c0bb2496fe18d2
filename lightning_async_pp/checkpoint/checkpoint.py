"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP).

A checkpoint is a directory::

    epoch=0-step=100.ckpt/
        .metadata           DCP's index: every key, its shape and dtype, and which file holds it
        __0_0.distcp ...    one file per writing rank: the tensors of one pipeline stage
        meta.pt             the rest of Lightning's checkpoint (loops, callbacks, hyperparameters), from rank 0

Every stage writes its own tensors (replica 0 of each stage; the other replicas hold the same values); no
tensor travels through a collective. Keys are the model's parameter names, so a checkpoint does not depend
on the number of stages: a run resumed at another ``P`` or ``D`` reads, on each stage, the keys of the
layers it owns now, wherever they were saved (DCP's load planner does the re-sharding).

Keys (``fqn`` is a name of the LightningModule's ``state_dict``):

* ``state_dict.{fqn}``: the newest weights (and buffers);
* ``previous.{fqn}``: PipeDream-2BW's previous weight version ``w[t-1]`` (trainable parameters);
* ``optimizer.state.{fqn}.{key}``: the optimizer's per-parameter state (Adam moments, Muon momentum,
  ``DelayCorrected``'s previous update), and ``optimizer.param_groups.{fqn}``: the hyperparameters of the
  parameter's group, so that both follow the parameter to whichever stage owns it;
* ``rng.stage{s}``: the random number generator states of stage ``s``.

A parameter that the model reaches under several names (tied weights, e.g. an embedding reused as the
output head) has one ``previous.`` and one ``optimizer.`` entry, under its first name in the whole model's
``named_parameters()`` (the name one device uses). A pipeline keeps one copy per stage that uses it; the copies
stay bit-identical, their optimizer states and previous versions too (each owner applies the same update to
the same summed gradient, see :mod:`lightning_async_pp.runtime.ties`), so every copy saves to that entry and
every copy is restored from it, whichever stages the names land on at the next ``P``. ``state_dict.`` keeps
every name, as the one-device ``state_dict`` does.

``meta.pt`` holds, under ``"async_pp"``, the schedule, the stage count and partition it was saved with, the
weight version and the names and shapes of the whole model, which a resumed run checks before reading.

Writes are atomic per checkpoint: the ranks write into a hidden sibling directory, and rank 0 renames it to
the checkpoint's name once every shard and ``meta.pt`` are on disk. A save killed midway leaves only the
hidden directory (removed by the next save to that name), never a checkpoint that looks complete.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import logging
import os
import pickle
import random
import shutil
import time
from collections.abc import Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.fabric.utilities.types import _PATH
from torch import Tensor, nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from typing_extensions import override

log = logging.getLogger("lightning.pytorch.strategies.async_pp")

META_FILE = "meta.pt"
CHECKPOINT_KEY = "async_pp"
FORMAT_VERSION = 1
TRANSFORMERS_KEY = "transformers"
"""Where :class:`~lightning_async_pp.models.CausalLM` records its ``transformers`` configuration and names in a
checkpoint; :func:`consolidate` then also writes a ``save_pretrained`` folder."""
SHARD_KEY = "async_pp_shard"
"""Marks a payload for :class:`ShardedCheckpointIO` (anything else is written as one ``torch.save`` file)."""

_MODEL, _PREVIOUS, _OPT_STATE, _OPT_GROUP, _RNG = (
    "state_dict.",
    "previous.",
    "optimizer.state.",
    "optimizer.param_groups.",
    "rng.stage",
)
_NOT_HYPERPARAMETERS = ("params", "param_names")


def is_sharded_checkpoint(path: _PATH) -> bool:
    """Whether ``path`` is a directory written by :class:`ShardedCheckpointIO`."""
    path = Path(path)
    return path.is_dir() and (path / ".metadata").is_file()


# --- what a stage saves ------------------------------------------------------------------------------


def parameter_aliases(module: nn.Module) -> dict[str, str]:
    """The other names of shared parameters, each mapped to the parameter's first name.

    Call it on the whole model (before a pipeline stage drops the other stages' layers): on a stage, the
    copy of a tied parameter is known only by that stage's name for it.

    Args:
        module: The whole LightningModule.

    Returns:
        ``{alias: first name}`` for every name but the first of each parameter reached under several names.
    """
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        canonical = first.setdefault(id(p), name)
        if canonical != name:
            aliases[name] = canonical
    return aliases


def stage_shard(
    state_dict: dict[str, Tensor],
    optimizer: torch.optim.Optimizer | None,
    module: nn.Module,
    previous: dict[str, Tensor] | None,
    stage: int,
    aliases: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The flat, name-keyed DCP state of one stage.

    Args:
        state_dict: The stage's part of the LightningModule's state dict (newest weights).
        optimizer: The stage's optimizer, or ``None`` for a weights-only checkpoint.
        module: The LightningModule, to name the optimizer's parameters.
        previous: ``w[t-1]`` of the stage's trainable parameters (2BW), keyed like ``state_dict``.
        stage: The stage index (names the RNG state).
        aliases: :func:`parameter_aliases` of the whole model: a tied copy's training state is saved under the
            parameter's first name (every stage holding a copy writes the same, identical entry; DCP keeps one).
    """
    aliases = aliases or {}
    shard: dict[str, Any] = {_MODEL + name: tensor for name, tensor in state_dict.items()}
    if optimizer is None:
        return shard
    for name, tensor in (previous or {}).items():
        shard[_PREVIOUS + aliases.get(name, name)] = tensor
    names = {id(p): aliases.get(n, n) for n, p in module.named_parameters()}
    for group in optimizer.param_groups:
        hyperparameters = {k: v for k, v in group.items() if k not in _NOT_HYPERPARAMETERS}
        for param in group["params"]:
            name = names[id(param)]
            shard[_OPT_GROUP + name] = hyperparameters
            for key, value in optimizer.state.get(param, {}).items():
                shard[f"{_OPT_STATE}{name}.{key}"] = value
    shard[f"{_RNG}{stage}"] = rng_state()
    return shard


def rng_state() -> dict[str, Any]:
    """Every generator's state, as tensors and plain Python values (readable with ``weights_only=True``)."""
    import numpy as np

    kind, keys, position, has_gauss, gauss = np.random.get_state()
    numpy_state = (kind, torch.from_numpy(keys.astype(np.int64)), int(position), int(has_gauss), float(gauss))
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": numpy_state}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np

    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, position, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --- reading safely ------------------------------------------------------------------------------------

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


def _shard_files(index: Metadata, keys: Iterable[str]) -> list[str]:
    wanted = set(keys)
    return sorted({info.relative_path for item, info in index.storage_data.items() if item.fqn in wanted})


# --- loading one stage ---------------------------------------------------------------------------------


def check_compatible(
    path: _PATH, info: dict[str, Any], index: Metadata, schedule: str, model_shapes: dict[str, tuple]
) -> None:
    """Refuse a checkpoint that cannot continue this run, saying what differs. Every rank decides alike.

    Args:
        path: The checkpoint (for the message).
        info: ``meta.pt``'s ``"async_pp"`` entry.
        index: DCP's index of the checkpoint.
        schedule: This run's schedule.
        model_shapes: Names and shapes of the whole model's state dict (all stages).
    """
    saved_schedule = info.get("schedule")
    if info.get("has_training_state") and saved_schedule != schedule:
        raise ValueError(
            f"The checkpoint {path} was saved by a schedule={saved_schedule!r} run; this run uses "
            f"schedule={schedule!r}. The weight versions and optimizer state of one schedule do not continue the "
            f"other: set `schedule={saved_schedule!r}`, or start a new run from the weights only."
        )
    saved = {
        key[len(_MODEL) :]: tuple(md.size)
        for key, md in index.state_dict_metadata.items()
        if key.startswith(_MODEL) and isinstance(md, TensorStorageMetadata)
    }
    missing = sorted(set(model_shapes) - set(saved))
    unexpected = sorted(set(saved) - set(model_shapes))
    reshaped = sorted(n for n in set(saved) & set(model_shapes) if tuple(saved[n]) != tuple(model_shapes[n]))
    if missing or unexpected or reshaped:
        details = []
        if missing:
            details.append(f"missing from the checkpoint: {missing[:6]}{' ...' if len(missing) > 6 else ''}")
        if unexpected:
            details.append(f"not in this model: {unexpected[:6]}{' ...' if len(unexpected) > 6 else ''}")
        if reshaped:
            details.append(
                "other shapes: " + ", ".join(f"{n} {saved[n]} vs {tuple(model_shapes[n])}" for n in reshaped[:6])
            )
        raise ValueError(
            f"The checkpoint {path} holds another model than this one ({'; '.join(details)}). Build the model with "
            "the configuration it was saved with."
        )


def load_stage(
    path: _PATH,
    index: Metadata,
    *,
    state_dict: dict[str, Tensor],
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    previous: dict[str, Tensor] | None,
    stage: int,
    process_group: Any = None,
    aliases: dict[str, str] | None = None,
) -> None:
    """Read this stage's tensors from the checkpoint, in place, and restore its optimizer and RNG.

    Args:
        path: The checkpoint directory.
        index: Its DCP index (:func:`read_index`).
        state_dict: The stage's state dict (detached tensors sharing the parameters' storage).
        module: The LightningModule (names the optimizer's parameters).
        optimizer: The stage's optimizer; ``None`` to read the weights only.
        previous: Tensors to receive ``w[t-1]`` (2BW), keyed like the module's parameters; ``None`` to skip.
        stage: This stage's index (selects the RNG state).
        process_group: Group of all ranks taking part (``None``: the default group, or no distribution).
        aliases: :func:`parameter_aliases` of the whole model: a tied copy reads the training state saved under
            the parameter's first name, wherever that copy lives now.
    """
    available = index.state_dict_metadata
    targets: dict[str, Any] = {_MODEL + name: tensor for name, tensor in state_dict.items()}

    def saved_name(name: str) -> str:
        # The shared entry; a checkpoint that has none (saved before tied copies shared one) has the copy's own.
        canonical = (aliases or {}).get(name, name)
        if canonical == name or _OPT_GROUP + canonical in available or _PREVIOUS + canonical in available:
            return canonical
        return name

    if previous is not None and optimizer is not None:
        for name, tensor in previous.items():
            if _PREVIOUS + saved_name(name) in available:
                targets[_PREVIOUS + saved_name(name)] = tensor
    names: dict[int, str] = {}
    if optimizer is not None:
        names = {id(p): saved_name(n) for n, p in module.named_parameters()}
        owned = {names[id(p)] for group in optimizer.param_groups for p in group["params"]}
        for key, md in available.items():
            if key.startswith(_OPT_STATE):
                name = key[len(_OPT_STATE) :].rpartition(".")[0]
                if name in owned:
                    targets[key] = _empty_like_saved(md)
            elif key.startswith(_OPT_GROUP) and key[len(_OPT_GROUP) :] in owned:
                targets[key] = None
        if f"{_RNG}{stage}" in available:
            targets[f"{_RNG}{stage}"] = None
    check_shard_files(path, index, targets)
    planner = SafeLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    no_dist = not (dist.is_available() and dist.is_initialized())
    try:
        dcp.load(
            targets, storage_reader=SafeReader(path), planner=planner, process_group=process_group, no_dist=no_dist
        )
    except (Exception, CheckpointException) as error:  # CheckpointException is a BaseException
        files = ", ".join(_shard_files(index, targets))
        raise RuntimeError(
            f"Could not read the checkpoint {path} (stage {stage} reads {files}): a shard is damaged or unreadable "
            f"({type(error).__name__}: {error}). Resume from another checkpoint."
        ) from error
    loaded = planner.state_dict
    if optimizer is None:
        return
    _load_optimizer(optimizer, names, loaded)
    rng = loaded.get(f"{_RNG}{stage}")
    if rng is not None:
        set_rng_state(rng)


def _empty_like_saved(md: Any) -> Any:
    if isinstance(md, TensorStorageMetadata):
        return torch.empty(tuple(md.size), dtype=md.properties.dtype)
    return None


def _load_optimizer(optimizer: torch.optim.Optimizer, names: dict[int, str], loaded: dict[str, Any]) -> None:
    """Turn the name-keyed state back into ``optimizer.load_state_dict``'s index-keyed form."""
    current = optimizer.state_dict()
    per_param: dict[str, dict[str, Any]] = {}
    for key, value in loaded.items():
        if key.startswith(_OPT_STATE):
            name, _, field = key[len(_OPT_STATE) :].rpartition(".")
            per_param.setdefault(name, {})[field] = value
    index = 0
    state: dict[int, dict[str, Any]] = {}
    groups = []
    for group, saved_group in zip(optimizer.param_groups, current["param_groups"]):
        hyperparameters: dict[str, Any] | None = None
        for param in group["params"]:
            name = names[id(param)]
            if name in per_param:
                state[index] = per_param[name]
            if hyperparameters is None:
                hyperparameters = loaded.get(_OPT_GROUP + name)
            index += 1
        restored = dict(saved_group)
        if hyperparameters is not None:
            restored.update({k: v for k, v in hyperparameters.items() if k not in _NOT_HYPERPARAMETERS})
        groups.append(restored)
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def align_lr_schedulers(schedulers_state: list[dict[str, Any]], optimizers: list[torch.optim.Optimizer]) -> None:
    """Fit rank 0's saved scheduler states to this rank's parameter groups (their number depends on the stage).

    Schedulers keep one entry per parameter group (``base_lrs``, ``_last_lr``, ``lr_lambdas``). ``meta.pt``
    holds rank 0's, whose stage may have other groups than this rank's; the per-group values are taken
    from this rank's optimizer, restored just before (``initial_lr`` and ``lr`` travel with each parameter).
    """
    if len(optimizers) != 1:
        return
    groups = optimizers[0].param_groups
    for state in schedulers_state:
        if not isinstance(state, dict):
            continue
        if "base_lrs" in state and all("initial_lr" in g for g in groups):
            state["base_lrs"] = [g["initial_lr"] for g in groups]
        if "_last_lr" in state:
            state["_last_lr"] = [g["lr"] for g in groups]
        if isinstance(state.get("lr_lambdas"), list):
            lambdas = state["lr_lambdas"]
            state["lr_lambdas"] = [lambdas[i] if i < len(lambdas) else None for i in range(len(groups))]


# --- the CheckpointIO ------------------------------------------------------------------------------------


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
            if path.is_dir() and not is_sharded_checkpoint(path) and any(path.iterdir()):
                raise IsADirectoryError(
                    f"Cannot save a checkpoint to {path}: it is a directory that is not a checkpoint."
                )
            shutil.rmtree(partial, ignore_errors=True)  # left by a save that was killed
            partial.mkdir(parents=True)
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
            done: Future = Future()

            def finish(saved: Future) -> None:
                try:
                    saved.result()
                    commit()
                    done.set_result(None)
                except BaseException as error:  # reported by the next save or by teardown
                    done.set_exception(error)

            future.add_done_callback(finish)
            self._pending = done
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
                "Resume from another checkpoint; checkpoints are written atomically, so the one saved before it is intact."
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


# --- consolidation -------------------------------------------------------------------------------------


def read_tensors(checkpoint_dir: _PATH, prefix: str = "") -> dict[str, Tensor]:
    """Every tensor of the sharded checkpoint whose key starts with ``prefix``, read in this process (on CPU).

    Keys are as saved (``"state_dict.layers.0.tok.weight"``, ``"previous..."``, ``"optimizer.state..."``).
    """
    checkpoint_dir = Path(checkpoint_dir)
    index = read_index(checkpoint_dir)
    keys = [
        k
        for k, md in index.state_dict_metadata.items()
        if k.startswith(prefix) and isinstance(md, TensorStorageMetadata)
    ]
    check_shard_files(checkpoint_dir, index, keys)
    targets = {k: _empty_like_saved(index.state_dict_metadata[k]) for k in keys}
    try:
        dcp.load(
            targets,
            storage_reader=SafeReader(checkpoint_dir),
            planner=SafeLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
            no_dist=True,
        )
    except (Exception, CheckpointException) as error:
        raise RuntimeError(
            f"Could not read the checkpoint {checkpoint_dir} ({', '.join(_shard_files(index, keys))}): a shard is "
            f"damaged ({type(error).__name__}: {error})."
        ) from error
    return targets


def consolidate(checkpoint_dir: _PATH, out: _PATH, pretrained_dir: _PATH | None = None) -> dict[str, Any]:
    """Write the sharded checkpoint ``checkpoint_dir`` as one Lightning checkpoint file ``out``.

    The file holds the whole model's ``state_dict`` and Lightning's metadata (epoch, step, hyperparameters,
    loops, callbacks), without optimizer or scheduler state, and loads with ``torch.load(weights_only=True)`` on
    one device: ``Model.load_from_checkpoint(out)``, ``trainer.validate(model, ckpt_path=out)``.

    Args:
        checkpoint_dir: A checkpoint directory written by :class:`ShardedCheckpointIO`.
        out: The single-file checkpoint to write.
        pretrained_dir: For a checkpoint of :class:`~lightning_async_pp.models.CausalLM`, also write the model
            as a ``transformers`` ``save_pretrained`` folder there
            (:func:`lightning_async_pp.models.hf.save_pretrained`).

    Returns:
        The checkpoint written.
    """
    weights = read_tensors(checkpoint_dir, _MODEL)
    meta = ShardedCheckpointIO().load_checkpoint(checkpoint_dir)
    for key in ("optimizer_states", "lr_schedulers"):
        meta.pop(key, None)
    info = meta.pop(CHECKPOINT_KEY, {})
    meta["state_dict"] = {k[len(_MODEL) :]: v for k, v in weights.items()}
    meta["consolidated_from"] = {
        "path": str(checkpoint_dir),
        "num_stages": info.get("num_stages"),
        "schedule": info.get("schedule"),
    }
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    temporary = out.with_name(f".{out.name}.partial")
    torch.save(meta, temporary)
    os.replace(temporary, out)
    if pretrained_dir is not None:
        from lightning_async_pp.models.hf import save_pretrained

        save_pretrained(meta, pretrained_dir)
    return meta


def default_pretrained_dir(out: _PATH) -> Path:
    """Where the consolidation command writes a ``save_pretrained`` folder by default: ``model.ckpt`` -> ``model-hf``."""
    out = Path(out)
    return out.with_name(f"{out.stem}-hf")


def consolidate_main(argv: list[str]) -> None:
    """``python -m lightning_async_pp consolidate CHECKPOINT_DIR OUT``."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m lightning_async_pp consolidate",
        description="Write a sharded async_pp checkpoint directory as one Lightning checkpoint file (weights and "
        "metadata, no optimizer state), loadable with torch.load(weights_only=True) on one device. A checkpoint of "
        "lightning_async_pp.models.CausalLM is also written as a transformers save_pretrained folder.",
    )
    parser.add_argument("checkpoint_dir", help="checkpoint directory written by AsyncPipelineStrategy")
    parser.add_argument("out", help="the single-file checkpoint to write")
    parser.add_argument(
        "--pretrained-dir",
        default=None,
        help="for a CausalLM checkpoint: the save_pretrained folder to write (default: OUT without its suffix, "
        "plus '-hf': model.ckpt -> model-hf)",
    )
    args = parser.parse_args(argv)
    meta = ShardedCheckpointIO().load_checkpoint(args.checkpoint_dir)
    pretrained_dir = None
    if TRANSFORMERS_KEY in meta:
        pretrained_dir = args.pretrained_dir or default_pretrained_dir(args.out)
    elif args.pretrained_dir is not None:
        parser.error(
            f"{args.checkpoint_dir} was not saved by lightning_async_pp.models.CausalLM: --pretrained-dir "
            "only applies to Hugging Face models."
        )
    meta = consolidate(args.checkpoint_dir, args.out, pretrained_dir)
    count = sum(t.numel() for t in meta["state_dict"].values())
    print(
        f"Wrote {args.out}: {len(meta['state_dict'])} tensors, {count:,} values, global step {meta.get('global_step')}"
    )
    if pretrained_dir is not None:
        print(f"Wrote {pretrained_dir}: transformers save_pretrained folder (AutoModelForCausalLM.from_pretrained)")


__all__ = [
    "ShardedCheckpointIO",
    "consolidate",
    "is_sharded_checkpoint",
    "read_tensors",
]
