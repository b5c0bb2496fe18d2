"""Sharded checkpoints through ``torch.distributed.checkpoint``: one shard per stage, written atomically,
restored at any stage count, consolidated to one file or a Hugging Face folder."""

from lightning_async_pp.checkpoint.checkpoint import *  # noqa: F403
from lightning_async_pp.checkpoint.checkpoint import (  # noqa: F401
    CHECKPOINT_KEY,
    FORMAT_VERSION,
    SHARD_KEY,
    TRANSFORMERS_KEY,
    align_lr_schedulers,
    check_compatible,
    consolidate_main,
    load_stage,
    parameter_aliases,
    read_index,
    rng_state,
    set_rng_state,
    stage_shard,
)
