"""Optimizers for training under a one-step gradient delay.

* :class:`Muon`: Muon on hidden weight matrices, AdamW on everything else, as one optimizer.
* :class:`DelayCorrected`: wraps any optimizer and corrects its update for a one-step gradient delay.
"""

from lightning_async_pp.optim.delay_corrected import DelayCorrected
from lightning_async_pp.optim.muon import Muon

__all__ = ["DelayCorrected", "Muon"]
