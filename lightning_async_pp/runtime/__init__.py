"""The stage runtime (torch and ``torch.distributed``, never Lightning): an interpreter of schedule actions
with versioned weights, transfers, updates and timing."""

from lightning_async_pp.runtime.stage import StageRuntime, StepStats

__all__ = ["StageRuntime", "StepStats"]
