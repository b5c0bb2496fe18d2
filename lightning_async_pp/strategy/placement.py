"""Which layers go to which stage, keeping only a stage's layers on a rank, materialising them from meta.

:func:`place_stage` does all of it for one rank and returns a :class:`StagePlacement`, the record of what the
rank keeps (its layers and parameters, the weights it shares with other stages).

With several stages, the model is built with its layers on the meta device
(:class:`~lightning_async_pp.meta.MetaLayers`) and each stage materialises only the layers it owns
(:func:`materialize`).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_async_pp.checkpoint import parameter_aliases
from lightning_async_pp.runtime.contract import reads_batch
from lightning_async_pp.runtime.recompute import ActivationCheckpointing, checkpoint_layers, select_layers
from lightning_async_pp.runtime.ties import (
    Tie,
    TiedGradients,
    broadcast_ties,
    check_tied_updates,
    find_ties,
    new_tie_groups,
    parameter_slots,
    retie,
)
from lightning_async_pp.schedule.partition import (
    balanced_partition,
    count_parameters,
    partition_from_split_points,
    stage_ranges,
)
from lightning_async_pp.strategy.topology import PipelineDims

log = logging.getLogger("lightning.pytorch.strategies.async_pp")


class RemoteLayer(nn.Module):
    """Stands in for a layer that lives on another stage; it owns no parameters and cannot run."""

    def __init__(self, index: int, stage: int) -> None:
        super().__init__()
        self.index = index
        self.stage = stage

    def forward(self, x: Tensor) -> Tensor:
        raise RuntimeError(
            f"Layer {self.index} lives on pipeline stage {self.stage}, not in this process. Under "
            "AsyncPipelineStrategy with several devices, call the model only through the strategy."
        )

    def extra_repr(self) -> str:
        return f"layer={self.index}, stage={self.stage}"


def keep_only_layers(root: nn.Module, layers: Sequence[nn.Module], keep: range, owner_of: Sequence[int]) -> None:
    """Replace every layer outside ``keep`` by a :class:`RemoteLayer`, freeing its parameters here.

    A model may reach a layer, or a module inside one, through more than one attribute (an adapter that
    keeps ``self.hf = model`` beside ``self.layers``). Every such reference is replaced, so the stage holds
    only its own layers. A module that a kept layer uses too (the module of a tied weight) stays.
    """
    for index, layer in enumerate(layers):
        if not any(module is layer for module in root.modules()):
            raise ValueError(
                f"A pipeline layer of type {type(layer).__name__} is not a submodule of {type(root).__name__}. "
                "`pipeline_layers()` must return modules registered on the LightningModule (e.g. in an nn.ModuleList)."
            )
    kept = {id(m) for index in keep for m in layers[index].modules()}
    dropped: dict[int, int] = {}  # id(module) -> index of the layer it belongs to
    for index, layer in enumerate(layers):
        if index not in keep:
            for module in layer.modules():
                if id(module) not in kept:
                    dropped.setdefault(id(module), index)
    # Cut every edge from a module that stays to one that goes: then no path from the root reaches a dropped
    # module. Collect the edges first, as replacing them would change the walk.
    cuts = [
        (module, attribute, dropped[id(child)])
        for module in root.modules()
        if id(module) not in dropped
        for attribute, child in module._modules.items()
        if child is not None and id(child) in dropped
    ]
    for parent, attribute, index in cuts:
        setattr(parent, attribute, RemoteLayer(index, owner_of[index]))
    _refuse_leftovers(root, layers, keep)


def _refuse_leftovers(root: nn.Module, layers: Sequence[nn.Module], keep: range) -> None:
    """Raise naming the attribute through which ``root`` still holds a tensor of another stage's layer."""
    own = {id(t) for index in keep for t in (*layers[index].parameters(), *layers[index].buffers())}
    foreign = {
        id(t): index
        for index, layer in enumerate(layers)
        if index not in keep
        for t in (*layer.parameters(), *layer.buffers())
    }
    for name, tensor in (*root.named_parameters(remove_duplicate=False), *root.named_buffers(remove_duplicate=False)):
        if id(tensor) in foreign and id(tensor) not in own:
            raise ValueError(
                f"`{name}` of {type(root).__name__} is a tensor of pipeline layer {foreign[id(tensor)]}, which lives "
                "on another stage, yet this stage would keep it through that attribute. Register the tensor only "
                "inside the layer that uses it (reach it through the layer, e.g. with a property)."
            )


def is_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


@torch.no_grad()
def materialize(root: nn.Module, index: int, layer: nn.Module, device: torch.device) -> None:
    """Allocate a meta-device layer on ``device`` and initialise it.

    Uses ``root.reset_pipeline_layer(index, layer)`` when the model defines it (so every stage initialises
    its layers exactly as the whole model would), otherwise each submodule's ``reset_parameters()``.
    """
    layer.to_empty(device=device)
    reset = getattr(root, "reset_pipeline_layer", None)
    if callable(reset):
        reset(index, layer)
        return
    for module in layer.modules():
        # nn.MultiheadAttention initialises its packed input projection in `_reset_parameters`.
        for name in ("reset_parameters", "_reset_parameters"):
            if callable(getattr(module, name, None)):
                getattr(module, name)()
                break


def partition_layers(
    layers: Sequence[nn.Module],
    num_stages: int,
    split_points: Sequence[int] | None = None,
    costs: Sequence[float] | None = None,
) -> list[range]:
    """The contiguous layer ranges of each stage.

    Args:
        layers: The model's pipeline layers, in order (may live on the meta device).
        num_stages: Number of stages.
        split_points: Explicit boundaries (stage ``k`` starts at layer ``split_points[k-1]``), or ``None``.
        costs: One cost per layer to balance; ``None`` balances parameter counts.
    """
    if split_points is not None:
        starts = partition_from_split_points(len(layers), split_points, num_stages)
    else:
        if costs is None:
            costs = [float(count_parameters(layer)) for layer in layers]
        elif len(costs) != len(layers):
            raise ValueError(
                f"Got {len(costs)} layer costs but the model has {len(layers)} pipeline layers; "
                "give one cost per layer of `pipeline_layers()`."
            )
        starts = balanced_partition(costs, num_stages)
    return stage_ranges(starts, len(layers))


def measure_layer_times(
    layers: Sequence[nn.Module], example_input: Tensor, repeats: int = 3, device: torch.device | None = None
) -> list[float]:
    """Forward plus backward seconds of each layer (median of ``repeats``), fed by the previous layer.

    Args:
        layers: Materialised layers, in order.
        example_input: The first layer's input (``pipeline_inputs`` of one micro-batch).
        repeats: Timed repetitions per layer, after one warm-up.
        device: Time each layer on this device (a copy of it, one layer at a time), e.g. the GPU the
            stages will run on; ``None`` times the layers where they are.
    """
    if any(is_meta(layer) for layer in layers):
        raise ValueError("Layer times can only be measured on materialised layers, not on the meta device.")
    times = []
    x = example_input if device is None else example_input.to(device)
    cuda = x.is_cuda
    for original in layers:
        layer = original if device is None else copy.deepcopy(original).to(device)
        samples = []
        for _ in range(repeats + 1):
            inp = x.detach().requires_grad_(x.is_floating_point())
            if cuda:
                torch.cuda.synchronize(x.device)  # setup time, not the training loop: waiting is fine here
            start = time.perf_counter()
            out = layer(inp, None) if reads_batch(layer) else layer(inp)
            out.backward(torch.ones_like(out))
            if cuda:
                torch.cuda.synchronize(x.device)
            samples.append(time.perf_counter() - start)
        layer.zero_grad(set_to_none=True)
        times.append(sorted(samples[1:])[len(samples[1:]) // 2])
        x = out.detach()
    return times


@dataclass
class StagePlacement:
    """What one rank keeps of the model once its stage is placed.

    Attributes:
        module: The LightningModule that was cut (its other stages' layers are gone).
        partition: Every stage's layer indices.
        stage_layers: This stage's layer indices.
        modules: This stage's layers, in order.
        params: This stage's parameters, named as ``nn.Sequential(*modules)`` names them (the runtime's naming).
        model_shapes: The whole model's state-dict names and shapes; a checkpoint is checked against them.
        parameter_aliases: A tied copy's name to the parameter's first name in the whole model, under which its
            training state is checkpointed.
        ties: The weights this model shares across stages (found on the whole model).
        tie_groups: One process group per tie, for the tie's owners in this replica.
        tied_gradients: Sums the gradients of this stage's tied parameters; ``None`` when none is trained.
    """

    module: LightningModule
    partition: list[range]
    stage_layers: range
    modules: list[nn.Module]
    params: dict[str, nn.Parameter]
    model_shapes: dict[str, tuple[int, ...]]
    parameter_aliases: dict[str, str]
    ties: list[Tie]
    tie_groups: list[Any]
    tied_gradients: TiedGradients | None

    def check_tied_updates(self, stage: int, optimizer: Optimizer) -> None:
        """Refuse tied copies that ``optimizer`` would update differently (a collective of each tie's owners)."""
        if not self.ties:
            return
        params = self.params
        module_names = {id(p): n for n, p in self.module.named_parameters()}
        try:
            check_tied_updates(
                self.ties,
                stage,
                params,
                optimizer.param_groups,
                self.tie_groups,
                display=lambda name: module_names.get(id(params[name]), name),
            )
        except ValueError as error:
            raise MisconfigurationException(str(error)) from None


def place_stage(
    module: LightningModule,
    partition: list[range],
    dims: PipelineDims,
    rank: int,
    device: torch.device,
    backend: str | None,
    activation_checkpointing: ActivationCheckpointing,
    data_group: Any,
    timeout: timedelta | None = None,
) -> StagePlacement:
    """Keep only this rank's stage of ``module``: drop the other layers, materialise this stage's, set up ties.

    Args:
        module: The whole model (its layers may be on the meta device).
        partition: Every stage's layer indices.
        dims: The job's stages and replicas.
        rank: This process's global rank.
        device: This stage's device.
        backend: Backend of the tie groups.
        activation_checkpointing: Which layers recompute their forward in backward.
        data_group: This stage's replicas, over which the module's metrics sync.
        timeout: How long a collective on the tie groups waits before it fails (the strategy's ``timeout``).
    """
    stage, replica = dims.stage_of(rank), dims.replica_of(rank)
    layers = list(module.pipeline_layers())
    owner = [s for s, r in enumerate(partition) for _ in r]
    own = partition[stage]
    # Read on the whole model, before the other stages' layers are dropped (cheap on meta too).
    model_shapes = {n: tuple(t.shape) for n, t in module.state_dict().items()}
    aliases = parameter_aliases(module)
    ties = find_ties(layers, partition)
    groups, sources = new_tie_groups(ties, dims.rank_of, dims.data_parallel_size, replica, stage, backend, timeout)
    recomputed = select_layers(layers, activation_checkpointing)
    keep_only_layers(module, layers, own, owner)
    shared = parameter_slots([layers[i] for i in own])
    for index in own:
        if is_meta(layers[index]):
            materialize(module, index, layers[index], device)
    retie(shared)
    modules = [layers[i] for i in own]
    params = dict(nn.Sequential(*modules).named_parameters())
    broadcast_ties(ties, stage, params, groups, sources)
    checkpoint_layers(layers, [i for i in recomputed if i in own])
    localize_metrics(module, data_group if dims.data_parallel_size > 1 else None)
    _log_stage(layers, own, dims, rank)
    _refuse_meta_leftovers(module)
    return StagePlacement(
        module=module,
        partition=partition,
        stage_layers=own,
        modules=modules,
        params=params,
        model_shapes=model_shapes,
        parameter_aliases=aliases,
        ties=ties,
        tie_groups=groups,
        tied_gradients=TiedGradients(ties, stage, groups) if any(t.requires_grad for t in ties) else None,
    )


def localize_metrics(module: nn.Module, replica_group: Any | None) -> None:
    """Metrics are updated on the last stages only: they sync across the replicas of the last stage
    (``replica_group``), never across all ranks (the other stages would never join)."""
    from torchmetrics import Metric

    for metric in module.modules():
        if isinstance(metric, Metric):
            if replica_group is not None:
                metric.process_group = replica_group
            else:
                metric.distributed_available_fn = lambda: False


def _log_stage(layers: Sequence[nn.Module], own: range, dims: PipelineDims, rank: int) -> None:
    names = ", ".join(f"{i}:{type(layers[i]).__name__}" for i in own)
    count = sum(count_parameters(layers[i]) for i in own)
    replica = f", replica {dims.replica_of(rank)}/{dims.data_parallel_size}" if dims.data_parallel_size > 1 else ""
    log.info(
        f"[rank {rank}] pipeline stage {dims.stage_of(rank)}/{dims.num_stages}{replica}: layers {names} "
        f"({count:,} parameters)"
    )


def _refuse_meta_leftovers(module: nn.Module) -> None:
    leftover = [name for name, t in (*module.named_parameters(), *module.named_buffers()) if t.is_meta]
    if leftover:
        raise MisconfigurationException(
            f"{type(module).__name__} has parameters or buffers outside of `pipeline_layers()` that are still on "
            f"the meta device: {leftover[:5]}. Every parameter must belong to exactly one pipeline layer; a "
            "buffer outside the layers must be created by the LightningModule's own code (then it is not put "
            "on the meta device), not by a submodule."
        )


def layer_costs(
    module: LightningModule,
    layers: list[nn.Module],
    balance: str | list[float],
    measure_on: torch.device | None,
    broadcast: Callable[[Any], Any],
    rank: int,
) -> list[float] | None:
    """The per-layer costs ``balance`` asks to balance: ``None`` for parameter counts, the given list, or the
    layers' times measured on rank 0 and broadcast (every rank must cut the model the same way).

    Args:
        module: The model, whose ``example_input_array`` feeds the timed layers.
        layers: Its pipeline layers.
        balance: ``"parameters"``, ``"time"`` or one cost per layer.
        measure_on: Where rank 0 times the layers (needed with ``"time"``).
        broadcast: ``broadcast(obj)`` returns rank 0's ``obj`` on every rank.
        rank: This process's global rank.
    """
    if balance == "parameters":
        return None
    if not isinstance(balance, str):
        return balance
    example = check_timing_input(module)
    costs = measure_layer_times(layers, example, device=measure_on) if rank == 0 else None
    return broadcast(costs)


def check_timing_input(module: LightningModule) -> Tensor:
    """The input ``balance='time'`` times the layers on: the module's ``example_input_array``, which must be set."""
    example = getattr(module, "example_input_array", None)
    if not isinstance(example, Tensor):
        raise MisconfigurationException(
            "balance='time' times every layer on `example_input_array`, which is not set. Set "
            "`self.example_input_array` in your LightningModule to the first layer's input for one "
            "micro-batch, or use balance='parameters' or explicit `split_points`."
        )
    return example
