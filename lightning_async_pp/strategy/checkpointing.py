"""The checkpoint the strategy writes and reads: each stage's shard, and on rank 0 Lightning's metadata with the
pipeline's record (schedule, stages, partition, weight version).

The format itself (shards, the index, resharding by name) lives in :mod:`lightning_async_pp.checkpoint`; this
module gathers what the strategy knows into it and restores it into a placed stage. Its functions take the
:class:`~lightning_async_pp.strategy.strategy.AsyncPipelineStrategy`, as Lightning's launchers take theirs.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor

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
from lightning_async_pp.runtime.contract import is_pipeline_module
from lightning_async_pp.schedule import get_schedule

__all__ = [
    "base_checkpoint_io",
    "load_sharded",
    "previous_weights",
    "remove_checkpoint",
    "save_sharded",
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


def remove_checkpoint(io: CheckpointIO, filepath: Any) -> None:
    """Remove a checkpoint directory; behind an ``AsyncCheckpointIO``, after the saves already queued."""
    executor = getattr(io, "_executor", None)  # Lightning's AsyncCheckpointIO
    if isinstance(io, _WrappingCheckpointIO) and executor is not None:
        # Queued behind the saves already submitted, one of which may be writing this very checkpoint.
        executor.submit(io.checkpoint_io.remove_checkpoint, filepath)
    else:
        io.remove_checkpoint(filepath)


def previous_weights(strategy: Any) -> dict[str, Tensor] | None:
    """``w[t-1]`` of this stage's trainable parameters, keyed like the module's parameters (2BW only)."""
    runtime, module = strategy._runtime, strategy.lightning_module
    if runtime is not None and runtime.num_buffers == 2:
        module_names = {id(p): n for n, p in module.named_parameters()}
        names = {n: module_names[id(p)] for n, p in runtime.params.items()}
        return {names[n]: t for n, t in runtime.previous_weights().items()}
    if runtime is None and 1 in get_schedule(strategy.schedule).checkpoint_lags and strategy.optimizers:
        delayed = strategy._single_device.delayed_weights(module)  # before the first step: w[-1] = w[0]
        return dict(zip(delayed.names, delayed.previous))
    return None


def _aliases(strategy: Any) -> dict[str, str]:
    # A tied copy's training state is saved under the parameter's first name in the whole model; one process
    # holds the whole module, which names every parameter by its first name already.
    return strategy._placement.parameter_aliases if strategy._placement is not None else {}


def save_sharded(strategy: Any, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None) -> None:
    """Write a checkpoint directory: each stage its own shard (replica 0 of each stage; with sharded optimizer
    state every replica its part of it), rank 0 the metadata with the pipeline's record (a collective: every
    rank calls it).

    Args:
        strategy: The ``AsyncPipelineStrategy``.
        checkpoint: Lightning's checkpoint dict.
        filepath: The checkpoint directory.
        storage_options: Passed to the checkpoint plugin.
    """
    training_state = "optimizer_states" in checkpoint and bool(strategy.optimizers)
    module = strategy.lightning_module
    shard: dict[str, Any] = {}
    if strategy.replica == 0:
        shard = stage_shard(
            checkpoint["state_dict"],
            strategy.optimizers[0] if training_state else None,
            module,
            previous_weights(strategy) if training_state else None,
            strategy.stage if strategy.multi_process else 0,
            aliases=_aliases(strategy),
        )
    elif training_state and strategy.shard_optimizer:
        shard = stage_shard(
            {}, strategy.optimizers[0], module, None, strategy.stage, aliases=_aliases(strategy), optimizer_only=True
        )
    meta = None
    if strategy.is_global_zero:
        meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        runtime = strategy._runtime
        version = runtime.newest_version if runtime is not None else checkpoint.get("global_step", 0)
        partition = strategy._placement.partition if strategy._placement is not None else None
        if partition is None and is_pipeline_module(module):
            partition = [range(len(list(module.pipeline_layers())))]
        meta[CHECKPOINT_KEY] = {
            "format": FORMAT_VERSION,
            "schedule": strategy.schedule,
            "num_stages": strategy.num_stages,
            "data_parallel_size": strategy.data_parallel_size,
            "num_microbatches": strategy.num_microbatches,
            "partition": [[r.start, r.stop] for r in partition] if partition is not None else None,
            "version": version,
            "has_training_state": training_state,
        }
    payload = {SHARD_KEY: True, "shard": shard, "meta": meta}
    io = strategy.checkpoint_io
    base_checkpoint_io(io).device = strategy.root_device  # the device its writing thread must be on
    if isinstance(io, AsyncCheckpointIO):
        payload = _hand_over(io, payload)
    io.save_checkpoint(payload, filepath, storage_options=storage_options)


def _hand_over(io: AsyncCheckpointIO, payload: dict[str, Any]) -> dict[str, Any]:
    """What Lightning's ``AsyncCheckpointIO`` may take to its thread: once the previous save is written (its queue
    is unbounded), a copy in host memory (it clones on the tensors' own GPU, and its thread runs on device 0)."""
    io._ensure_setup()
    assert io._executor is not None
    io._executor.submit(lambda: None).result()  # runs after every save queued before it
    return snapshot_to_cpu(payload)


def load_sharded(strategy: Any, path: Any) -> dict[str, Any]:
    """Read Lightning's metadata and, in place, this stage's tensors, from any stage count the checkpoint was
    saved with. Training state (optimizer, weight versions, learning-rate schedulers) is restored when fitting.

    Args:
        strategy: The ``AsyncPipelineStrategy``, its stage placed and its optimizer set up.
        path: The checkpoint directory.
    """
    meta = strategy.checkpoint_io.load_checkpoint(path)
    info = meta.get(CHECKPOINT_KEY, {})
    index = read_index(path)
    module, placement, optimizers = strategy.lightning_module, strategy._placement, strategy.optimizers
    multi_process = strategy.multi_process
    if multi_process:
        shapes = placement.model_shapes if placement is not None else None
    else:
        shapes = {n: tuple(t.shape) for n, t in module.state_dict().items()}
    check_compatible(path, info, index, strategy.schedule, shapes)
    fitting = module.trainer.state.fn == TrainerFn.FITTING and bool(optimizers) and info.get("has_training_state")
    if fitting and strategy._runtime is not None:
        strategy._runtime.restore_version(info["version"])
    load_stage(
        path,
        index,
        state_dict=module.state_dict(),
        module=module,
        optimizer=optimizers[0] if fitting else None,
        previous=previous_weights(strategy) if fitting else None,
        stage=strategy.stage if multi_process else 0,
        process_group=strategy._groups.checkpoint if multi_process else None,
        aliases=_aliases(strategy),
    )
    if fitting:
        align_lr_schedulers(meta.get("lr_schedulers", []), optimizers)
    if info.get("has_training_state"):
        meta["optimizer_states"] = []  # restored above; Lightning only checks that they exist
    return meta
