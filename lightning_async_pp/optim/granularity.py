"""Whether an optimizer updates each parameter from that parameter's gradient and state alone.

Such an optimizer gives the same update to a parameter whichever other parameters it holds, so its parameters
can be split between several instances (one per data-parallel replica, each keeping the state of its part
only) without changing any update. Most optimizers are: Adam's moments, SGD's momentum and Muon's momentum and
orthogonalization are per tensor. Some are not: L-BFGS keeps one history over all parameters, Prodigy and
D-Adaptation estimate one step size from sums over all of them, LAMB-style trust ratios over a group would be.
"""

from __future__ import annotations

import torch
from torch.optim import Optimizer

__all__ = ["PER_PARAMETER_OPTIMIZERS", "updates_per_parameter"]

PER_PARAMETER_OPTIMIZERS: tuple[type[Optimizer], ...] = tuple(
    getattr(torch.optim, name)
    for name in (
        "SGD",
        "Adam",
        "AdamW",
        "Adagrad",
        "Adadelta",
        "Adamax",
        "ASGD",
        "NAdam",
        "RAdam",
        "RMSprop",
        "Rprop",
        "SparseAdam",
        "Adafactor",
        "Muon",
    )
    if hasattr(torch.optim, name)
)
"""torch optimizers whose update of a parameter reads only that parameter's gradient and state (exact classes:
a subclass may change that)."""


def updates_per_parameter(optimizer: Optimizer) -> bool:
    """Whether ``optimizer``'s update of each parameter reads only that parameter's gradient and state (and its
    group's hyperparameters).

    An optimizer says so with a ``per_parameter`` attribute (``True`` or ``False``); without one, the exact
    classes in :data:`PER_PARAMETER_OPTIMIZERS` are, and any other is not known to be.

    Args:
        optimizer: The optimizer to ask.
    """
    declared = getattr(optimizer, "per_parameter", None)
    if declared is not None:
        return bool(declared)
    return type(optimizer) in PER_PARAMETER_OPTIMIZERS
