"""Building a model for a pipeline with its layers on the meta device.

With several stages, ``trainer.init_module(empty_init=True)`` and ``configure_model`` build the model without
allocating its layers: each stage materialises only the layers it owns
(:func:`lightning_async_pp.strategy.placement.materialize`). Plain ``torch.device("meta")`` would put *every*
tensor on the meta device, including values that no initialiser can recreate afterwards: the states of a
torchmetrics ``Metric`` (zeros, ``-inf``, counts) and the tensors a LightningModule creates in its own code
(class weights, a constant buffer). :class:`MetaLayers` leaves those on the default device.

A model may ask :meth:`MetaLayers.active` whether its layers are being built on the meta device (a Hugging Face
model then builds its layers from the configuration rather than loading weights), so this sits below both the
strategy, which opens the mode, and the models.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

__all__ = ["META", "MetaLayers"]


META = torch.device("meta")


class MetaLayers(TorchFunctionMode):
    """Creates tensors on the meta device, except those created by a LightningModule's own methods or by a
    torchmetrics ``Metric``.

    Which code creates a tensor is read from the innermost frame on the call stack whose ``self`` is an
    ``nn.Module``: a layer (``nn.Linear``, a transformer block, ...) gets meta tensors; the LightningModule
    itself and metrics get real ones. A tensor created outside any module (at the top level of the ``with``
    block) goes to the meta device, as under ``torch.device("meta")``.
    """

    _depth = 0  # how many MetaLayers modes are open in this process

    def __enter__(self) -> MetaLayers:
        MetaLayers._depth += 1
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        MetaLayers._depth -= 1
        super().__exit__(*exc)

    @staticmethod
    def active() -> bool:
        """Whether layers built now go to the meta device (a LightningModule's own tensors never do)."""
        return MetaLayers._depth > 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _device_constructors() and kwargs.get("device") is None and not _created_by_non_layer_code():
            kwargs["device"] = META
        return func(*args, **kwargs)


def _created_by_non_layer_code() -> bool:
    from lightning.pytorch import LightningModule

    try:
        from torchmetrics import Metric
    except ImportError:  # torchmetrics is optional
        Metric = ()  # noqa: N806
    frame = sys._getframe(2)  # the caller of __torch_function__
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module):
            return isinstance(owner, (LightningModule, Metric) if Metric else LightningModule)
        frame = frame.f_back
    return False
