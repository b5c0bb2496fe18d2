"""The checkpoint the strategy writes and reads: each stage's shard, and on rank 0 Lightning's metadata with the
pipeline's record (schedule, stages, partition, weight version); or Lightning's single file.

The format itself (shards, the index, resharding by name) lives in :mod:`lightning_async_pp.checkpoint`; this
module's :class:`PipelineCheckpoint`, built from what the strategy knows at each save or load, writes a rank's
part of it and restores it into a placed stage.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.distributed.checkpoint.metadata import Metadata
from torch.optim import Optimizer

from lightning_async_pp.checkpoint import (
    CHECKPOINT_KEY,
    FORMAT_VERSION,
    SHARD_KEY,
    ShardedCheckpointIO,
    align_lr_schedulers,
    check_compatible,
    is_sharded_checkpoint,
    load_stage,
    read_index,
    rng_state,
    set_rng_state,
    stage_shard,
)
from lightning_async_pp.checkpoint.compat import check_checkpoint_path, check_named_optimizer_state, saved_shapes
from lightning_async_pp.checkpoint.layout import FILE_ORDER_KEY, restore_stage
from lightning_async_pp.checkpoint.single_file import GATHERED, OPTIMIZER_NAMES, PREVIOUS, RNG, sharded_entries
from lightning_async_pp.checkpoint.snapshot import snapshot_to_cpu
from lightning_async_pp.reference.delayed import DelayedWeights
from lightning_async_pp.runtime.contract import is_pipeline_module
from lightning_async_pp.schedule import get_schedule
from lightning_async_pp.strategy.stage_runtime import PipelineStage
from lightning_async_pp.strategy.topology import PipelineDims

__all__ = [
    "CheckpointRestore",
    "single_file_form",
    "PipelineCheckpoint",
    "RestoredCheckpoint",
    "base_checkpoint_io",
    "checkpoint_folders",
    "remove_checkpoint",
    "sharded_checkpoint_io",
]


def sharded_checkpoint_io(io: CheckpointIO | None) -> CheckpointIO:
    """``io`` with a :class:`ShardedCheckpointIO` at its base: another plugin becomes its metadata writer, and a
    wrapper (Lightning's ``AsyncCheckpointIO``) keeps wrapping the sharded one."""
    if isinstance(io, _WrappingCheckpointIO):
        if not isinstance(io.checkpoint_io, ShardedCheckpointIO):
            io._checkpoint_io = ShardedCheckpointIO(metadata_io=io.checkpoint_io)
            io._base_checkpoint_io_configured = True
        return io
    if not isinstance(io, ShardedCheckpointIO):
        return ShardedCheckpointIO(metadata_io=io)
    return io


def base_checkpoint_io(io: CheckpointIO) -> ShardedCheckpointIO:
    """The :class:`ShardedCheckpointIO` under a wrapper (see :func:`sharded_checkpoint_io`)."""
    return io.checkpoint_io if isinstance(io, _WrappingCheckpointIO) else io


def checkpoint_folders(trainer: Trainer) -> list[str]:
    """The folders of ``trainer``'s ``ModelCheckpoint`` callbacks (resolved by their ``setup``, before the
    strategy's): the only ones old checkpoints are removed from, as only ``ModelCheckpoint`` removes any."""
    callbacks = [c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)]
    return [str(c.dirpath) for c in callbacks if getattr(c, "dirpath", None) is not None]  # a mock may have none


def remove_checkpoint(io: CheckpointIO, filepath: Any) -> None:
    """Remove a checkpoint directory; behind an ``AsyncCheckpointIO``, after the saves already queued."""
    executor = getattr(io, "_executor", None)  # Lightning's AsyncCheckpointIO
    if isinstance(io, _WrappingCheckpointIO) and executor is not None:
        # Queued behind the saves already submitted, one of which may be writing this very checkpoint.
        executor.submit(io.checkpoint_io.remove_checkpoint, filepath)
    else:
        io.remove_checkpoint(filepath)


@dataclass
class RestoredCheckpoint:
    """A checkpoint being restored, between ``load_checkpoint`` (before setup) and the optimizers' restore.

    Args:
        path: Where it was read from.
        checkpoint: What Lightning restores from: the whole file, or a directory's ``meta.pt``.
        index: A directory's DCP index (``None`` for a file).
        native: Lightning restores the weights and optimizers itself: a single file written by one process (or by
            another strategy), not gathered from shards, read by one process. Otherwise each stage reads its part at
            the end of ``setup``.
    """

    path: Any
    checkpoint: dict[str, Any]
    index: Metadata | None
    native: bool


@dataclass
class PipelineCheckpoint:
    """What one rank writes to a checkpoint and reads back: its stage's shard, and on rank 0 Lightning's
    metadata with the pipeline's record; or, in the single-file form, Lightning's one file (see
    :mod:`~lightning_async_pp.checkpoint.single_file`).

    Args:
        module: The LightningModule (on several processes, cut to this rank's stage).
        optimizers: Its optimizers (empty outside ``fit``).
        schedule: ``"2bw"`` or ``"1f1b"``.
        dims: The job's stages and replicas.
        rank: This process's global rank.
        num_microbatches: Micro-batches per step, recorded in the metadata.
        device: This rank's device, where the checkpoint writer's thread runs.
        single_file: Write one ``torch.save`` file (on several processes: gathered by rank 0) rather than the
            sharded directory.
        shard_optimizer: Whether every replica holds a part of the optimizer state.
        stage: This rank's multi-process stage (``None`` on one process, and before the first ``setup``).
        delayed: ``w[t-1]`` of the one-device path's module (``None`` on several processes).
    """

    module: LightningModule
    optimizers: list[Optimizer]
    schedule: str
    dims: PipelineDims
    rank: int
    num_microbatches: int
    device: torch.device
    single_file: bool = False
    shard_optimizer: bool = False
    stage: PipelineStage | None = None
    delayed: Callable[[LightningModule], DelayedWeights] | None = None

    @property
    def _stage_index(self) -> int:
        return self.stage.stage if self.stage is not None else 0

    @property
    def _one_process(self) -> bool:
        return self.dims.world_size == 1

    @property
    def _aliases(self) -> dict[str, str]:
        # A tied copy's training state is saved under the parameter's first name in the whole model; one process
        # holds the whole module, which names every parameter by its first name already.
        return self.stage.placement.parameter_aliases if self.stage is not None else {}

    def previous_weights(self) -> dict[str, Tensor] | None:
        """``w[t-1]`` of this stage's trainable parameters, keyed like the module's parameters (2BW only)."""
        if self.stage is not None:
            return self.stage.previous_weights(self.module)
        if 1 in get_schedule(self.schedule).checkpoint_lags and self.optimizers and self.delayed is not None:
            delayed = self.delayed(self.module)  # before the first step: w[-1] = w[0]
            return dict(zip(delayed.names, delayed.previous))
        return None

    def save(self, io: CheckpointIO, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None) -> None:
        """Write a checkpoint: a directory with each stage's own shard (replica 0 of each stage; with sharded
        optimizer state every replica its part of it) and rank 0's metadata with the pipeline's record, or the
        single file (a collective: every rank calls it).

        Args:
            io: The strategy's checkpoint plugin (a :class:`ShardedCheckpointIO` at its base).
            checkpoint: Lightning's checkpoint dict.
            filepath: The checkpoint directory or file.
            storage_options: Passed to the checkpoint plugin.
        """
        training_state = "optimizer_states" in checkpoint and bool(self.optimizers)
        base_checkpoint_io(io).device = self.device  # the device its writing thread must be on
        if self.single_file and self.stage is None:
            payload = self._one_file(checkpoint, training_state)
        else:
            payload = self._shard_payload(checkpoint, training_state)
        if isinstance(io, AsyncCheckpointIO):
            payload = _hand_over(io, payload)
        io.save_checkpoint(payload, filepath, storage_options=storage_options)

    def _shard_payload(self, checkpoint: dict[str, Any], training_state: bool) -> dict[str, Any]:
        optimizer = self.optimizers[0] if training_state else None
        shard: dict[str, Any] = {}
        if self.dims.replica_of(self.rank) == 0:
            previous = self.previous_weights() if training_state else None
            shard = stage_shard(
                checkpoint["state_dict"], optimizer, self.module, previous, self._stage_index, aliases=self._aliases
            )
        elif training_state and self.shard_optimizer:
            shard = stage_shard(
                {}, optimizer, self.module, None, self._stage_index, aliases=self._aliases, optimizer_only=True
            )
        meta = None
        if self.rank == 0:
            meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
            meta[CHECKPOINT_KEY] = self._record(checkpoint, training_state)
        payload = {SHARD_KEY: True, "shard": shard, "meta": meta}
        if self.single_file and self.rank == 0:
            payload[FILE_ORDER_KEY] = list(self._model_shapes())
        return payload

    def _one_file(self, checkpoint: dict[str, Any], training_state: bool) -> dict[str, Any]:
        """Lightning's checkpoint of one process, with the record and what a delayed trajectory resumes from."""
        record = self._record(checkpoint, training_state)
        if training_state:
            record[PREVIOUS] = dict(self.previous_weights() or {})
            record[RNG] = {0: rng_state()}
            names = {id(p): n for n, p in self.module.named_parameters()}
            groups = [[names.get(id(p)) for p in group["params"]] for group in self.optimizers[0].param_groups]
            if all(name is not None for group in groups for name in group):
                record[OPTIMIZER_NAMES] = groups
        return {**checkpoint, CHECKPOINT_KEY: record}

    def _record(self, checkpoint: dict[str, Any], training_state: bool) -> dict[str, Any]:
        """The pipeline's record: what a resumed run checks and continues from."""
        default = checkpoint.get("global_step", 0)
        version = self.stage.newest_version(default) if self.stage is not None else default
        partition = self.stage.placement.partition if self.stage is not None else None
        if partition is None and is_pipeline_module(self.module):
            partition = [range(len(list(self.module.pipeline_layers())))]
        return {
            "format": FORMAT_VERSION,
            "schedule": self.schedule,
            "num_stages": self.dims.num_stages,
            "data_parallel_size": self.dims.data_parallel_size,
            "num_microbatches": self.num_microbatches,
            "partition": [[r.start, r.stop] for r in partition] if partition is not None else None,
            "version": version,
            "has_training_state": training_state,
        }

    def _model_shapes(self) -> dict[str, tuple]:
        """Names and shapes of the whole model's state dict (a module cut by an earlier run: its placement's)."""
        if self.stage is not None and self.stage.placement.module is self.module:
            return self.stage.placement.model_shapes
        return {n: tuple(t.shape) for n, t in self.module.state_dict().items()}

    def read(self, io: CheckpointIO, path: Any, weights_only: bool | None) -> RestoredCheckpoint:
        """Read what Lightning restores from (before ``setup``) and refuse a checkpoint that cannot continue this run.

        Args:
            io: The strategy's checkpoint plugin.
            path: A checkpoint directory or file (or an fsspec URL of a file).
            weights_only: ``torch.load``'s, for the file (or ``meta.pt``); the shards are always read without code.
        """
        sharded = is_sharded_checkpoint(path)
        if not sharded:
            check_checkpoint_path(path)
        checkpoint = io.load_checkpoint(path, weights_only=weights_only)
        info = checkpoint.get(CHECKPOINT_KEY, {})
        index = read_index(path) if sharded else None
        native = not sharded and self._one_process and not info.get(GATHERED)
        saved = saved_shapes(index) if index is not None else _shapes(checkpoint.get("state_dict", {}))
        if native:  # Lightning's load_state_dict checks the weights; only the schedule here (no module needed)
            check_compatible(path, info, saved, self.schedule, saved)
        else:
            strict = self.module.strict_loading
            check_compatible(path, info, saved, self.schedule, self._model_shapes(), strict=strict)
            if not sharded and self.module.trainer.state.fn == TrainerFn.FITTING:
                check_named_optimizer_state(path, checkpoint)
        if sharded and info.get("has_training_state"):
            checkpoint["optimizer_states"] = []  # restored with the shards; Lightning only checks that they exist
        return RestoredCheckpoint(path, checkpoint, index, native)

    def restore(self, restored: RestoredCheckpoint) -> None:
        """Read this stage's part, in place, once ``setup`` has placed it: its weights and, when fitting, its
        optimizer state, ``w[t-1]``, weight version and RNG (not for a ``native`` checkpoint: Lightning's)."""
        module, optimizers, stage = self.module, self.optimizers, self.stage
        info = restored.checkpoint.get(CHECKPOINT_KEY, {})
        fitting = module.trainer.state.fn == TrainerFn.FITTING and bool(optimizers) and info.get("has_training_state")
        if fitting and stage is not None:
            stage.restore_version(info["version"], module)
        where = {
            "state_dict": module.state_dict(),
            "module": module,
            "optimizer": optimizers[0] if fitting else None,
            "previous": self.previous_weights() if fitting else None,
            "stage": self._stage_index,
            "aliases": self._aliases,
        }
        if restored.index is not None:
            group = stage.groups.checkpoint if stage is not None else None
            load_stage(restored.path, restored.index, process_group=group, **where)
        else:
            restore_stage(sharded_entries(restored.checkpoint), **where)

    def restore_training(self, restored: RestoredCheckpoint) -> None:
        """After the optimizers' restore: a ``native`` checkpoint's ``w[t-1]`` and RNG; otherwise rank 0's scheduler
        states fitted to this rank's parameter groups."""
        if not restored.native:
            align_lr_schedulers(restored.checkpoint.get("lr_schedulers", []), self.optimizers)
            return
        record = restored.checkpoint.get(CHECKPOINT_KEY, {})
        previous, saved = self.previous_weights() or {}, record.get(PREVIOUS, {})
        with torch.no_grad():
            for name, tensor in previous.items():
                if name in saved:
                    tensor.copy_(saved[name])
        if 0 in record.get(RNG, {}):
            set_rng_state(record[RNG][0])


class CheckpointRestore:
    """The checkpoint a run restores, across Lightning's hooks: read before ``setup`` (:meth:`read`), each stage's
    part at the end of ``setup`` (:meth:`into_stage`), the rest after the optimizers' restore
    (:meth:`after_optimizers`)."""

    def __init__(self) -> None:
        self.restored: RestoredCheckpoint | None = None

    def read(self, checkpoint: PipelineCheckpoint, io: CheckpointIO, path: Any, weights_only: bool | None) -> dict:
        """What Lightning restores from (see :meth:`PipelineCheckpoint.read`)."""
        self.restored = checkpoint.read(io, path, weights_only)
        return self.restored.checkpoint

    @property
    def lightning_restores(self) -> bool:
        """Whether Lightning loads the weights and optimizers itself: no checkpoint, or a ``native`` one."""
        return self.restored is None or self.restored.native

    def into_stage(self, checkpoint: PipelineCheckpoint, fitting: bool) -> None:
        """At the end of ``setup``: this stage's part of a checkpoint Lightning does not restore itself."""
        if not self.lightning_restores:
            checkpoint.restore(self.restored)
        if not fitting:
            self.restored = None

    def after_optimizers(self, checkpoint: PipelineCheckpoint) -> None:
        """After Lightning's restore of the optimizers (or instead of it): see
        :meth:`PipelineCheckpoint.restore_training`."""
        restored, self.restored = self.restored, None
        if restored is not None:
            checkpoint.restore_training(restored)


def single_file_form(save_distributed_checkpoint: bool | None, multi_process: bool) -> bool:
    """Whether checkpoints are single files: ``save_distributed_checkpoint=False``, or ``None`` on one process.

    Raises:
        ValueError: ``save_distributed_checkpoint`` is not ``True``, ``False`` or ``None``.
    """
    if save_distributed_checkpoint not in (None, True, False):
        raise ValueError(
            f"save_distributed_checkpoint must be True (a directory of shards), False (one file) or None (one file "
            f"on one process, a directory on several); got {save_distributed_checkpoint!r}."
        )
    return not multi_process if save_distributed_checkpoint is None else not save_distributed_checkpoint


def _shapes(state_dict: dict[str, Any]) -> dict[str, tuple]:
    return {n: tuple(t.shape) for n, t in state_dict.items() if isinstance(t, Tensor)}


def _hand_over(io: AsyncCheckpointIO, payload: dict[str, Any]) -> dict[str, Any]:
    """What Lightning's ``AsyncCheckpointIO`` may take to its thread: once the previous save is written (its queue
    is unbounded), a copy in host memory (it clones on the tensors' own GPU, and its thread runs on device 0)."""
    io._ensure_setup()
    assert io._executor is not None
    io._executor.submit(lambda: None).result()  # runs after every save queued before it
    return snapshot_to_cpu(payload)
