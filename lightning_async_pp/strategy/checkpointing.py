"""The checkpoint the strategy writes and reads: each stage's shard, and on rank 0 Lightning's metadata with the
pipeline's record (schedule, stages, partition, weight version).

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
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.optim import Optimizer

from lightning_async_pp.checkpoint import (
    CHECKPOINT_KEY,
    FORMAT_VERSION,
    SHARD_KEY,
    ShardedCheckpointIO,
    align_lr_schedulers,
    check_compatible,
    load_stage,
    read_index,
    stage_shard,
)
from lightning_async_pp.checkpoint.snapshot import snapshot_to_cpu
from lightning_async_pp.reference.delayed import DelayedWeights
from lightning_async_pp.runtime.contract import is_pipeline_module
from lightning_async_pp.schedule import get_schedule
from lightning_async_pp.strategy.stage_runtime import PipelineStage
from lightning_async_pp.strategy.topology import PipelineDims

__all__ = ["PipelineCheckpoint", "base_checkpoint_io", "remove_checkpoint", "sharded_checkpoint_io"]


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


def remove_checkpoint(io: CheckpointIO, filepath: Any) -> None:
    """Remove a checkpoint directory; behind an ``AsyncCheckpointIO``, after the saves already queued."""
    executor = getattr(io, "_executor", None)  # Lightning's AsyncCheckpointIO
    if isinstance(io, _WrappingCheckpointIO) and executor is not None:
        # Queued behind the saves already submitted, one of which may be writing this very checkpoint.
        executor.submit(io.checkpoint_io.remove_checkpoint, filepath)
    else:
        io.remove_checkpoint(filepath)


@dataclass
class PipelineCheckpoint:
    """What one rank writes to a checkpoint and reads back: its stage's shard, and on rank 0 Lightning's
    metadata with the pipeline's record.

    Args:
        module: The LightningModule (on several processes, cut to this rank's stage).
        optimizers: Its optimizers (empty outside ``fit``).
        schedule: ``"2bw"`` or ``"1f1b"``.
        dims: The job's stages and replicas.
        rank: This process's global rank.
        num_microbatches: Micro-batches per step, recorded in the metadata.
        shard_optimizer: Whether every replica holds a part of the optimizer state.
        device: This rank's device, where the checkpoint writer's thread runs.
        stage: This rank's multi-process stage (``None`` on one process).
        delayed: ``w[t-1]`` of the one-device path's module (``None`` on several processes).
    """

    module: LightningModule
    optimizers: list[Optimizer]
    schedule: str
    dims: PipelineDims
    rank: int
    num_microbatches: int
    device: torch.device
    shard_optimizer: bool = False
    stage: PipelineStage | None = None
    delayed: Callable[[LightningModule], DelayedWeights] | None = None

    @property
    def _stage_index(self) -> int:
        return self.stage.stage if self.stage is not None else 0

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
        """Write a checkpoint directory: each stage its own shard (replica 0 of each stage; with sharded optimizer
        state every replica its part of it), rank 0 the metadata with the pipeline's record (a collective: every
        rank calls it).

        Args:
            io: The strategy's checkpoint plugin (a :class:`ShardedCheckpointIO` at its base).
            checkpoint: Lightning's checkpoint dict.
            filepath: The checkpoint directory.
            storage_options: Passed to the checkpoint plugin.
        """
        training_state = "optimizer_states" in checkpoint and bool(self.optimizers)
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
        meta = self._metadata(checkpoint, training_state) if self.rank == 0 else None
        payload = {SHARD_KEY: True, "shard": shard, "meta": meta}
        base_checkpoint_io(io).device = self.device  # the device its writing thread must be on
        if isinstance(io, AsyncCheckpointIO):
            payload = _hand_over(io, payload)
        io.save_checkpoint(payload, filepath, storage_options=storage_options)

    def _metadata(self, checkpoint: dict[str, Any], training_state: bool) -> dict[str, Any]:
        """Lightning's metadata with the pipeline's record (rank 0)."""
        meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        default = checkpoint.get("global_step", 0)
        version = self.stage.newest_version(default) if self.stage is not None else default
        partition = self.stage.placement.partition if self.stage is not None else None
        if partition is None and is_pipeline_module(self.module):
            partition = [range(len(list(self.module.pipeline_layers())))]
        meta[CHECKPOINT_KEY] = {
            "format": FORMAT_VERSION,
            "schedule": self.schedule,
            "num_stages": self.dims.num_stages,
            "data_parallel_size": self.dims.data_parallel_size,
            "num_microbatches": self.num_microbatches,
            "partition": [[r.start, r.stop] for r in partition] if partition is not None else None,
            "version": version,
            "has_training_state": training_state,
        }
        return meta

    def load(self, io: CheckpointIO, path: Any) -> dict[str, Any]:
        """Read Lightning's metadata and, in place, this stage's tensors, from any stage count the checkpoint was
        saved with. Training state (optimizer, weight versions, learning-rate schedulers) is restored when fitting.

        Args:
            io: The strategy's checkpoint plugin.
            path: The checkpoint directory.
        """
        meta = io.load_checkpoint(path)
        info = meta.get(CHECKPOINT_KEY, {})
        index = read_index(path)
        module, optimizers, stage = self.module, self.optimizers, self.stage
        if stage is not None:
            shapes = stage.placement.model_shapes
        else:
            shapes = {n: tuple(t.shape) for n, t in module.state_dict().items()}
        check_compatible(path, info, index, self.schedule, shapes)
        fitting = module.trainer.state.fn == TrainerFn.FITTING and bool(optimizers) and info.get("has_training_state")
        if fitting and stage is not None:
            stage.restore_version(info["version"], module)
        load_stage(
            path,
            index,
            state_dict=module.state_dict(),
            module=module,
            optimizer=optimizers[0] if fitting else None,
            previous=self.previous_weights() if fitting else None,
            stage=self._stage_index,
            process_group=stage.groups.checkpoint if stage is not None else None,
            aliases=self._aliases,
        )
        if fitting:
            align_lr_schedulers(meta.get("lr_schedulers", []), optimizers)
        if info.get("has_training_state"):
            meta["optimizer_states"] = []  # restored above; Lightning only checks that they exist
        return meta


def _hand_over(io: AsyncCheckpointIO, payload: dict[str, Any]) -> dict[str, Any]:
    """What Lightning's ``AsyncCheckpointIO`` may take to its thread: once the previous save is written (its queue
    is unbounded), a copy in host memory (it clones on the tensors' own GPU, and its thread runs on device 0)."""
    io._ensure_setup()
    assert io._executor is not None
    io._executor.submit(lambda: None).result()  # runs after every save queued before it
    return snapshot_to_cpu(payload)
