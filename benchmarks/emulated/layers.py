"""Layers that take a fixed time per forward, input gradient and weight gradient without using the CPU.

Each :class:`EmulatedLayer` computes ``y = x * w`` (``w`` a vector of ones, so values pass unchanged) through
two custom autograd functions, so that each of the three costs is its own autograd node:

* ``_WeightPath`` on the weight's branch: identity forward, its backward sleeps the weight-gradient time;
* ``_InputPath`` after the product: its forward sleeps the forward time, its backward the input-gradient time.

A full backward (``loss.backward()``, our runtime, torch's ``Schedule1F1B``) runs both sleeps. torch's split
backward (``stage_backward_input`` / ``stage_backward_weight`` in ``torch.distributed.pipelining``) asks autograd
for the stage input's gradient first: that walks ``_InputPath`` and the product's ``x`` edge only, never the
weight's branch, and keeps the product's node as the "intermediate" from which the later weight pass runs
the product's ``w`` edge and ``_WeightPath``. So the zero-bubble schedules really run the weight gradient apart.

Every sleep is timed on the process's :class:`SleepClock`: what the emulated devices were busy with.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

KINDS = ("forward", "input", "weight")


class SleepClock:
    """Sleeps on behalf of the emulated layers and adds up, per kind, how long they really slept."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(KINDS, 0.0)
        self.counts = dict.fromkeys(KINDS, 0)

    def sleep(self, seconds: float, kind: str) -> None:
        start = time.perf_counter()
        time.sleep(seconds)
        self.seconds[kind] += time.perf_counter() - start
        self.counts[kind] += 1

    def snapshot(self) -> dict[str, float]:
        return dict(self.seconds)


CLOCK = SleepClock()


def tighten_timer_slack() -> None:
    """Ask Linux to wake sleeps within 1 ns of their deadline instead of the default 50 us (``PR_SET_TIMERSLACK``),
    so that a 2.5 ms sleep lasts 2.5 ms and not 2.6; nothing where ``prctl`` is missing."""
    try:
        ctypes.CDLL(None).prctl(29, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


class _InputPath(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, forward_s: float, input_s: float) -> Tensor:
        CLOCK.sleep(forward_s, "forward")
        ctx.input_s = input_s
        return x.clone()

    @staticmethod
    def backward(ctx, grad: Tensor):
        CLOCK.sleep(ctx.input_s, "input")
        return grad, None, None


class _WeightPath(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w: Tensor, weight_s: float) -> Tensor:
        ctx.weight_s = weight_s
        return w.clone()

    @staticmethod
    def backward(ctx, grad: Tensor):
        CLOCK.sleep(ctx.weight_s, "weight")
        return grad, None


@dataclass(frozen=True)
class LayerCost:
    """Seconds one layer sleeps per micro-batch: forward, input gradient, weight gradient."""

    forward: float
    input: float
    weight: float

    @property
    def total(self) -> float:
        return self.forward + self.input + self.weight

    def scaled(self, factor: float) -> LayerCost:
        return LayerCost(self.forward * factor, self.input * factor, self.weight * factor)


class EmulatedLayer(nn.Module):
    """``y = x * w`` that sleeps ``cost.forward`` in forward, ``cost.input`` for the input gradient and
    ``cost.weight`` for the weight gradient (see the module's description).

    Args:
        width: Features per row (the last dimension of the activation); the weight has this many entries.
        cost: The layer's sleeps per micro-batch.
    """

    def __init__(self, width: int, cost: LayerCost) -> None:
        super().__init__()
        self.cost = cost
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: Tensor) -> Tensor:
        w = _WeightPath.apply(self.weight, self.cost.weight)
        return _InputPath.apply(x * w, self.cost.forward, self.cost.input)


def build_layers(width: int, costs: Sequence[LayerCost]) -> list[EmulatedLayer]:
    """One layer per entry of ``costs``, in order."""
    return [EmulatedLayer(width, cost) for cost in costs]


def emulated_loss(output: Tensor, target: Tensor) -> Tensor:
    """A scalar mean over the micro-batch, cheap next to the sleeps."""
    return (output * target).mean()
