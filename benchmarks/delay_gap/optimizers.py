"""The optimizer of a run: AdamW, Muon, SOAP or Adan, wrapped in ``DelayCorrected`` for the corrected modes."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_async_pp.optim import DelayCorrected, Muon

from .spec import OPTIMIZERS, RunSpec


def _unnamed(named: list[tuple[str, Tensor]] | list[dict[str, Any]]) -> list[Tensor] | list[dict[str, Any]]:
    """The parameters without their names, in the groups they came in."""
    if named and isinstance(named[0], dict):
        return [{**group, "params": [p for _, p in group["params"]]} for group in named]
    return [p for _, p in named]


def base_optimizer(spec: RunSpec, named: list[tuple[str, Tensor]] | list[dict[str, Any]]) -> Optimizer:
    """The uncorrected optimizer of ``spec`` over the named parameters.

    Args:
        spec: The run; its ``optimizer``, ``lr``, ``momentum`` and ``weight_decay`` are used.
        named: The model's ``(name, parameter)`` pairs (Muon routes by name), or groups of them (the demo GPT
            with experts puts its routers in a group of their own, tagged for Muon's AdamW part).

    Raises:
        ImportError: For SOAP and Adan without ``pytorch-optimizer`` (the ``research`` extra).
        ValueError: For an unknown optimizer name.
    """
    if spec.optimizer == "adamw":
        return torch.optim.AdamW(
            _unnamed(named), lr=spec.lr, betas=(spec.momentum, 0.95), weight_decay=spec.weight_decay
        )
    if spec.optimizer == "muon":
        # "match_rms_adamw" scales Muon's step to AdamW's RMS, so one learning rate serves both parts.
        return Muon(
            named,
            lr=spec.lr,
            weight_decay=spec.weight_decay,
            momentum=spec.momentum,
            adjust_lr_fn="match_rms_adamw",
            adamw_lr=spec.lr,
            adamw_betas=(0.9, 0.95),
            adamw_weight_decay=spec.weight_decay,
        )
    if spec.optimizer not in ("soap", "adan"):
        raise ValueError(f"Unknown optimizer {spec.optimizer!r}; use one of {OPTIMIZERS}.")
    try:
        import pytorch_optimizer
    except ImportError as error:
        raise ImportError(f"{spec.optimizer} needs the `research` extra: pip install -e '.[research]'") from error
    params = _unnamed(named)
    if spec.optimizer == "soap":  # every parameter, embeddings and head included, as in the paper
        return pytorch_optimizer.SOAP(params, lr=spec.lr, betas=(spec.momentum, 0.95), weight_decay=spec.weight_decay)
    return pytorch_optimizer.Adan(
        params, lr=spec.lr, betas=(spec.momentum, 0.92, 0.99), weight_decay=spec.weight_decay, weight_decouple=True
    )


def make_optimizer_factory(spec: RunSpec) -> Callable[[Iterable[tuple[str, Tensor]]], Optimizer]:
    """The ``optimizer`` callable of the demo GPT for ``spec``: named parameters in, optimizer out.

    Args:
        spec: The run; ``delayed_corrected`` wraps the optimizer in ``DelayCorrected(coefficient=spec.correction)``,
            ``delayed_auto`` in ``DelayCorrected(coefficient="auto")``.
    """

    def factory(named_parameters: Iterable[tuple[str, Tensor]]) -> Optimizer:
        base = base_optimizer(spec, list(named_parameters))
        if spec.mode == "delayed_corrected":
            return DelayCorrected(base, coefficient=spec.correction)
        if spec.mode == "delayed_auto":
            return DelayCorrected(base, coefficient="auto")
        return base

    return factory
