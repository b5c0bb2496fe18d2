"""What runs: the schedules, where each puts the layers, the costs of every layer, and the ideal step time.

The model is ``P * L`` emulated layers (``L`` = ``--layers-per-stage``), stage ``s`` of ``P`` owning layers
``[s L, (s + 1) L)`` with stage ``s``'s costs split evenly over them. Schedules with one stage per rank
(ours, torch's ``Schedule1F1B``) give rank ``r`` stage ``r``. Schedules with two virtual stages per rank cut
the same layers into ``2 P`` chunks of ``L / 2`` layers: the looped ones (interleaved 1F1B, looped BFS,
interleaved zero bubble) give rank ``r`` chunks ``r`` and ``r + P``, the V-shaped ones (ZBV, DualPipeV)
chunks ``r`` and ``2 P - 1 - r``. With uneven stage costs the ranks' loads therefore differ by schedule;
each schedule's ideal step time is ``M`` times its busiest rank's cost per micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .layers import LayerCost

OURS = ("ours_2bw", "ours_1f1b")
TORCH = {
    "torch_1f1b": ("Schedule1F1B", "single"),
    "torch_interleaved_1f1b": ("ScheduleInterleaved1F1B", "loop"),
    "torch_looped_bfs": ("ScheduleLoopedBFS", "loop"),
    "torch_interleaved_zb": ("ScheduleInterleavedZeroBubble", "loop"),
    "torch_zbv": ("ScheduleZBVZeroBubble", "v"),
    "torch_dualpipev": ("ScheduleDualPipeV", "v"),
}
SCHEDULES = (*OURS, *TORCH)
VIRTUAL_STAGES = 2


@dataclass(frozen=True)
class Costs:
    """Per pipeline stage, its cost per micro-batch (all its layers together), in seconds.

    Args:
        forward: Forward seconds per micro-batch of a stage.
        input: Input-gradient seconds.
        weight: Weight-gradient seconds.
        stage_factors: Multiplier per stage (``None``: all 1); must have ``P`` entries.
        last_stage_factor: Extra multiplier of the last stage (a heavier head).
    """

    forward: float
    input: float
    weight: float
    stage_factors: tuple[float, ...] | None = None
    last_stage_factor: float = 1.0

    def stage(self, stage: int, num_stages: int) -> LayerCost:
        if self.stage_factors is not None and len(self.stage_factors) != num_stages:
            raise ValueError(
                f"--stage-factors has {len(self.stage_factors)} entries but P={num_stages}: give one per stage "
                "and run that single P (--stages)"
            )
        factor = self.stage_factors[stage] if self.stage_factors is not None else 1.0
        if stage == num_stages - 1:
            factor *= self.last_stage_factor
        return LayerCost(self.forward, self.input, self.weight).scaled(factor)

    def layers(self, num_stages: int, layers_per_stage: int) -> list[LayerCost]:
        """The cost of every layer of the model, in order."""
        return [
            self.stage(s, num_stages).scaled(1.0 / layers_per_stage)
            for s in range(num_stages)
            for _ in range(layers_per_stage)
        ]


def style_of(name: str) -> str:
    return "single" if name in OURS else TORCH[name][1]


def rank_stages(name: str, rank: int, num_ranks: int) -> list[int]:
    """The stage indices rank ``rank`` holds under schedule ``name``, in the order torch expects them."""
    style = style_of(name)
    if style == "single":
        return [rank]
    if style == "loop":
        return [rank + v * num_ranks for v in range(VIRTUAL_STAGES)]
    return [rank, VIRTUAL_STAGES * num_ranks - 1 - rank]


def num_model_stages(name: str, num_ranks: int) -> int:
    return num_ranks if style_of(name) == "single" else VIRTUAL_STAGES * num_ranks


def stage_layers(name: str, stage: int, num_ranks: int, layers_per_stage: int) -> range:
    """Indices of the model's layers that stage ``stage`` of schedule ``name`` runs."""
    per = layers_per_stage if style_of(name) == "single" else layers_per_stage // VIRTUAL_STAGES
    return range(stage * per, (stage + 1) * per)


def rank_costs(name: str, num_ranks: int, layers_per_stage: int, costs: Costs) -> list[LayerCost]:
    """Per rank, the sum of the costs of the layers it holds under schedule ``name`` (per micro-batch)."""
    layer_costs = costs.layers(num_ranks, layers_per_stage)
    out = []
    for rank in range(num_ranks):
        held = [
            i for s in rank_stages(name, rank, num_ranks) for i in stage_layers(name, s, num_ranks, layers_per_stage)
        ]
        out.append(
            LayerCost(
                sum(layer_costs[i].forward for i in held),
                sum(layer_costs[i].input for i in held),
                sum(layer_costs[i].weight for i in held),
            )
        )
    return out


def ideal_step_seconds(name: str, num_ranks: int, num_microbatches: int, layers_per_stage: int, costs: Costs) -> float:
    """``M`` times the busiest rank's cost per micro-batch: a step with no bubble and no host time."""
    return num_microbatches * max(c.total for c in rank_costs(name, num_ranks, layers_per_stage, costs))


def check_layers_per_stage(layers_per_stage: int) -> None:
    if layers_per_stage < VIRTUAL_STAGES or layers_per_stage % VIRTUAL_STAGES:
        raise ValueError(
            f"--layers-per-stage must be a positive multiple of {VIRTUAL_STAGES} (the virtual stages per rank of the "
            f"interleaved and V schedules), got {layers_per_stage}"
        )


def cells(stage_counts: Sequence[int], multipliers: Sequence[int]) -> list[tuple[int, int]]:
    """Every ``(P, M = k P)``."""
    return [(p, k * p) for p in stage_counts for k in multipliers]
