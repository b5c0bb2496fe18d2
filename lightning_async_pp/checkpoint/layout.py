"""The layout of a sharded checkpoint (``torch.distributed.checkpoint``, DCP): its keys, and a stage's share.

A checkpoint is a directory::

    epoch=0-step=100.ckpt/
        .metadata           DCP's index: every key, its shape and dtype, and which file holds it
        __0_0.distcp ...    one file per writing rank: the tensors of one pipeline stage
        meta.pt             the rest of Lightning's checkpoint (loops, callbacks, hyperparameters), from rank 0

Every stage writes its own tensors (replica 0 of each stage; the other replicas hold the same values); no
tensor travels through a collective. With the optimizer state sharded over the replicas, each replica writes
the optimizer entries of the tensors it owns, under the same keys. Keys are the model's parameter names, so a
checkpoint does not depend on the number of stages or replicas: a run resumed at another ``P`` or ``D``,
sharded or not, reads on each stage the keys of the layers (and optimizer state) it owns now, wherever they
were saved (DCP's load planner does the re-sharding).

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
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.types import _PATH
from torch import Tensor, nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from lightning_async_pp.checkpoint.safe import (
    SafeLoadPlanner,
    SafeReader,
    check_shard_files,
    empty_like_saved,
    shard_files,
)
from lightning_async_pp.runtime.updates import NOT_HYPERPARAMETERS

META_FILE = "meta.pt"
CHECKPOINT_KEY = "async_pp"
FORMAT_VERSION = 1
TRANSFORMERS_KEY = "transformers"
"""Where :class:`~lightning_async_pp.models.CausalLM` records its ``transformers`` configuration and names in a
checkpoint, from which :func:`lightning_async_pp.models.hf.save_pretrained` writes a ``save_pretrained`` folder."""
SHARD_KEY = "async_pp_shard"
"""Marks a payload for :class:`~lightning_async_pp.checkpoint.ShardedCheckpointIO` (anything else is written as one
``torch.save`` file)."""
FILE_ORDER_KEY = "async_pp_single_file"
"""In a sharded payload: the whole model's ``state_dict`` names, in order, asking for the single-file form (rank 0
turns the shards into one file, see :mod:`~lightning_async_pp.checkpoint.single_file`); absent for a directory."""

MODEL_PREFIX, PREVIOUS_PREFIX, STATE_PREFIX, GROUP_PREFIX, RNG_PREFIX = (
    "state_dict.",
    "previous.",
    "optimizer.state.",
    "optimizer.param_groups.",
    "rng.stage",
)


def is_sharded_checkpoint(path: _PATH) -> bool:
    """Whether ``path`` is a directory written by :class:`~lightning_async_pp.checkpoint.ShardedCheckpointIO`."""
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
    optimizer_only: bool = False,
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
        optimizer_only: Only the optimizer's entries (a replica that owns part of a sharded optimizer state,
            whose weights another replica writes).
    """
    aliases = aliases or {}
    shard: dict[str, Any] = {}
    if not optimizer_only:
        shard.update({MODEL_PREFIX + name: tensor for name, tensor in state_dict.items()})
    if optimizer is None:
        return shard
    for name, tensor in (previous or {}).items() if not optimizer_only else ():
        shard[PREVIOUS_PREFIX + aliases.get(name, name)] = tensor
    names = {id(p): aliases.get(n, n) for n, p in module.named_parameters()}
    for group in optimizer.param_groups:
        hyperparameters = {k: v for k, v in group.items() if k not in NOT_HYPERPARAMETERS}
        for param in group["params"]:
            name = names[id(param)]
            shard[GROUP_PREFIX + name] = hyperparameters
            for key, value in optimizer.state.get(param, {}).items():
                shard[f"{STATE_PREFIX}{name}.{key}"] = value
    if not optimizer_only:
        shard[f"{RNG_PREFIX}{stage}"] = rng_state()
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
    """Restore the generators from :func:`rng_state`'s ``state``."""
    import numpy as np

    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, position, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --- what a stage reads ------------------------------------------------------------------------------


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
    # A name the checkpoint lacks is left as it is (``strict_loading=False``; otherwise refused before, by compat).
    targets: dict[str, Any] = {MODEL_PREFIX + n: t for n, t in state_dict.items() if MODEL_PREFIX + n in available}
    names: dict[int, str] = {}
    if optimizer is not None:
        training, names = _training_targets(index, module, optimizer, previous, stage, aliases or {})
        targets.update(training)
    check_shard_files(path, index, targets)
    planner = SafeLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    no_dist = not (dist.is_available() and dist.is_initialized())
    try:
        dcp.load(
            targets, storage_reader=SafeReader(path), planner=planner, process_group=process_group, no_dist=no_dist
        )
    except (Exception, CheckpointException) as error:  # CheckpointException is a BaseException
        files = ", ".join(shard_files(index, targets))
        raise RuntimeError(
            f"Could not read the checkpoint {path} (stage {stage} reads {files}): a shard is damaged or unreadable "
            f"({type(error).__name__}: {error}). Resume from another checkpoint."
        ) from error
    if optimizer is not None:
        _restore_training(optimizer, names, planner.state_dict, stage)


def restore_stage(
    entries: dict[str, Any],
    *,
    state_dict: dict[str, Tensor],
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    previous: dict[str, Tensor] | None,
    stage: int,
    aliases: dict[str, str] | None = None,
) -> None:
    """:func:`load_stage` from entries already in memory, under the sharded form's keys (a one-file checkpoint's,
    see :func:`~lightning_async_pp.checkpoint.single_file.sharded_entries`): this stage's weights, and with an
    ``optimizer`` its ``w[t-1]``, optimizer state and RNG, copied in place."""
    with torch.no_grad():
        for name, tensor in state_dict.items():
            if MODEL_PREFIX + name in entries:
                tensor.copy_(entries[MODEL_PREFIX + name])
        if optimizer is None:
            return
        aliases = aliases or {}
        for name, tensor in (previous or {}).items():
            key = PREVIOUS_PREFIX + _saved_name(name, aliases, entries)
            if key in entries:
                tensor.copy_(entries[key])
    names = {id(p): _saved_name(n, aliases, entries) for n, p in module.named_parameters()}
    _restore_training(optimizer, names, entries, stage)


def _restore_training(
    optimizer: torch.optim.Optimizer, names: dict[int, str], loaded: dict[str, Any], stage: int
) -> None:
    _load_optimizer(optimizer, names, loaded)
    rng = loaded.get(f"{RNG_PREFIX}{stage}")
    if rng is not None:
        set_rng_state(rng)


def _saved_name(name: str, aliases: dict[str, str], available: Any) -> str:
    """The name a parameter's training state is saved under: its first name's shared entry, or, in a checkpoint that
    has none (saved before tied copies shared one), the copy's own."""
    canonical = aliases.get(name, name)
    if canonical == name or GROUP_PREFIX + canonical in available or PREVIOUS_PREFIX + canonical in available:
        return canonical
    return name


def _training_targets(
    index: Metadata,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    previous: dict[str, Tensor] | None,
    stage: int,
    aliases: dict[str, str],
) -> tuple[dict[str, Any], dict[int, str]]:
    """What a stage reads besides its weights (``w[t-1]``, optimizer state, RNG), and its parameters' saved names."""
    available = index.state_dict_metadata
    targets: dict[str, Any] = {}

    def saved_name(name: str) -> str:
        return _saved_name(name, aliases, available)

    for name, tensor in (previous or {}).items():
        if PREVIOUS_PREFIX + saved_name(name) in available:
            targets[PREVIOUS_PREFIX + saved_name(name)] = tensor
    names = {id(p): saved_name(n) for n, p in module.named_parameters()}
    owned = {names[id(p)] for group in optimizer.param_groups for p in group["params"]}
    for key, md in available.items():
        if key.startswith(STATE_PREFIX):
            name = key[len(STATE_PREFIX) :].rpartition(".")[0]
            if name in owned:
                targets[key] = empty_like_saved(md)
        elif key.startswith(GROUP_PREFIX) and key[len(GROUP_PREFIX) :] in owned:
            targets[key] = None
    if f"{RNG_PREFIX}{stage}" in available:
        targets[f"{RNG_PREFIX}{stage}"] = None
    return targets, names


def _load_optimizer(optimizer: torch.optim.Optimizer, names: dict[int, str], loaded: dict[str, Any]) -> None:
    """Turn the name-keyed state back into ``optimizer.load_state_dict``'s index-keyed form."""
    current = optimizer.state_dict()
    per_param: dict[str, dict[str, Any]] = {}
    for key, value in loaded.items():
        if key.startswith(STATE_PREFIX):
            name, _, field = key[len(STATE_PREFIX) :].rpartition(".")
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
                hyperparameters = loaded.get(GROUP_PREFIX + name)
            index += 1
        restored = dict(saved_group)
        if hyperparameters is not None:
            restored.update({k: v for k, v in hyperparameters.items() if k not in NOT_HYPERPARAMETERS})
        groups.append(restored)
    optimizer.load_state_dict({"state": state, "param_groups": groups})
