"""Schedules as data, in pure Python (no torch).

The action IR (:mod:`~lightning_async_pp.schedule.ir`: :class:`Op`, :class:`Action` and its printed form,
:class:`PipelineSchedule`, what each kind answers, and the registry of kinds), the built-in kinds
(:mod:`~lightning_async_pp.schedule.kinds`: "2bw" and "1f1b", registered on import), their generation
(:mod:`~lightning_async_pp.schedule.generate`), verification (:mod:`~lightning_async_pp.schedule.verify`), the
ordering of transfers under NCCL's semantics (:mod:`~lightning_async_pp.schedule.transfers`), the plan of an
update's collectives (:mod:`~lightning_async_pp.schedule.update_plan`), which the runtime executes and that
ordering model checks, timing
(:mod:`~lightning_async_pp.schedule.simulate`) and layer partitioning (:mod:`~lightning_async_pp.schedule.partition`).
"""

from lightning_async_pp.schedule.generate import (
    Schedule,
    StageFootprint,
    build_schedule,
    drain_actions,
    evaluation_actions,
    gpipe_schedule,
    gradients_received_before_forward,
    stage_footprint,
    step_actions,
    updates_settled_by,
)
from lightning_async_pp.schedule.ir import (
    STAGES_PER_PROCESS,
    Action,
    Op,
    PipelineSchedule,
    get_schedule,
    register_schedule,
    validate,
    weight_buffer,
    weight_version,
)
from lightning_async_pp.schedule.kinds import SCHEDULES, Schedule1F1B, Schedule2BW
from lightning_async_pp.schedule.transfers import (
    FLUSH,
    PostingPlan,
    check_transfers,
    host_program,
    posting_plan,
)
from lightning_async_pp.schedule.update_plan import POINTS, PlanEntry, UpdatePlan
from lightning_async_pp.schedule.verify import check, liveness_trace

__all__ = [
    "FLUSH",
    "POINTS",
    "SCHEDULES",
    "STAGES_PER_PROCESS",
    "Action",
    "Op",
    "PipelineSchedule",
    "PlanEntry",
    "PostingPlan",
    "Schedule",
    "Schedule1F1B",
    "Schedule2BW",
    "StageFootprint",
    "UpdatePlan",
    "build_schedule",
    "check",
    "check_transfers",
    "drain_actions",
    "evaluation_actions",
    "get_schedule",
    "gpipe_schedule",
    "gradients_received_before_forward",
    "updates_settled_by",
    "host_program",
    "liveness_trace",
    "posting_plan",
    "register_schedule",
    "stage_footprint",
    "step_actions",
    "validate",
    "weight_buffer",
    "weight_version",
]
