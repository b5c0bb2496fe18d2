"""What a pipeline configuration holds per stage and how fast it runs, from figures measured once per layer.

The figures of each layer (:class:`LayerFigures`: its parameters' bytes, the optimizer state and the
low-precision copies they bring, the activations it keeps for backward per micro-batch, its FLOPs) are measured
by :mod:`lightning_async_pp.strategy.planning` on the meta device; this module adds them up for any number of
stages ``P``, replicas ``D`` and micro-batches ``M`` (:func:`stage_memory`) and times the schedules with the
simulator (:func:`predict_time`). Nothing here needs torch.

Per stage ``s`` of ``P``, in bytes (:class:`StageMemory`):

- weights: one copy per weight version the schedule keeps (2 under 2BW, ``w[t]`` and ``w[t-1]``; 1 under 1F1B);
- gradients: ``.grad``, plus the flat buffer the replicas' all-reduce (or reduce-scatter) reads when ``D > 1``,
  plus the reduce-scatter's output (``1/D``) with ``shard_optimizer``;
- optimizer state: what the optimizer creates for the stage's parameters, ``1/D`` of it with ``shard_optimizer``
  (whole tensors are owned, so a replica holds about that share); ``DelayCorrected``'s buffer of the previous
  update is counted apart as the correction, divided alike;
- low-precision copies: autocast's copy of the weights it casts, one per weight version held
  (:func:`low_precision_copies`), none without autocast;
- activations: at most ``P - s`` micro-batches in flight (fewer when ``M`` is smaller, under 1F1B), each keeping
  what the stage's layers save for backward; a recomputed layer keeps only its input, and recomputes the rest of
  one micro-batch at a time during backward.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from lightning_async_pp.schedule.generate import build_schedule, stage_footprint
from lightning_async_pp.schedule.simulate import StageCosts, simulate

__all__ = [
    "LayerFigures",
    "ParameterFigures",
    "StageMemory",
    "TimePrediction",
    "activation_bytes",
    "low_precision_copies",
    "predict_time",
    "stage_memory",
]


@dataclass(frozen=True)
class ParameterFigures:
    """One parameter of the model.

    Attributes:
        numel: Its elements.
        nbytes: One copy of it, in its dtype.
        optimizer_bytes: The state the optimizer creates for it, besides the delay correction's buffer.
        correction_bytes: ``DelayCorrected``'s buffer of its previous update.
        cast_bytes: The low-precision copy autocast makes of it and keeps for backward (0 when it is not cast).
    """

    numel: int
    nbytes: int
    optimizer_bytes: int
    cast_bytes: int = 0
    correction_bytes: int = 0


@dataclass(frozen=True)
class LayerFigures:
    """One pipeline layer, for one micro-batch of the measured size.

    Attributes:
        parameters: Its parameters by a name unique in the model (a tied weight has the same name in each layer
            that uses it: a stage holding both counts it once).
        saved_bytes: Tensors the layer saves for backward, besides its input, its output, its weights and
            their low-precision copies.
        input_bytes: Its input.
        input_saved: Whether the layer saves its input for backward.
        output_bytes: Its output.
        output_saved: Whether the layer saves its own output for backward.
        flops: Forward and backward FLOPs.
    """

    parameters: Mapping[str, ParameterFigures]
    saved_bytes: int
    input_bytes: int
    input_saved: bool
    output_bytes: int
    output_saved: bool
    flops: float


def low_precision_copies(weight_versions: int, autocast: bool) -> int:
    """How many low-precision copies of its cast weights a stage keeps: one per weight version it holds under
    autocast (every micro-batch that reads a version shares that version's copy), none without autocast."""
    return weight_versions if autocast else 0


Owners = Callable[[Mapping[str, int], int], Mapping[str, int]]


def _gradients_and_state(
    params: Mapping[str, ParameterFigures], replicas: int, shard: bool, owners: Owners | None
) -> tuple[int, int, int]:
    """A stage's gradient bytes (``.grad`` and the replicas' flat buffer), optimizer state and correction.

    Sharded, the flat buffer holds one segment per replica, each as long as the longest (the tensors a replica
    owns), and the owner receives its segment; the replica owning the most state is the one counted.
    """
    weight = sum(p.nbytes for p in params.values())
    state = sum(p.optimizer_bytes for p in params.values())
    correction = sum(p.correction_bytes for p in params.values())
    if replicas == 1:
        return weight, state, correction
    if not shard:
        return 2 * weight, state, correction
    if owners is None:
        return 2 * weight + weight // replicas, state // replicas, correction // replicas
    owner = owners({name: p.nbytes for name, p in params.items()}, replicas)
    segments, held = [0] * replicas, [(0, 0)] * replicas
    for name, p in params.items():
        r = owner[name]
        segments[r] += p.nbytes
        held[r] = (held[r][0] + p.optimizer_bytes, held[r][1] + p.correction_bytes)
    longest = max(segments)
    heaviest = max(held, key=sum)
    return weight + replicas * longest + longest, heaviest[0], heaviest[1]


@dataclass(frozen=True)
class StageMemory:
    """The bytes one stage holds at its peak (see the module's docstring for what each line counts)."""

    stage: int
    layers: range
    parameters: int
    weights: int
    weight_versions: int
    gradients: int
    optimizer_state: int
    correction: int
    low_precision_copies: int
    copies: int
    activations_per_microbatch: int
    in_flight: int
    activations: int
    recompute_transient: int

    @property
    def total(self) -> int:
        return (
            self.weights
            + self.gradients
            + self.optimizer_state
            + self.correction
            + self.low_precision_copies
            + self.activations
            + self.recompute_transient
        )


def activation_bytes(
    layers: Sequence[LayerFigures],
    recomputed: Sequence[bool],
    first: bool,
    last: bool,
    loss_saved_bytes: int = 0,
) -> tuple[int, int]:
    """What one micro-batch in flight keeps on a stage made of ``layers``, and the most that recomputing one
    layer adds during backward.

    Each tensor between two layers is counted once, when a layer on either side saves it or a recomputed layer
    keeps it as its input; the stage keeps its received input (not on the first stage) and, until its
    backward, its output (not on the last stage, which runs the loss and its backward at once: there the loss's
    saved tensors count instead).

    Args:
        layers: The stage's layers, in order.
        recomputed: Per layer, whether activation checkpointing recomputes it.
        first: Whether this is the first stage.
        last: Whether this is the last stage.
        loss_saved_bytes: What the loss saves for backward (counted on the last stage).

    Returns:
        ``(bytes per micro-batch, recomputation's peak on top of them)``.
    """
    held = 0
    for i, (layer, again) in enumerate(zip(layers, recomputed, strict=True)):
        if not again:
            held += layer.saved_bytes
        # The tensor entering layer i: the stage's input, or the previous layer's output.
        if i == 0:
            kept = not first or again or layer.input_saved
        else:
            before = layers[i - 1]
            kept = again or layer.input_saved or (before.output_saved and not recomputed[i - 1])
        held += layer.input_bytes if kept else 0
    tail = layers[-1]
    if last:
        held += loss_saved_bytes + (tail.output_bytes if tail.output_saved and not recomputed[-1] else 0)
    else:
        held += tail.output_bytes
    transient = max(
        (layer.saved_bytes + layer.output_bytes for layer, again in zip(layers, recomputed, strict=True) if again),
        default=0,
    )
    return held, transient


def stage_memory(
    layers: Sequence[LayerFigures],
    partition: Sequence[range],
    schedule: str,
    num_microbatches: int,
    replicas: int,
    shard_optimizer: bool,
    recomputed: Sequence[bool],
    autocast: bool,
    activation_scale: float = 1.0,
    loss_saved_bytes: int = 0,
    owners: Owners | None = None,
) -> list[StageMemory]:
    """Every stage's peak bytes.

    Args:
        layers: The model's layers.
        partition: Every stage's layer indices.
        schedule: ``"2bw"`` or ``"1f1b"``.
        num_microbatches: ``M``.
        replicas: ``D``.
        shard_optimizer: Whether the optimizer state is divided among the ``D`` replicas.
        recomputed: Per layer, whether activation checkpointing recomputes it.
        autocast: Whether a mixed precision casts the weights (``bf16-mixed``, ``16-mixed``).
        activation_scale: The micro-batch's size over the measured one (activations grow with it).
        loss_saved_bytes: What the loss saves for backward, at the measured size.
        owners: With ``shard_optimizer``, which replica owns each parameter given their bytes and ``D`` (the
            runtime's ``plan_owners``): the heaviest replica is counted, and the flat buffer padded as the
            runtime pads it. ``None`` counts an even split.
    """
    P = len(partition)
    out = []
    for s, indices in enumerate(partition):
        own = [layers[i] for i in indices]
        params = {name: p for layer in own for name, p in layer.parameters.items()}
        footprint = stage_footprint(schedule, P, num_microbatches, s)
        in_flight = 1 if s == P - 1 else footprint.max_in_flight
        gradients, state, correction = _gradients_and_state(params, replicas, shard_optimizer, owners)
        copies = low_precision_copies(footprint.weight_versions, autocast)
        measured = activation_bytes(own, [recomputed[i] for i in indices], s == 0, s == P - 1, loss_saved_bytes)
        per_mb, transient = (round(size * activation_scale) for size in measured)
        out.append(
            StageMemory(
                stage=s,
                layers=indices,
                parameters=sum(p.numel for p in params.values()),
                weights=footprint.weight_versions * sum(p.nbytes for p in params.values()),
                weight_versions=footprint.weight_versions,
                gradients=gradients,
                optimizer_state=state,
                correction=correction,
                low_precision_copies=copies * sum(p.cast_bytes for p in params.values()),
                copies=copies,
                activations_per_microbatch=per_mb,
                in_flight=in_flight,
                activations=in_flight * per_mb,
                recompute_transient=transient,
            )
        )
    return out


@dataclass(frozen=True)
class TimePrediction:
    """The simulator's steady state for one schedule.

    Attributes:
        step_seconds: Seconds per optimizer step.
        bubble: Mean idle fraction of the stages.
        stage_costs: Per stage, forward and backward seconds of one micro-batch.
    """

    step_seconds: float
    bubble: float
    stage_costs: list[tuple[float, float]]


def predict_time(
    stage_forward_seconds: Sequence[float],
    schedule: str,
    num_microbatches: int,
    recompute_seconds: Sequence[float] | None = None,
    backward_ratio: float = 2.0,
    num_steps: int = 8,
    overhead: Sequence[StageCosts] | None = None,
) -> TimePrediction:
    """The steady-state step time and bubble of ``schedule`` from each stage's forward time per micro-batch.

    Args:
        stage_forward_seconds: Per stage, the forward of one micro-batch.
        schedule: ``"2bw"`` or ``"1f1b"``.
        num_microbatches: ``M``.
        recompute_seconds: Per stage, the forward that activation checkpointing repeats in backward.
        backward_ratio: Backward time over forward time (2: the input's and the weights' gradients).
        num_steps: Steps simulated; the first and last quarter are left out as ramp-up and drain.
        overhead: Per stage, host seconds added to each forward, backward and update (the runtime's own work
            around the kernels, e.g. measured on a short run).
    """
    P = len(stage_forward_seconds)
    extra = recompute_seconds or [0.0] * P
    host = overhead or [StageCosts(0.0, 0.0)] * P
    costs = [
        StageCosts(f + h.forward, backward_ratio * f + r + h.backward, h.update)
        for f, r, h in zip(stage_forward_seconds, extra, host, strict=True)
    ]
    sched = build_schedule(schedule, len(costs), num_microbatches, num_steps=num_steps)
    result = simulate(sched, costs)
    return TimePrediction(
        step_seconds=num_microbatches / result.steady_throughput,
        bubble=result.mean_steady_bubble_fraction,
        stage_costs=[(c.forward, c.backward) for c in costs],
    )
