"""The one-device path: the update rules of a pipeline without one, the reference a pipeline must match.

A pipeline-ready module's batch is split into micro-batches, each one's loss computed on its own and
back-propagated on its own, in order, as a pipeline stage does: the gradients then accumulate in the same
order and the two agree to the last bit. With ``"2bw"`` the gradient is taken on the previous weights
(:class:`~lightning_async_pp.reference.delayed.DelayedWeights`) and the optimizer steps the current ones.
It shares with the multi-process runtime only what defines the model's computation and the batch's cut
(``run_layers``, ``split_microbatches``, the recomputation helpers, the weight casts of
:mod:`~lightning_async_pp.runtime.casts`): no schedule, no weight versions, no transfers, so it is an
independent check of those.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import Strategy
from torch import Tensor
from torch.optim import Optimizer

from lightning_async_pp.reference.delayed import DelayedWeights
from lightning_async_pp.runtime.auxiliary import AuxiliaryLosses
from lightning_async_pp.runtime.casts import WeightCasts, autocast_dtype
from lightning_async_pp.runtime.contract import is_pipeline_module, require_pipeline_module, run_layers
from lightning_async_pp.runtime.finite import check_finite_losses
from lightning_async_pp.runtime.microbatch import split_microbatches
from lightning_async_pp.runtime.recompute import checkpoint_layers, select_layers
from lightning_async_pp.schedule import get_schedule
from lightning_async_pp.strategy.optimizer_steps import DELAYED_STEP, AccumulationWindow, check_closure_use

__all__ = ["SingleDevice", "microbatch_losses"]


def microbatch_losses(
    module: LightningModule,
    batch: Any,
    num_microbatches: int,
    around: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    aux_losses: list[Tensor] | None = None,
    accumulation: int = 1,
) -> list[Tensor]:
    """The loss of each of ``num_microbatches`` micro-batches of ``batch``, each through the whole model, each
    forward inside ``around()``.

    Auxiliary losses the layers attach are scaled as a stage's (``1/(accumulation * num_microbatches)``, with
    ``accumulation`` batches per optimizer step); each micro-batch's total is appended to ``aux_losses`` when
    given (see :mod:`~lightning_async_pp.runtime.auxiliary`).
    """
    layers = module.pipeline_layers()
    losses = []
    for mb in split_microbatches(batch, num_microbatches):
        with around(), AuxiliaryLosses(1 / (accumulation * num_microbatches)) as aux:
            losses.append(module.pipeline_loss(run_layers(layers, module.pipeline_inputs(mb), mb), mb))
        if aux_losses is not None and (total := aux.total()) is not None:
            aux_losses.append(total)
    return losses


class SharedCasts:
    """A factory of the context that gives the forwards of one call of :func:`microbatch_losses` one cast of
    each weight autocast would cast (see :mod:`~lightning_async_pp.runtime.casts`), made at the first forward
    of that call (each call is one step, with its own weights). An object, not a closure, so that a fitted
    Trainer can be pickled."""

    def __init__(self, module: LightningModule, precision_plugin: Precision) -> None:
        self.params = {name: p for name, p in module.named_parameters() if p.requires_grad}
        device_type = next(iter(self.params.values())).device.type if self.params else "cpu"
        dtype = autocast_dtype(precision_plugin.forward_context, device_type)
        self.casts = WeightCasts(module, list(self.params), dtype, device_type)
        self.calls = 0

    def __call__(self) -> Callable[[], WeightCasts]:
        """The context of the next step's forwards."""
        self.calls += 1
        return functools.partial(self.casts, self.params, self.calls)


class SingleDevice:
    """Training state of the one-device path: the micro-batch losses awaiting their backward, and ``w[t-1]``."""

    def __init__(self, window: AccumulationWindow) -> None:
        self.window = window
        """The batches of the optimizer step being accumulated (the strategy's)."""
        self.delayed: DelayedWeights | None = None
        self.losses: list[Tensor] | None = None
        self.divisor = 1
        """What the micro-batch losses of the current batch are divided by in the backward."""
        self.delay = 0
        self._casts: SharedCasts | None = None
        self.module: LightningModule | None = None

    def setup(
        self, module: LightningModule, num_microbatches: int, activation_checkpointing: Any, schedule: str
    ) -> None:
        """Check that ``module`` can be split into ``num_microbatches``; wrap its recomputed layers; take the delay
        of ``schedule``'s one-device run (``1``: gradients on ``w[t-1]``)."""
        if num_microbatches > 1 and not is_pipeline_module(module):
            require_pipeline_module(module, f"needed to split batches into num_microbatches={num_microbatches}")
        if activation_checkpointing is not False:
            layers = list(module.pipeline_layers())
            checkpoint_layers(layers, select_layers(layers, activation_checkpointing))
        self._casts = None  # built at the first step, on the module's device
        self.delay = get_schedule(schedule).reference_delay
        self.module = module

    def training_step(
        self, module: LightningModule, batch: Any, num_microbatches: int, precision_plugin: Precision
    ) -> Tensor:
        """The batch's loss as the mean of its micro-batches' losses; the micro-batch losses are kept for
        :meth:`backward`. Logs ``train/loss``, the mean over the micro-batches of the optimizer step's
        :attr:`window` so far (at its last batch, the step's)."""
        window = self.window
        if self._casts is None:
            self._casts = SharedCasts(module, precision_plugin)
        around = self._casts()  # the step's forwards share one cast of each weight
        aux: list[Tensor] = []
        self.divisor = window.size * num_microbatches
        with precision_plugin.train_step_context():
            self.losses = microbatch_losses(module, batch, num_microbatches, around, aux, window.size)
        losses = torch.stack([loss.detach() for loss in self.losses])
        check_finite_losses(losses, module.trainer.global_step, stage=0)
        logged, aux_logged = window.record(losses, torch.stack(aux) if aux else None)
        if aux_logged is not None:
            module.log("train/aux_loss", aux_logged, on_step=True, on_epoch=False)
        module.log("train/loss", logged, prog_bar=True, on_step=True, on_epoch=False)
        return torch.stack(self.losses).mean()

    def backward(
        self, strategy: Strategy, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> Tensor | None:
        """One backward per micro-batch, in order, as a pipeline stage does; ``None`` when
        :meth:`training_step` left no losses (the module's own ``training_step`` ran: back-propagate as usual).

        Args:
            strategy: The strategy, whose ``pre_backward``/``post_backward`` and precision plugin run around it.
            closure_loss: The step's loss (the micro-batches' mean, divided by ``accumulate_grad_batches``).
            optimizer: The optimizer, as Lightning passes it.
        """
        losses, self.losses = self.losses, None
        if losses is None:
            return None
        module, precision = strategy.lightning_module, strategy.precision_plugin
        strategy.pre_backward(closure_loss)
        closure_loss = precision.pre_backward(closure_loss, module)
        for loss in losses:
            # Each micro-batch weighs 1 / (k * M) in the step of k accumulated batches, as Lightning's 1 / k.
            precision.backward(loss / self.divisor, module, optimizer, *args, **kwargs)
        closure_loss = precision.post_backward(closure_loss, module)
        strategy.post_backward(closure_loss)
        return closure_loss

    def delayed_weights(self, module: LightningModule) -> DelayedWeights:
        """``w[t-1]`` of ``module``, ``w[-1] = w[0]`` until the first step."""
        if self.delayed is None:
            self.delayed = DelayedWeights(module)
        return self.delayed

    def wrap(self, optimizer: Optimizer, closure: Callable[[], Any]) -> Callable[[], Any]:
        """The closure of an optimizer step: with a delay, ``closure`` (forward and backward) run on ``w[t-1]``, the
        parameters back on ``w[t]`` afterwards, and ``w[t-1]`` advanced."""
        if not self.delay:
            return closure
        check_closure_use(optimizer, DELAYED_STEP)
        return self.delayed_weights(self.module).wrap_closure(closure)

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """Around a batch of an accumulation window before its last (Lightning runs those in the strategy's
        ``block_backward_sync``): with a delay its gradient is taken on ``w[t-1]``, as the last batch's is in
        :meth:`wrap`."""
        if not self.delay:
            yield
            return
        with self.delayed_weights(self.module).delayed():
            yield
