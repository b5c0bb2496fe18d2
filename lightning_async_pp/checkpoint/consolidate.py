"""One-device copies of a sharded checkpoint: its tensors read in one process, or the whole model written as
one Lightning checkpoint file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.types import _PATH
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_async_pp.checkpoint.io import ShardedCheckpointIO
from lightning_async_pp.checkpoint.layout import CHECKPOINT_KEY, MODEL_PREFIX
from lightning_async_pp.checkpoint.safe import (
    SafeLoadPlanner,
    SafeReader,
    check_shard_files,
    empty_like_saved,
    read_index,
    shard_files,
)
from lightning_async_pp.files import atomic_file


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
    targets = {k: empty_like_saved(index.state_dict_metadata[k]) for k in keys}
    try:
        dcp.load(
            targets,
            storage_reader=SafeReader(checkpoint_dir),
            planner=SafeLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
            no_dist=True,
        )
    except (Exception, CheckpointException) as error:
        raise RuntimeError(
            f"Could not read the checkpoint {checkpoint_dir} ({', '.join(shard_files(index, keys))}): a shard is "
            f"damaged ({type(error).__name__}: {error})."
        ) from error
    return targets


def consolidate(checkpoint_dir: _PATH, out: _PATH) -> dict[str, Any]:
    """Write the sharded checkpoint ``checkpoint_dir`` as one Lightning checkpoint file ``out``.

    The file holds the whole model's ``state_dict`` and Lightning's metadata (epoch, step, hyperparameters,
    loops, callbacks), without optimizer or scheduler state, and loads with ``torch.load(weights_only=True)`` on
    one device: ``Model.load_from_checkpoint(out)``, ``trainer.validate(model, ckpt_path=out)``. A checkpoint of
    :class:`~lightning_async_pp.models.CausalLM` can then be written as a ``transformers`` folder by
    :func:`lightning_async_pp.models.hf.save_pretrained` (``python -m lightning_async_pp consolidate`` does both).

    Args:
        checkpoint_dir: A checkpoint directory written by :class:`~lightning_async_pp.checkpoint.ShardedCheckpointIO`.
        out: The single-file checkpoint to write.

    Returns:
        The checkpoint written.
    """
    weights = read_tensors(checkpoint_dir, MODEL_PREFIX)
    meta = ShardedCheckpointIO().load_checkpoint(checkpoint_dir)
    for key in ("optimizer_states", "lr_schedulers"):
        meta.pop(key, None)
    info = meta.pop(CHECKPOINT_KEY, {})
    meta["state_dict"] = {k[len(MODEL_PREFIX) :]: v for k, v in weights.items()}
    meta["consolidated_from"] = {
        "path": str(checkpoint_dir),
        "num_stages": info.get("num_stages"),
        "schedule": info.get("schedule"),
    }
    with atomic_file(out) as file:
        torch.save(meta, file)
    return meta
