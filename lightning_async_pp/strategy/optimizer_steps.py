"""Lightning's optimizer steps under the strategy: the batches of one step, and optimizers that re-evaluate closures.

**Gradient accumulation.** With ``Trainer(accumulate_grad_batches=k)`` Lightning runs the training step and the
backward of ``k`` batches (a *window*) and calls the optimizer step on the last of them, or on the last batch of an
epoch; it divides each batch's loss by ``k``. The strategy makes a window one optimizer step of ``k x M``
micro-batches, each weighed ``1 / (k x M)``: the one-step delay of 2BW counts optimizer steps, so every micro-batch
of step ``t`` computes its gradient on ``w[t-1]``, exactly as a run of batches ``k`` times larger with ``k x M``
micro-batches would.

- On one device Lightning accumulates as usual: the batches before the last run inside the strategy's
  ``block_backward_sync``, where :class:`~lightning_async_pp.strategy.single_device.SingleDevice` swaps ``w[t-1]`` in
  (2BW), and the last inside the optimizer step's delayed closure.
- With several processes :class:`AccumulationWindow` holds a window's batches until Lightning's optimizer step,
  which runs them as one step of the stage runtime (its
  :meth:`~lightning_async_pp.runtime.stage.StageRuntime.run_step` takes several batches). A window shorter than
  ``k`` (the end of an epoch) is a step of fewer micro-batches: the pipeline drains before it and after it.

``train/loss`` is the mean over the window's micro-batches, logged at the optimizer step. A checkpoint saved inside
a window (a validation or a save between its batches) holds the weights, not the window's first batches: resuming
from it is refused (:meth:`AccumulationWindow.add`), as is a window started mid-way otherwise.

**Closures.** An optimizer that evaluates its closure several times per step (``LBFGS``, line searches) has no
delayed trajectory, and a pipeline stage steps its optimizer without a closure: :func:`check_closure_use` refuses
both. Synchronous training on one device (``"1f1b"``) runs such an optimizer as Lightning does.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor
from torch.optim import Optimizer

__all__ = ["DELAYED_STEP", "STAGE_STEP", "AccumulationWindow", "check_closure_use", "needs_closure"]

DELAYED_STEP = "the one-step delay of schedule='2bw' computes one gradient per step"
"""Why an optimizer step under 2BW evaluates the closure once (:func:`check_closure_use`)."""
STAGE_STEP = "a pipeline stage steps its optimizer once, without a closure, inside its step"
"""Why a pipeline stage's optimizer step has no closure (:func:`check_closure_use`)."""


class AccumulationWindow:
    """The batches of the optimizer step Lightning is accumulating, from the first training step of the window to
    the optimizer step that ends it."""

    def __init__(self) -> None:
        self.size = 1
        """``accumulate_grad_batches`` of the window (what each batch's loss is divided by)."""
        self.stepping = False
        """Whether Lightning's optimizer step is running: its training step is the window's last."""
        self._batches: dict[int, Any] = {}
        self._automatic = True
        self._losses: dict[int, tuple[Tensor, Tensor | None]] = {}

    def add(self, batch: Any, trainer: Trainer) -> None:
        """A training step of ``batch``, the current batch of ``trainer``'s epoch.

        A batch whose index ``accumulate_grad_batches`` divides starts a window (where Lightning zeroes the
        gradients); a batch evaluated again (an optimizer's repeated closure) replaces itself.

        Raises:
            MisconfigurationException: The window started before this run (a resumed checkpoint saved inside it).
        """
        self.size = trainer.accumulate_grad_batches
        self._automatic = trainer.lightning_module.automatic_optimization
        index = trainer.fit_loop.epoch_loop.batch_idx
        if index % self.size == 0:
            self.clear()
        elif not self._batches:
            raise MisconfigurationException(
                f"Training resumed at batch {index} of the epoch, inside a window of accumulate_grad_batches="
                f"{self.size} whose first {index % self.size} batch(es) ran before the checkpoint was saved: their "
                "gradients are not in the checkpoint, so the step would be computed from part of its batches. Resume "
                "from a checkpoint saved at an optimizer step (ModelCheckpoint(every_n_train_steps=...), or "
                "`val_check_interval` a multiple of accumulate_grad_batches)."
            )
        self._batches[index] = batch

    @property
    def complete(self) -> bool:
        """Whether the current batch ends the window: it runs in Lightning's optimizer step (every batch under
        manual optimization, which Lightning does not accumulate)."""
        return self.stepping or not self._automatic

    @property
    def batches(self) -> list[Any]:
        """The window's batches so far, in order."""
        return [self._batches[index] for index in sorted(self._batches)]

    def record(self, batch_losses: Tensor, aux: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """Keep the current batch's detached micro-batch losses (and auxiliary loss); returns the means over the
        window so far, which the optimizer step's batch logs."""
        index = max(self._batches)
        self._losses[index] = (batch_losses, aux)
        recorded = [self._losses[i] for i in sorted(self._losses)]
        loss = torch.cat([losses for losses, _ in recorded]).mean()
        auxes = [a for _, a in recorded if a is not None]
        return loss, (torch.cat(auxes).mean() if auxes else None)

    @contextlib.contextmanager
    def optimizer_step(self) -> Iterator[None]:
        """Around Lightning's optimizer step (its closure runs the window's last training step); the window ends."""
        self.stepping = True
        try:
            yield
        finally:
            self.stepping = False
            self.clear()

    def clear(self) -> None:
        self._batches.clear()
        self._losses.clear()


def needs_closure(optimizer: Optimizer) -> bool:
    """Whether ``optimizer.step`` cannot run without a closure (``LBFGS``: it evaluates it several times a step)."""
    closure = inspect.signature(optimizer.step).parameters.get("closure")
    return closure is not None and closure.default is inspect.Parameter.empty


def check_closure_use(optimizer: Optimizer, where: str) -> None:
    """Refuse an optimizer that needs its closure where the strategy steps it with at most one evaluation.

    Args:
        optimizer: The optimizer ``configure_optimizers`` returned.
        where: Why the closure cannot be re-evaluated there (completes the message).

    Raises:
        MisconfigurationException: Naming the optimizer and what to change.
    """
    if needs_closure(optimizer):
        name = type(optimizer).__name__
        raise MisconfigurationException(
            f"`{name}.step` needs a closure that it evaluates several times per step, and {where}. Use an optimizer "
            "that steps from one gradient (AdamW, SGD, Muon, ...), or train on one device with schedule='1f1b', where "
            f"`{name}` runs as with Lightning's own strategies."
        )
