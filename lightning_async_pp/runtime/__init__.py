"""The stage runtime (torch and ``torch.distributed``, never Lightning): an interpreter of schedule actions
with versioned weights, transfers, updates and timing."""

from lightning_async_pp.runtime.stage import (
    FiniteCheck,
    Observer,
    StageRuntime,
    check_finite_losses,
    register_action_observer,
)
from lightning_async_pp.runtime.timing import StepStats
from lightning_async_pp.runtime.updates import NOT_HYPERPARAMETERS

__all__ = [
    "NOT_HYPERPARAMETERS",
    "FiniteCheck",
    "Observer",
    "StageRuntime",
    "StepStats",
    "check_finite_losses",
    "register_action_observer",
]
