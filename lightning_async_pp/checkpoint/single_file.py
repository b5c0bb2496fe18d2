"""The one-file form of a checkpoint: Lightning's own layout, plus what resuming a delayed trajectory needs.

One ``torch.save`` file, as Lightning's strategies write it: ``state_dict`` (the whole model, ``w[t]``),
``optimizer_states`` (``optimizer.state_dict()``, its parameters numbered by position), ``lr_schedulers``,
``loops``, ``callbacks``, ``epoch``, ``global_step``, hyperparameters. Under ``"async_pp"`` it holds the pipeline's
record (as ``meta.pt`` of the sharded form does) and, with the training state:

* ``"previous"``: PipeDream-2BW's ``w[t-1]`` of each trainable parameter, by name (``{}`` under 1F1B);
* ``"rng"``: the random generators' states, per stage (``{stage: state}``);
* ``"optimizer_names"``: the parameter names of each of the first optimizer's param groups, in the order of its
  ``state_dict()`` (what position ``i`` in ``optimizer_states[0]`` is), so that any stage count finds its own;
* ``"gathered"``: ``True`` in a file made of shards, whose ``optimizer_states[0]`` has one group per distinct set of
  hyperparameters (the optimizer of one process may have grouped them otherwise): it is restored by name.

It loads with ``torch.load(path)`` (``weights_only=True`` included) and ``Model.load_from_checkpoint(path)``.
A single process writes it directly; several processes write the sharded form into a hidden directory first,
which rank 0 reads back whole and turns into this file (:func:`single_file_checkpoint`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_async_pp.checkpoint.layout import (
    CHECKPOINT_KEY,
    GROUP_PREFIX,
    MODEL_PREFIX,
    PREVIOUS_PREFIX,
    RNG_PREFIX,
    STATE_PREFIX,
)
from lightning_async_pp.checkpoint.safe import (
    SafeLoadPlanner,
    SafeReader,
    check_shard_files,
    empty_like_saved,
    read_index,
)
from lightning_async_pp.runtime.updates import NOT_HYPERPARAMETERS

__all__ = [
    "GATHERED",
    "OPTIMIZER_NAMES",
    "PREVIOUS",
    "RNG",
    "read_entries",
    "sharded_entries",
    "single_file_checkpoint",
]

PREVIOUS, RNG, OPTIMIZER_NAMES, GATHERED = "previous", "rng", "optimizer_names", "gathered"


def read_entries(checkpoint_dir: Path) -> dict[str, Any]:
    """Every entry of a sharded checkpoint (tensors and other values), read in this process, on CPU."""
    index = read_index(checkpoint_dir)
    metadata = index.state_dict_metadata
    targets = {k: empty_like_saved(md) if isinstance(md, TensorStorageMetadata) else None for k, md in metadata.items()}
    check_shard_files(checkpoint_dir, index, targets)
    planner = SafeLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    try:
        dcp.load(targets, storage_reader=SafeReader(checkpoint_dir), planner=planner, no_dist=True)
    except (Exception, CheckpointException) as error:  # CheckpointException is a BaseException
        raise RuntimeError(f"Could not read back the checkpoint shards in {checkpoint_dir} ({error}).") from error
    return planner.state_dict


def single_file_checkpoint(meta: dict[str, Any], entries: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """Lightning's one-file checkpoint from the sharded form: rank 0's ``meta`` and every shard's ``entries``.

    Args:
        meta: Lightning's checkpoint without ``state_dict`` and ``optimizer_states``, with the pipeline's record.
        entries: :func:`read_entries` of the sharded checkpoint.
        names: The whole model's ``state_dict`` names, in its order.
    """
    checkpoint = dict(meta)
    record = {**checkpoint.get(CHECKPOINT_KEY, {}), GATHERED: True}
    checkpoint["state_dict"] = {n: entries[MODEL_PREFIX + n] for n in names if MODEL_PREFIX + n in entries}
    if record.get("has_training_state"):
        state, record[OPTIMIZER_NAMES] = _optimizer_state(entries, names)
        checkpoint["optimizer_states"] = [state]
        record[PREVIOUS] = {n: entries[PREVIOUS_PREFIX + n] for n in names if PREVIOUS_PREFIX + n in entries}
        record[RNG] = {int(k[len(RNG_PREFIX) :]): v for k, v in entries.items() if k.startswith(RNG_PREFIX)}
    checkpoint[CHECKPOINT_KEY] = record
    return checkpoint


def _optimizer_state(entries: dict[str, Any], names: list[str]) -> tuple[dict[str, Any], list[list[str]]]:
    """One ``optimizer.state_dict()`` of the whole model: parameters in ``names`` order, one group per distinct set
    of hyperparameters; and each group's parameter names."""
    groups: list[dict[str, Any]] = []
    group_names: list[list[str]] = []
    state: dict[int, dict[str, Any]] = {}
    per_param: dict[str, dict[str, Any]] = {}
    for key, value in entries.items():
        if key.startswith(STATE_PREFIX):
            name, _, field = key[len(STATE_PREFIX) :].rpartition(".")
            per_param.setdefault(name, {})[field] = value
    position = 0
    for name in names:
        hyperparameters = entries.get(GROUP_PREFIX + name)
        if hyperparameters is None:
            continue
        for group, members in zip(groups, group_names):
            if {k: v for k, v in group.items() if k != "params"} == hyperparameters:
                break
        else:
            group, members = {**hyperparameters, "params": []}, []
            groups.append(group)
            group_names.append(members)
        group["params"].append(position)
        members.append(name)
        if name in per_param:
            state[position] = per_param[name]
        position += 1
    return {"state": state, "param_groups": groups}, group_names


def sharded_entries(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """A one-file checkpoint's contents under the sharded form's keys, what
    :func:`~lightning_async_pp.checkpoint.layout.restore_stage` reads: the weights, and where the record names the
    optimizer's parameters, ``w[t-1]``, the first optimizer's state and hyperparameters by name, and the RNG."""
    record = checkpoint.get(CHECKPOINT_KEY, {})
    entries: dict[str, Any] = {MODEL_PREFIX + n: t for n, t in checkpoint.get("state_dict", {}).items()}
    group_names = record.get(OPTIMIZER_NAMES)
    if group_names is None or not checkpoint.get("optimizer_states"):
        return entries
    entries.update({PREVIOUS_PREFIX + n: t for n, t in record.get(PREVIOUS, {}).items()})
    entries.update({f"{RNG_PREFIX}{stage}": state for stage, state in record.get(RNG, {}).items()})
    optimizer = checkpoint["optimizer_states"][0]
    for group, names in zip(optimizer["param_groups"], group_names):
        hyperparameters = {k: v for k, v in group.items() if k not in NOT_HYPERPARAMETERS}
        for position, name in zip(group["params"], names):
            entries[GROUP_PREFIX + name] = hyperparameters
            for key, value in optimizer["state"].get(position, {}).items():
                entries[f"{STATE_PREFIX}{name}.{key}"] = value
    return entries
