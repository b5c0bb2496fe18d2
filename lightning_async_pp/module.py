"""``PipelineModule``: a ``LightningModule`` written as a pipeline, that also runs without one.

A subclass implements the pipeline contract (see :mod:`lightning_async_pp.runtime.contract`) and
``configure_optimizers``; everything Lightning calls is derived from it:

- ``forward(x)`` runs ``pipeline_layers()`` in order;
- ``training_step`` computes ``pipeline_loss(forward(pipeline_inputs(batch)), batch)`` and logs ``train/loss``,
  and ``train/aux_loss`` when layers attach auxiliary losses (:mod:`lightning_async_pp.runtime.auxiliary`);
- ``validation_step``, ``test_step`` and ``predict_step`` run the layers and hand the last layer's output to
  ``pipeline_validation_step``, ``pipeline_test_step`` and ``pipeline_predict_step``: by default they log
  ``val/loss`` and ``test/loss`` from ``pipeline_loss`` and return the output as the prediction.

With several stages ``AsyncPipelineStrategy`` calls the same ``pipeline_*_step`` hooks on the last stage with
the output of the pipeline, so the module behaves the same under the strategy, with ``strategy="ddp"`` and on
one device without the strategy.
"""

from __future__ import annotations

from typing import Any, Literal

from lightning.pytorch import LightningModule
from torch import Tensor

from lightning_async_pp.runtime.auxiliary import AuxiliaryLosses
from lightning_async_pp.runtime.contract import run_layers

__all__ = ["PipelineModule", "pipeline_evaluation_step"]

Kind = Literal["validation", "test", "predict"]
LOSS_TAGS = {"validation": "val/loss", "test": "test/loss"}


def default_evaluation_step(module: LightningModule, kind: Kind, output: Tensor, batch: Any) -> Any:
    """What an evaluation does with the last layer's output when the module defines no hook of its own."""
    if kind == "predict":
        return output
    loss = module.pipeline_loss(output, batch)
    module.log(LOSS_TAGS[kind], loss, prog_bar=kind == "validation")
    return loss


def pipeline_evaluation_step(module: LightningModule, kind: Kind, output: Tensor, batch: Any, batch_idx: int) -> Any:
    """Call ``module.pipeline_{kind}_step(output, batch, batch_idx)``, or the default when it is not defined.

    Args:
        module: A module with the pipeline contract (it need not subclass :class:`PipelineModule`).
        kind: ``"validation"``, ``"test"`` or ``"predict"``.
        output: The last layer's output for ``batch``.
        batch: The (whole) evaluation batch.
        batch_idx: Its index, as Lightning passes it.
    """
    hook = getattr(module, f"pipeline_{kind}_step", None)
    if callable(hook):
        return hook(output, batch, batch_idx)
    return default_evaluation_step(module, kind, output, batch)


class PipelineModule(LightningModule):
    """A ``LightningModule`` defined by ``pipeline_layers``, ``pipeline_inputs`` and ``pipeline_loss``.

    Implement those three and ``configure_optimizers``; ``forward``, ``training_step``, ``validation_step``,
    ``test_step`` and ``predict_step`` follow from them, so the module trains as a pipeline with
    ``AsyncPipelineStrategy``, data-parallel with ``strategy="ddp"``, or on one device. Override
    ``pipeline_validation_step``, ``pipeline_test_step`` or ``pipeline_predict_step`` to change what an
    evaluation does with the last layer's output (they run on the last stage of a pipeline).

    Example::

        class MLP(PipelineModule):
            def __init__(self):
                super().__init__()
                self.layers = nn.ModuleList([nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2)])

            def pipeline_layers(self):
                return self.layers

            def pipeline_inputs(self, batch):
                return batch[0]

            def pipeline_loss(self, output, batch):
                return F.cross_entropy(output, batch[1])

            def configure_optimizers(self):
                return torch.optim.AdamW(self.parameters())
    """

    def pipeline_layers(self) -> Any:
        """The model's layers in execution order (each maps a tensor, or a tuple/list/dict of tensors, to the next)."""
        raise NotImplementedError(f"{type(self).__name__} must define `pipeline_layers()`.")

    def pipeline_inputs(self, batch: Any) -> Tensor:
        """The tensor fed to the first layer, taken from a (micro-)batch."""
        raise NotImplementedError(f"{type(self).__name__} must define `pipeline_inputs(batch)`.")

    def pipeline_loss(self, output: Tensor, batch: Any) -> Tensor:
        """Scalar loss, averaged over the (micro-)batch, from the last layer's output."""
        raise NotImplementedError(f"{type(self).__name__} must define `pipeline_loss(output, batch)`.")

    def forward(self, x: Any, batch: Any = None) -> Any:
        """Run every layer of ``pipeline_layers()`` in order on the first layer's input ``x`` (layers that read
        the micro-batch get ``batch``)."""
        return run_layers(self.pipeline_layers(), x, batch)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        """The loss of ``batch``, logged as ``train/loss``, and the sum of the auxiliary losses the layers
        attached (a router's load-balancing loss), as ``train/aux_loss``: what ``AsyncPipelineStrategy``
        logs, too."""
        # Lightning divides the loss by accumulate_grad_batches before the backward: the attached losses are
        # scaled alike, as the strategy scales both by 1 / (accumulate_grad_batches x micro-batches). (Called
        # without a trainer: 1.)
        accumulated = self._trainer.accumulate_grad_batches if self._trainer is not None else 1
        with AuxiliaryLosses(1 / accumulated) as aux:
            loss = self.pipeline_loss(self(self.pipeline_inputs(batch), batch), batch)
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=False)
        if (total := aux.total()) is not None:
            self.log("train/aux_loss", total, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        return self.pipeline_validation_step(self(self.pipeline_inputs(batch), batch), batch, batch_idx)

    def test_step(self, batch: Any, batch_idx: int) -> Any:
        return self.pipeline_test_step(self(self.pipeline_inputs(batch), batch), batch, batch_idx)

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        return self.pipeline_predict_step(self(self.pipeline_inputs(batch), batch), batch, batch_idx)

    def pipeline_validation_step(self, output: Tensor, batch: Any, batch_idx: int) -> Any:
        """Validation on the last layer's output; default: log ``val/loss`` from ``pipeline_loss``."""
        return default_evaluation_step(self, "validation", output, batch)

    def pipeline_test_step(self, output: Tensor, batch: Any, batch_idx: int) -> Any:
        """Testing on the last layer's output; default: log ``test/loss`` from ``pipeline_loss``."""
        return default_evaluation_step(self, "test", output, batch)

    def pipeline_predict_step(self, output: Tensor, batch: Any, batch_idx: int) -> Any:
        """The prediction for ``batch`` from the last layer's output; default: the output itself."""
        return default_evaluation_step(self, "predict", output, batch)
