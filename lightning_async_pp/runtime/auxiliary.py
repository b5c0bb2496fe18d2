"""PLACEHOLDER until the integrator's runtime/auxiliary.py lands on main (same API); deleted at the merge."""

from __future__ import annotations

import torch
from torch import Tensor

_ACTIVE: list[AuxiliaryLosses] = []


class AuxiliaryLosses:
    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale
        self._losses: list[Tensor] = []

    def __enter__(self) -> AuxiliaryLosses:
        _ACTIVE.append(self)
        return self

    def __exit__(self, *args) -> None:
        _ACTIVE.remove(self)

    def record(self, loss: Tensor) -> None:
        self._losses.append(loss.detach())

    def total(self) -> Tensor | None:
        return torch.stack(self._losses).sum() if self._losses else None


class _Attach(torch.autograd.Function):
    @staticmethod
    def forward(ctx, output: Tensor, loss: Tensor, coefficient: float) -> Tensor:
        ctx.coefficient = coefficient
        ctx.loss_shape = loss.shape
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, grad.new_full(ctx.loss_shape, ctx.coefficient), None


def attach_auxiliary_loss(output: Tensor, loss: Tensor, weight: float = 1.0) -> Tensor:
    collector = _ACTIVE[-1] if _ACTIVE else None
    if collector is not None:
        collector.record(loss)
    if not (output.requires_grad or loss.requires_grad) or not torch.is_grad_enabled():
        return output
    scale = collector.scale if collector is not None else 1.0
    return _Attach.apply(output, loss, weight * scale)
