"""Parameters shared by layers on different stages (tied weights, e.g. an embedding reused as output head).

On one device a tied parameter is one tensor: both uses add to its gradient and one update moves it. In a
pipeline its layers live in different processes, so each owning stage keeps a copy, as DeepSpeed's
``TiedLayerSpec`` and Megatron's embedding group do. The copies stay bit-identical because

- they start equal: after placement every copy is overwritten by the lowest owning stage's (which also
  makes a model materialised from the meta device consistent);
- every owner applies the same update to the same value: before each (delayed) update, the owners sum
  their gradients over a process group of the tie's owners (one group per tie and replica), so each sees
  the gradient the single-device model would; an all-reduce hands every member the same bits;
- gradient clipping counts a tied parameter once: with clipping, the tied gradients travel in the
  pipeline's norm all-reduce, and every stage adds the squared norm of each summed tied gradient once.

The last point needs every copy to be in an optimizer parameter group with the same settings. On one device
the parameter is one tensor, reached first under one name, so it lands in one group; in a pipeline each stage
builds its groups from its own layers' names (a rule such as "no weight decay for embeddings" then puts the
head's copy elsewhere). :func:`check_tied_updates` compares the settings once, before training, and refuses
a difference.

The module knows nothing of Lightning: the strategy finds the ties before it drops other stages' layers
and creates the groups; :class:`~lightning_async_pp.runtime.stage.StageRuntime` calls
:meth:`TiedGradients.start` in its update.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

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

    def start(
        self,
        grads: dict[str, Tensor],
        norm_sq: Tensor | None = None,
        norm_group: Any = None,
    ) -> Callable[[], Tensor | None]:
        """Post the sums (non-blocking); the returned function waits for them and writes them into ``grads``.

        Without ``norm_sq``: one all-reduce per owned tie over its owners. With ``norm_sq`` (this stage's
        squared norm of its untied gradients): one all-reduce over the whole pipeline (``norm_group``) that
        carries every tie's gradient (zeros where a stage holds no copy) beside the squared norms; the
        returned function then gives the global squared norm, counting each tied parameter once.
        """
        if norm_sq is None:
            works = [
                dist.all_reduce(grads[tie.names[self.stage]], group=group, async_op=True)
                for tie, group in zip(self.ties, self.groups)
                if self.stage in tie.names
            ]

            def finish_sums() -> None:
                for work in works:
                    work.wait()

            return finish_sums

        device = norm_sq.device
        parts = [norm_sq.reshape(1).float()]
        for tie in self.ties:
            name = tie.names.get(self.stage)
            if name is None:
                parts.append(torch.zeros(tie.shape, dtype=torch.float32, device=device).reshape(-1))
            else:
                parts.append(grads[name].float().reshape(-1))
        flat = torch.cat(parts)
        work = dist.all_reduce(flat, group=norm_group, async_op=True)

        def finish_with_norm() -> Tensor:
            work.wait()
            total = flat[:1].clone()
            offset = 1
            for tie in self.ties:
                numel = int(torch.Size(tie.shape).numel())
                summed = flat[offset : offset + numel]
                offset += numel
                total += summed.pow(2).sum()
                name = tie.names.get(self.stage)
                if name is not None:
                    grads[name].copy_(summed.view(tie.shape))
            return total

        return finish_with_norm


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
