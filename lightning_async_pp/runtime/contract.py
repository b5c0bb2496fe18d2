"""What a model must say about itself to be cut into pipeline stages.

A pipeline-ready ``LightningModule`` is a flat, ordered list of layers, each a module that maps one tensor
to one tensor (or a tuple, list or dict of tensors to another, see below), plus two functions around them::

    x = module.pipeline_inputs(batch)           # on the first stage
    for layer in module.pipeline_layers():       # consecutive layers share a stage
        x = layer(x)
    loss = module.pipeline_loss(x, batch)        # on the last stage: a scalar, mean over the batch

The loss must be a mean over the (micro-)batch, so that averaging the losses of equal micro-batches gives
the loss of the whole batch. Two methods are optional:

- ``reset_pipeline_layer(index, layer)`` (re)initialises one layer by itself; a stage that materialises
  only its own layers from the meta device calls it (otherwise each submodule's ``reset_parameters()``).
- ``pipeline_validation_step(output, batch, batch_idx)``, ``pipeline_test_step(...)`` and
  ``pipeline_predict_step(...)`` run on the last stage during validation, testing and prediction with the last
  layer's output; by default the strategy logs ``val/loss`` or ``test/loss`` from ``pipeline_loss`` and
  predicts the output itself.

:class:`lightning_async_pp.PipelineModule` is a ``LightningModule`` base class that derives ``forward`` and
the ``*_step`` methods from this contract, so the module runs unchanged without the strategy.

What a layer returns may be several tensors: a tuple, a list or a dict with string keys. They travel to the
next stage together, in one message (:mod:`lightning_async_pp.runtime.activations`); the floating-point
ones that require grad get their gradients back, the others (token ids, masks) travel forward only.

A layer that needs more than the previous layer's output (attention masks, position ids) may read the
micro-batch itself: give it a class attribute ``reads_batch = True`` and it is called as
``layer(x, batch)``. Every stage holds every micro-batch, so such values are recomputed where they are
needed instead of travelling between stages.

Nothing is traced: the strategy calls these methods and nothing else, so what runs is what you wrote.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from torch import Tensor, nn

REQUIRED = ("pipeline_layers", "pipeline_inputs", "pipeline_loss")


@runtime_checkable
class PipelineContract(Protocol):
    """The pipeline contract, as a type. Implement these methods on your ``LightningModule``, or subclass
    :class:`lightning_async_pp.PipelineModule`, which also derives the ``*_step`` methods from them."""

    def pipeline_layers(self) -> Sequence[nn.Module]:
        """The model's layers in execution order (each maps a tensor, or a tuple/list/dict of tensors, to the next)."""

    def pipeline_inputs(self, batch: Any) -> Tensor:
        """The tensor fed to the first layer, taken from a (micro-)batch."""

    def pipeline_loss(self, output: Tensor, batch: Any) -> Tensor:
        """Scalar loss, averaged over the (micro-)batch, from the last layer's output."""


def is_pipeline_module(module: Any) -> bool:
    return all(callable(getattr(module, name, None)) for name in REQUIRED)


def require_pipeline_module(module: Any, reason: str) -> None:
    """Raise a ``TypeError`` that lists what is missing when ``module`` does not implement the contract."""
    missing = [name for name in REQUIRED if not callable(getattr(module, name, None))]
    if missing:
        raise TypeError(
            f"{type(module).__name__} does not implement the pipeline contract ({reason}): it lacks "
            f"{', '.join(missing)}. Define `pipeline_layers()`, `pipeline_inputs(batch)` and "
            "`pipeline_loss(output, batch)` on your LightningModule; see "
            "`lightning_async_pp.runtime.contract` and docs/user-guide.md."
        )


def reads_batch(layer: nn.Module) -> bool:
    """Whether ``layer`` is called as ``layer(x, batch)`` (it set ``reads_batch = True``)."""
    return bool(getattr(layer, "reads_batch", False))


def run_layers(layers: Sequence[nn.Module], x: Any, batch: Any = None) -> Any:
    """Run ``layers`` in order on ``x``; layers that read the batch get ``batch`` (``None`` when there is none)."""
    for layer in layers:
        x = layer(x, batch) if reads_batch(layer) else layer(x)
    return x


class StageModule(nn.Sequential):
    """Consecutive pipeline layers as one module, called as ``stage(x, batch)``."""

    def forward(self, x: Any, batch: Any = None) -> Any:
        return run_layers(self, x, batch)
