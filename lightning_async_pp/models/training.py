"""What the models share with the demo GPT in training: the learning-rate schedule and the step's logging."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule


def log_lr_and_throughput(module: LightningModule, tokens: int, start: float | None) -> None:
    """Log the learning rate and the tokens per second of the batch that started at ``start``.

    Args:
        module: The LightningModule, from ``on_train_batch_end``.
        tokens: Tokens in the batch.
        start: ``time.perf_counter()`` at the batch's start (``on_train_batch_start``); ``None`` logs the rate only.
    """
    module.log("train/lr", module.trainer.optimizers[0].param_groups[0]["lr"])
    if start is not None:
        module.log("train/tokens_per_sec", tokens / max(time.perf_counter() - start, 1e-9))


def with_lr_schedule(optimizer: torch.optim.Optimizer, module: LightningModule) -> Any:
    """``configure_optimizers``' answer for ``module.hparams.lr_schedule``: the optimizer alone (``"constant"``)
    or with a per-step linear warm-up and cosine decay over the trainer's estimated number of steps.

    Args:
        optimizer: The module's optimizer.
        module: A LightningModule whose ``hparams`` hold ``lr_schedule`` (``"constant"`` or ``"cosine"``) and, for
            ``"cosine"``, ``warmup_fraction`` and ``min_lr_ratio``.
    """
    hparams = module.hparams
    if hparams.lr_schedule == "constant":
        return optimizer
    total = max(1, int(module.trainer.estimated_stepping_batches))
    factor = cosine_with_warmup(total, hparams.warmup_fraction, hparams.min_lr_ratio)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def cosine_with_warmup(total_steps: int, warmup_fraction: float = 0.1, min_ratio: float = 0.1):
    """Learning-rate factor for ``LambdaLR``: linear warm-up, then cosine decay to ``min_ratio``.

    Args:
        total_steps: Steps of the whole schedule.
        warmup_fraction: Share of the steps spent in linear warm-up.
        min_ratio: The factor at the end.
    """
    warmup = int(total_steps * warmup_fraction)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor
