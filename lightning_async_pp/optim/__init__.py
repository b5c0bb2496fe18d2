"""Optimizers for training under a one-step gradient delay.

* :class:`Muon`: Muon on hidden weight matrices, AdamW on everything else, as one optimizer.
* :class:`DelayCorrected`: wraps any optimizer and corrects its update for a one-step gradient delay.
* :func:`updates_per_parameter`: whether an optimizer's parameters can be split between instances.
"""

from lightning_async_pp.optim.delay_corrected import DelayCorrected
from lightning_async_pp.optim.granularity import PER_PARAMETER_OPTIMIZERS, updates_per_parameter
from lightning_async_pp.optim.muon import Muon

__all__ = ["PER_PARAMETER_OPTIMIZERS", "DelayCorrected", "Muon", "updates_per_parameter"]
