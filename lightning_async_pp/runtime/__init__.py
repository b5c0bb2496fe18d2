"""The stage runtime (torch and ``torch.distributed``, never Lightning): an interpreter of schedule actions
with versioned weights, transfers, updates and timing."""

from lightning_async_pp.runtime.auxiliary import AuxiliaryLosses, attach_auxiliary_loss
from lightning_async_pp.runtime.finite import FiniteCheck, check_finite_losses
from lightning_async_pp.runtime.stage import Observer, StageRuntime, register_action_observer
from lightning_async_pp.runtime.timing import StepStats
from lightning_async_pp.runtime.updates import NOT_HYPERPARAMETERS

__all__ = [
    "NOT_HYPERPARAMETERS",
    "AuxiliaryLosses",
    "FiniteCheck",
    "Observer",
    "StageRuntime",
    "StepStats",
    "attach_auxiliary_loss",
    "check_finite_losses",
    "register_action_observer",
]
