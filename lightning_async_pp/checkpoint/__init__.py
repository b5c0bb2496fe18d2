"""Sharded checkpoints through ``torch.distributed.checkpoint``: one shard per stage, written atomically,
restored at any stage count, consolidated to one file.

The layout (keys, a stage's share) is in :mod:`~lightning_async_pp.checkpoint.layout`, safe reading in
:mod:`~lightning_async_pp.checkpoint.safe`, the checks before a resume in :mod:`~lightning_async_pp.checkpoint.compat`,
the ``CheckpointIO`` in :mod:`~lightning_async_pp.checkpoint.io` and one-device copies in
:mod:`~lightning_async_pp.checkpoint.consolidate`.
"""

from lightning_async_pp.checkpoint.compat import align_lr_schedulers, check_compatible
from lightning_async_pp.checkpoint.consolidate import consolidate, read_tensors
from lightning_async_pp.checkpoint.io import ShardedCheckpointIO
from lightning_async_pp.checkpoint.layout import (
    CHECKPOINT_KEY,
    FORMAT_VERSION,
    SHARD_KEY,
    TRANSFORMERS_KEY,
    is_sharded_checkpoint,
    load_stage,
    parameter_aliases,
    rng_state,
    set_rng_state,
    stage_shard,
)
from lightning_async_pp.checkpoint.safe import read_index

__all__ = [
    "CHECKPOINT_KEY",
    "FORMAT_VERSION",
    "SHARD_KEY",
    "TRANSFORMERS_KEY",
    "ShardedCheckpointIO",
    "align_lr_schedulers",
    "check_compatible",
    "consolidate",
    "is_sharded_checkpoint",
    "load_stage",
    "parameter_aliases",
    "read_index",
    "read_tensors",
    "rng_state",
    "set_rng_state",
    "stage_shard",
]
