"""Auxiliary losses (a mixture-of-experts router's load-balancing loss) that enter training through the backward.

A layer that computes an auxiliary loss returns ``attach_auxiliary_loss(output, loss, weight)`` instead of
``output``: the same values, and in the backward the gradient of ``weight * loss * scale`` joins the gradient
that reaches ``output``. ``scale`` is the weight the training loop gives the micro-batch's own loss (``1/M``
for a step of ``M`` micro-batches, as the pipeline's last stage back-propagates ``loss / M``; ``1/(k M)`` when
``k`` batches accumulate into one step), so the total
gradient is the one of ``mean over micro-batches of (model loss + weight * auxiliary loss)``. No loss value has
to travel down the pipeline: the stage that owns the layer adds its gradient (Megatron-LM attaches its
``MoEAuxLossAutoScaler`` the same way).

The loop that runs the forwards opens an :class:`AuxiliaryLosses` around each micro-batch's forward: it sets
``scale`` and records the detached losses, which the strategy logs as ``train/aux_loss``. Outside any
collector (a plain ``loss.backward()`` on one batch) ``scale`` is 1 and nothing is recorded. The scale is read
when the forward runs, so a recomputed forward (activation checkpointing, which reuses the first forward's
graph) keeps it.
"""

from __future__ import annotations

import contextvars
from typing import Any

import torch
from torch import Tensor

__all__ = ["AuxiliaryLosses", "attach_auxiliary_loss"]

_ACTIVE: contextvars.ContextVar[AuxiliaryLosses | None] = contextvars.ContextVar("auxiliary_losses", default=None)


class AuxiliaryLosses:
    """Collects the auxiliary losses attached during the forwards it is open around.

    Args:
        scale: The weight the training loop gives the loss of the forwards run inside (``1/M`` for one of
            ``M`` micro-batches).
    """

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = float(scale)
        self.losses: list[Tensor] = []
        self._token: contextvars.Token | None = None

    def __enter__(self) -> AuxiliaryLosses:
        self._token = _ACTIVE.set(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._token is not None
        _ACTIVE.reset(self._token)
        self._token = None

    def add(self, loss: Tensor) -> None:
        self.losses.append(loss.detach().reshape(()))

    def total(self) -> Tensor | None:
        """The sum of the recorded losses (a detached scalar on their device), ``None`` if none was recorded."""
        if not self.losses:
            return None
        return torch.stack([loss.to(self.losses[0].device, torch.float32) for loss in self.losses]).sum()


class _Attach(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, output: Tensor, loss: Tensor, factor: float) -> Tensor:
        ctx.factor = factor
        ctx.loss_dtype = loss.dtype
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        # d(factor * loss)/d(loss) = factor, whatever gradient reaches the output.
        return grad, torch.full((), ctx.factor, dtype=ctx.loss_dtype, device=grad.device), None


def attach_auxiliary_loss(output: Tensor, loss: Tensor, weight: float = 1.0) -> Tensor:
    """``output``, with ``weight * loss`` added to the training objective through the backward.

    Args:
        output: A tensor the rest of the forward uses (the layer's output). Its values are unchanged.
        loss: A scalar, differentiable auxiliary loss (recorded detached, without ``weight``, for logging).
        weight: Its coefficient in the objective (``router_aux_loss_coef``, ``aux_loss_coef``).
    """
    if loss.numel() != 1:
        raise ValueError(f"attach_auxiliary_loss takes a scalar loss; got a tensor of shape {tuple(loss.shape)}.")
    collector = _ACTIVE.get()
    if collector is not None:
        collector.add(loss)
    if not (torch.is_grad_enabled() and (output.requires_grad or loss.requires_grad)):
        return output
    scale = 1.0 if collector is None else collector.scale
    return _Attach.apply(output, loss, float(weight) * scale)
