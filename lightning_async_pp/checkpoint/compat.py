"""Whether a path is a checkpoint at all and whether it can continue this run, and fitting rank 0's saved
scheduler states to this rank."""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.types import _PATH
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from lightning_async_pp.checkpoint.layout import CHECKPOINT_KEY, META_FILE, MODEL_PREFIX, is_sharded_checkpoint
from lightning_async_pp.checkpoint.single_file import OPTIMIZER_NAMES

_PICKLE_PROTOCOL_2_OR_LATER = b"\x80"  # how torch's legacy (non-zip) format and any modern pickle begin

LAYOUT = (
    f"A checkpoint of this strategy is a directory (e.g. `epoch=0-step=100.ckpt/`, as ModelCheckpoint and "
    f"`trainer.save_checkpoint` write it) holding `.metadata`, `{META_FILE}` and one `__<rank>_0.distcp` file per "
    "saving rank; `lightning_async_pp consolidate` turns one into a single `torch.save` file, which can be "
    "loaded too."
)
"""What a checkpoint looks like, for messages about a path that is not one."""


_LIGHTNING_NAMES = ("best", "last", "hpc", "registry")
"""``ckpt_path`` values Lightning resolves itself, in every process (``registry:<name>`` too)."""


def check_checkpoint_path(path: _PATH) -> None:
    """Refuse a ``ckpt_path`` that is not a checkpoint, saying what a checkpoint looks like: a path that does not
    exist, a directory without DCP's index (``.metadata``), or a file that no ``torch.save`` wrote.

    Only the first bytes of a file are read, so it is cheap enough to run in the main process before any other
    starts. Lightning's names (``"last"``, ``"best"``, ``"hpc"``, ``"registry..."``) and URLs are left to Lightning.

    Args:
        path: The ``ckpt_path`` given to ``fit``, ``validate``, ``test`` or ``predict``.

    Raises:
        FileNotFoundError: If ``path`` does not exist.
        ValueError: If ``path`` is a directory that is not a checkpoint of this strategy, or a file that neither
            ``torch.save`` format could have written.
    """
    text = str(path)
    if text.lower() in _LIGHTNING_NAMES or text.lower().startswith("registry:") or "://" in text:
        return
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"ckpt_path={text!r} does not exist. Give the path of a saved checkpoint (ModelCheckpoint writes them "
            "into the `checkpoints/` folder of the run's log directory), or leave ckpt_path unset to start anew."
        )
    if path.is_dir():
        if is_sharded_checkpoint(path):
            return
        raise ValueError(
            f"ckpt_path={text!r} is a directory without `.metadata`: not a checkpoint of this strategy. {LAYOUT}"
        )
    with open(path, "rb") as file:
        start = file.read(1)
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            if any(name.endswith("data.pkl") for name in archive.namelist()):
                return
    elif start == _PICKLE_PROTOCOL_2_OR_LATER:
        return
    raise ValueError(f"ckpt_path={text!r} is not a checkpoint of this strategy (nor a torch.save file). {LAYOUT}")


def saved_shapes(index: Metadata) -> dict[str, tuple]:
    """The names and shapes of the weights a sharded checkpoint holds, from its DCP index."""
    return {
        key[len(MODEL_PREFIX) :]: tuple(md.size)
        for key, md in index.state_dict_metadata.items()
        if key.startswith(MODEL_PREFIX) and isinstance(md, TensorStorageMetadata)
    }


def check_compatible(
    path: _PATH,
    info: dict[str, Any],
    saved: dict[str, tuple],
    schedule: str,
    model_shapes: dict[str, tuple],
    strict: bool = True,
) -> None:
    """Refuse a checkpoint that cannot continue this run, saying what differs. Every rank decides alike.

    Args:
        path: The checkpoint (for the message).
        info: The checkpoint's ``"async_pp"`` record.
        saved: Names and shapes of the weights it holds (:func:`saved_shapes` of a directory).
        schedule: This run's schedule.
        model_shapes: Names and shapes of the whole model's state dict (all stages).
        strict: ``LightningModule.strict_loading``: with ``False``, names missing on either side are allowed (a
            new head to fine-tune); other shapes are refused either way, as ``load_state_dict`` does.
    """
    saved_schedule = info.get("schedule")
    if info.get("has_training_state") and saved_schedule != schedule:
        raise ValueError(
            f"The checkpoint {path} was saved by a schedule={saved_schedule!r} run; this run uses "
            f"schedule={schedule!r}. The weight versions and optimizer state of one schedule do not continue the "
            f"other: set `schedule={saved_schedule!r}`, or start a new run from the weights only."
        )
    missing = sorted(set(model_shapes) - set(saved)) if strict else []
    unexpected = sorted(set(saved) - set(model_shapes)) if strict else []
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
        fix = ""
        if missing or unexpected:
            fix = " (or set `strict_loading = False` on the LightningModule to load what matches)"
        raise ValueError(
            f"The checkpoint {path} holds another model than this one ({'; '.join(details)}). Build the model with "
            f"the configuration it was saved with{fix}."
        )


def check_named_optimizer_state(path: _PATH, checkpoint: dict[str, Any]) -> None:
    """Refuse a single file whose optimizer state cannot be given to each stage: ``optimizer_states`` numbered by
    position, without the record's names of those positions (a file another strategy wrote), read by several
    processes or by name."""
    if checkpoint.get("optimizer_states") and OPTIMIZER_NAMES not in checkpoint.get(CHECKPOINT_KEY, {}):
        raise ValueError(
            f"The checkpoint {path} holds optimizer state without the parameter names that give each stage its "
            "part (another strategy wrote it). Resume it on one device, or start from its weights: "
            "`model.load_state_dict(torch.load(path)['state_dict'])` before `fit` without ckpt_path."
        )


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
