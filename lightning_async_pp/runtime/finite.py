"""Whether a step's losses are finite, learnt without making the host wait for the device."""

from __future__ import annotations

import collections

import torch
from torch import Tensor

from lightning_async_pp.runtime.host_flag import HostFlag

__all__ = ["FiniteCheck", "check_finite_losses", "read_finite_checks"]


class FiniteCheck:
    """Whether one step's losses are all finite, learnt without making the host wait for the device.

    The flag is computed on the device and copied into host memory (pinned on CUDA) without blocking;
    :meth:`ready` asks a CUDA event whether the copy has landed, and :meth:`raise_if_not_finite` waits for it
    (a no-op once ready) and raises :func:`check_finite_losses`'s error if a loss was NaN or infinite.

    Args:
        losses: The step's per-micro-batch losses (on the stage's device).
        step: The step, for the error message.
        stage: The stage that computed them, for the error message.
    """

    def __init__(self, losses: Tensor, step: int, stage: int) -> None:
        self.losses, self.step, self.stage = losses, step, stage
        self._not_finite = HostFlag(~torch.isfinite(losses).all())

    def ready(self) -> bool:
        return self._not_finite.ready()

    def raise_if_not_finite(self) -> None:
        if self._not_finite.get():
            check_finite_losses(self.losses, self.step, self.stage)


def read_finite_checks(checks: collections.deque[FiniteCheck], wait_beyond: int) -> None:
    """Raise for a non-finite loss the device has reported; wait for flags older than ``wait_beyond`` steps."""
    while checks and (len(checks) > wait_beyond or checks[0].ready()):
        checks.popleft().raise_if_not_finite()


def check_finite_losses(losses: Tensor, step: int, stage: int) -> None:
    """Raise ``FloatingPointError`` naming the step, stage and first micro-batch whose loss is NaN or infinite."""
    finite = torch.isfinite(losses)
    if bool(finite.all()):
        return
    microbatch = int((~finite).nonzero()[0])
    raise FloatingPointError(
        f"The loss of step {step}, micro-batch {microbatch} is {float(losses[microbatch])} (computed on pipeline "
        f"stage {stage}). Training stops here so that no stage applies a broken update. Lower the learning rate, "
        "set `gradient_clip_val`, or check the data of that step."
    )
