"""Parameters shared by layers on different stages (tied weights, e.g. an embedding reused as output head).

On one device a tied parameter is one tensor: both uses add to its gradient and one update moves it. In a
pipeline its layers live in different processes, so each owning stage keeps a copy, as DeepSpeed's
``TiedLayerSpec`` and Megatron's embedding group do. The copies stay bit-identical because

- they start equal: after placement every copy is overwritten by the lowest owning stage's (which also
  makes a model materialised from the meta device consistent);
- every owner applies the same update to the same value: before each (delayed) update, the owners sum
  their gradients over a process group of the tie's owners (one group per tie and replica), so each sees
  the gradient the single-device model would; an all-reduce hands every member the same bits;
- gradient clipping counts a tied parameter once: the tie's lowest owner adds the squared norm of the summed
  gradient to the pipeline's norm all-reduce (which carries scalars only), the other stages add zero.

The last point needs every copy to be in an optimizer parameter group with the same settings. On one device
the parameter is one tensor, reached first under one name, so it lands in one group; in a pipeline each stage
builds its groups from its own layers' names (a rule such as "no weight decay for embeddings" then puts the
head's copy elsewhere). :func:`check_tied_updates` compares the settings once, before training, and refuses
a difference.

The module knows nothing of Lightning: the strategy finds the ties before it drops other stages' layers
and creates the groups; :class:`~lightning_async_pp.runtime.updates.UpdateDriver` posts and waits for the sums
and the norm (:class:`TiedGradients`) where the update's plan says.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn


@dataclass(frozen=True)
class Tie:
    """One parameter used by layers of several stages.

    Args:
        names: Per owning stage, the parameter's name among that stage's layers, as
            ``nn.Sequential(*stage_layers).named_parameters()`` names it (the runtime's naming).
        layers: The indices of the pipeline layers that use it.
        shape: The parameter's shape.
        dtype: The parameter's dtype.
        requires_grad: Whether it is trained.
    """

    names: dict[int, str]
    layers: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @property
    def owners(self) -> list[int]:
        """The stages holding a copy, lowest first."""
        return sorted(self.names)


def find_ties(layers: Sequence[nn.Module], ranges: Sequence[range]) -> list[Tie]:
    """The parameters (by identity) that layers of more than one stage use, in a fixed order.

    Every rank must call this on the whole model (before other stages' layers are dropped) and get the same
    list, as the process groups are created from it.

    Args:
        layers: The model's pipeline layers, in order (may live on the meta device).
        ranges: The layer range of each stage.
    """
    users: dict[int, list[int]] = {}
    tensors: dict[int, Tensor] = {}
    for index, layer in enumerate(layers):
        for p in layer.parameters():
            if index not in users.setdefault(id(p), []):
                users[id(p)].append(index)
            tensors[id(p)] = p
    stage_of = {index: stage for stage, r in enumerate(ranges) for index in r}
    ties = []
    for key, indices in users.items():
        stages = sorted({stage_of[i] for i in indices})
        if len(stages) < 2:
            continue
        names = {}
        for stage in stages:
            local = nn.Sequential(*(layers[i] for i in ranges[stage]))
            names[stage] = next(n for n, p in local.named_parameters() if id(p) == key)
        p = tensors[key]
        ties.append(Tie(names, tuple(indices), tuple(p.shape), p.dtype, p.requires_grad))
    return ties


def parameter_slots(modules: Sequence[nn.Module]) -> list[list[tuple[nn.Module, str]]]:
    """Where each parameter shared within ``modules`` is registered: per parameter, ``(module, attribute)``
    pairs, the first one in the lowest module. :func:`retie` restores the sharing from them."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for layer in modules:
        for module in layer.modules():
            for attribute, p in module._parameters.items():
                if p is not None and (module, attribute) not in slots.get(id(p), []):
                    slots.setdefault(id(p), []).append((module, attribute))
    return [pairs for pairs in slots.values() if len(pairs) > 1]


def retie(slots: list[list[tuple[nn.Module, str]]]) -> None:
    """Point every slot of a shared parameter at the first slot's tensor again.

    Materialising layers from the meta device one by one (``to_empty``) gives each slot its own new tensor;
    the first slot (the lowest layer, which initialised it) wins.
    """
    for pairs in slots:
        module, attribute = pairs[0]
        p = module._parameters[attribute]
        for other, name in pairs[1:]:
            other._parameters[name] = p


@torch.no_grad()
def broadcast_ties(
    ties: Sequence[Tie], stage: int, params: dict[str, Tensor], groups: Sequence[Any], sources: Sequence[int]
) -> None:
    """Overwrite every copy of each tie with the lowest owning stage's (a collective of each tie's owners).

    Args:
        ties: All ties, in the order of :func:`find_ties`.
        stage: This process's stage.
        params: This stage's parameters, by runtime name.
        groups: Per tie, this replica's group of the owners (``None`` where this stage does not own it).
        sources: Per tie, the global rank of the lowest owning stage in this replica.
    """
    for tie, group, source in zip(ties, groups, sources):
        if stage in tie.names:
            dist.broadcast(params[tie.names[stage]].data, src=source, group=group)


def _group_settings(param: Tensor, param_groups: Sequence[dict[str, Any]]) -> str:
    for group in param_groups:
        if any(p is param for p in group["params"]):
            return repr(sorted((k, v) for k, v in group.items() if k not in ("params", "param_names")))
    return "not in the optimizer"


def check_tied_updates(
    ties: Sequence[Tie],
    stage: int,
    params: dict[str, Tensor],
    param_groups: Sequence[dict[str, Any]],
    groups: Sequence[Any],
    display: Callable[[str], str] = str,
) -> None:
    """Refuse a tie whose copies sit in optimizer parameter groups with different settings (a collective of
    each tie's owners; call it once, after the optimizer is built).

    Args:
        ties: All ties, in the order of :func:`find_ties`.
        stage: This process's stage.
        params: This stage's parameters, by runtime name.
        param_groups: This stage's optimizer's ``param_groups``.
        groups: Per tie, this replica's group of the owners (``None`` where this stage does not own it).
        display: The name to show for a runtime name (the model's own name).

    Raises:
        ValueError: If two copies of a trained tied parameter would be updated with different settings.
    """
    for tie, group in zip(ties, groups):
        if not tie.requires_grad or stage not in tie.names:
            continue
        name = tie.names[stage]
        mine = (stage, display(name), _group_settings(params[name], param_groups))
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, mine, group=group)
        if len({settings for _, _, settings in gathered}) > 1:
            held = "; ".join(f"stage {s} ({n}): {settings}" for s, n, settings in sorted(gathered))
            raise ValueError(
                f"The tied parameter {' = '.join(n for _, n, _ in sorted(gathered))} would be updated with different "
                f"optimizer settings on the stages that hold it, and its copies would drift apart: {held}. On one "
                "device it is one tensor in one parameter group. Put every name of a tied parameter in the same "
                "group in `configure_optimizers` (a stage sees only its own layers' names: select by the layer "
                "type or by the parameter object, not by the name alone), or untie it."
            )


class TiedGradients:
    """Sums the gradients of this stage's tied parameters with their other copies before an update.

    Args:
        ties: All ties, in the order of :func:`find_ties`.
        stage: This process's stage.
        groups: Per tie, this replica's group of the owners (``None`` where this stage does not own it).
    """

    def __init__(self, ties: Sequence[Tie], stage: int, groups: Sequence[Any]) -> None:
        self.ties = [tie for tie in ties if tie.requires_grad]
        self.stage = stage
        self.groups = [g for tie, g in zip(ties, groups) if tie.requires_grad]
        self.local_names = {tie.names[stage] for tie in self.ties if stage in tie.names}
        """This stage's names of tied parameters: clipping leaves them out of the local norm."""

    @property
    def holders(self) -> tuple[tuple[int, ...], ...]:
        """Per trained tie, the stages holding a copy: the ties of the update's
        :class:`~lightning_async_pp.schedule.UpdatePlan`, whose tie indices are this object's."""
        return tuple(tuple(tie.owners) for tie in self.ties)

    def post_sum(self, index: int, grads: dict[str, Tensor], widen: bool) -> PostedSum:
        """Post the sum of tie ``index``'s gradient over its holders (non-blocking; this stage holds it); with
        ``widen`` (clipping) the sum is taken in float32, whose squared norm :meth:`post_norm` adds."""
        grad = grads[self.ties[index].names[self.stage]]
        summed = grad.float() if widen else grad
        return PostedSum(grad, summed, dist.all_reduce(summed, group=self.groups[index], async_op=True))

    @staticmethod
    def wait_sum(posted: PostedSum) -> None:
        """Wait for a tie's sum; copy a float32 sum back into its gradient."""
        posted.work.wait()
        if posted.summed is not posted.grad:
            posted.grad.copy_(posted.summed)

    def post_norm(self, norm_sq: Tensor, sums: Mapping[int, PostedSum], group: Any) -> tuple[Tensor, Any]:
        """Post the clipping norm's all-reduce over the pipeline (``group``), which carries only scalars: every
        stage's ``norm_sq`` (its squared norm of its untied gradients) and, from the lowest holder of each tie,
        the squared norm of its summed gradient, so that each tie counts once. The lowest holder's sums (in
        ``sums``, by tie index) must have arrived: the update's plan waits for them first.

        Returns:
            The all-reduced scalars and the work; :meth:`wait_norm` gives the global squared norm.
        """
        zero = norm_sq.new_zeros((), dtype=torch.float32)
        parts = [norm_sq.reshape(()).float()] + [zero] * len(self.ties)
        for index, posted in sums.items():
            if self.ties[index].owners[0] == self.stage:
                parts[1 + index] = posted.summed.pow(2).sum()
        flat = torch.stack(parts)
        return flat, dist.all_reduce(flat, group=group, async_op=True)

    def wait_norm(self, flat: Tensor, work: Any) -> Tensor:
        """Wait for :meth:`post_norm`'s all-reduce; the global squared norm (shape ``(1,)``)."""
        work.wait()
        total = flat[:1].clone()
        for index in range(len(self.ties)):
            total += flat[1 + index]  # in the order of the ties, as one device adds their norms
        return total


class PostedSum(NamedTuple):
    """A tie's sum in flight: the stage's gradient, the tensor summed (a float32 copy or the gradient) and the
    all-reduce's work."""

    grad: Tensor
    summed: Tensor
    work: Any


def new_tie_groups(
    ties: Sequence[Tie],
    rank_of: Callable[[int, int], int],
    replicas: int,
    replica: int,
    stage: int,
    backend: str | None = None,
    timeout: timedelta | None = None,
) -> tuple[list[Any], list[int]]:
    """Create one process group per tie and replica (a collective: every rank creates every group, in the
    same order).

    Args:
        ties: All ties, in the order of :func:`find_ties`.
        rank_of: ``rank_of(stage, replica)``, the global rank of a stage of a replica.
        replicas: Number of pipeline replicas.
        replica: This process's replica.
        stage: This process's stage.
        backend: Backend of the groups.
        timeout: How long a collective on them waits before it fails (``None``: torch's default).

    Returns:
        Per tie, this replica's group (``None`` where this stage owns no copy) and the global rank of the
        lowest owning stage in this replica.
    """
    groups, sources = [], []
    for tie in ties:
        mine = None
        for d in range(replicas):
            group = dist.new_group([rank_of(s, d) for s in tie.owners], backend=backend, timeout=timeout)
            if d == replica and stage in tie.names:
                mine = group
        groups.append(mine)
        sources.append(rank_of(tie.owners[0], replica))
    return groups, sources
