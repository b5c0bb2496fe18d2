"""Which part of :class:`~lightning_async_pp.optim.Muon` a parameter goes to: the names and module types that
send matrices to AdamW, and mixture-of-experts layers: which parameters are stacks of expert matrices and which
are routers, and how a stack is cut into the matrices Muon orthogonalizes.

Hugging Face ``transformers`` 5 stores a mixture-of-experts layer's experts stacked, one slice per expert (Mixtral's
``mlp.experts.gate_up_proj`` is ``(experts, 2 x intermediate, hidden)``, ``mlp.experts.down_proj`` ``(experts,
hidden, intermediate)``), beside a router whose weight has one row per expert (``mlp.gate.weight``, ``(experts,
hidden)``). The rules are in :class:`~lightning_async_pp.optim.Muon`'s docstring and in docs/optimizers.md.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "DEFAULT_ADAMW_PATTERNS",
    "DEFAULT_EXPERT_PATTERNS",
    "FUSED_GATE_UP",
    "ExpertStack",
    "describe_experts",
    "expert_roles",
    "holders",
    "module_classes",
    "patterns",
]

DEFAULT_ADAMW_PATTERNS: tuple[str, ...] = (
    "*embed*",
    "*wte*",
    "*wpe*",
    "*tok.*",
    "*pos.*",
    "*lm_head*",
    "head.*",
    "*.head.*",
)
"""Names (``fnmatch`` patterns on the full dotted parameter name) that go to AdamW although they are 2-D:
token/position embeddings and output heads in the usual naming schemes (nanoGPT, Hugging Face, timm, this
project's demo GPT)."""


def _module_class(entry: str | type) -> type:
    """A module class from itself or its import path (as YAML gives it)."""
    cls = entry
    if isinstance(entry, str):
        module_name, _, class_name = entry.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError, ValueError) as error:
            raise TypeError(
                f"`adamw_modules` entry {entry!r} cannot be imported ({error}); give a module class or its full"
                " import path, e.g. 'torch.nn.Embedding'."
            ) from error
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"`adamw_modules` entries must be nn.Module classes, got {entry!r}.")
    return cls


DEFAULT_EXPERT_PATTERNS: tuple[str, ...] = ("*experts",)
"""Names (``fnmatch`` patterns on the dotted name of the module that holds a parameter) of the modules that hold
a mixture-of-experts layer's weights stacked, one slice per expert: a module named ``experts``, as every
mixture-of-experts family of Hugging Face ``transformers`` 5 stores them (``mlp.experts.gate_up_proj``)."""

FUSED_GATE_UP = "gate_up_proj"
"""The name (last component) of a stack that holds each expert's gate and up projections fused, as Hugging Face
names it; Muon orthogonalizes the two halves separately."""

ROUTER, EXPERT_VECTORS = "router", "expert vectors"
"""The roles of a mixture-of-experts layer's 2-D parameters that are not matrices to orthogonalize."""


def patterns(option: str, value: Sequence[str]) -> tuple[str, ...]:
    """``value``, a sequence of ``fnmatch`` patterns given as the option ``option``, as a tuple.

    Raises:
        TypeError: For a single string (which would be a sequence of one-character patterns).
    """
    if isinstance(value, str):
        raise TypeError(f"`{option}` must be a sequence of patterns, got the string {value!r}.")
    return tuple(value)


def module_classes(entries: str | type | Sequence[str | type]) -> tuple[type, ...]:
    """``adamw_modules``'s entries as module classes (an entry may be a class or its import path).

    Raises:
        TypeError: For an entry that cannot be imported or is not an ``nn.Module`` class.
    """
    if isinstance(entries, (str, type)):
        entries = [entries]
    return tuple(_module_class(entry) for entry in entries)


def holders(params: Any, by_module: bool) -> tuple[Any, dict[Tensor, nn.Module]]:
    """``params`` as the optimizer takes them, and the module that holds each parameter when ``params`` is a
    module (empty otherwise, which routing by module type, ``by_module``, cannot do with)."""
    if isinstance(params, nn.Module):
        return params.named_parameters(), {p: m for m in params.modules() for p in m.parameters(recurse=False)}
    if by_module:
        raise TypeError(
            "`adamw_modules` routes parameters by the type of the module that holds them, so Muon needs the "
            "module itself: pass `Muon(model, ...)` (in a LightningModule, `optimizer(self)`) instead of its "
            "parameters, or route by name with `adamw_patterns`."
        )
    return params, {}


@dataclass(frozen=True)
class ExpertStack:
    """How a stack of expert matrices ``(experts, rows, cols)`` is cut into the matrices Muon orthogonalizes:
    each expert's matrix whole, or, for a fused gate and up projection, its two halves along ``axis`` (0: rows,
    1: columns), either the two contiguous halves (``[gate; up]``) or the even and odd rows or columns
    (``interleaved``, ``[gate0, up0, gate1, up1, ...]``)."""

    split: bool = False
    axis: int = 0
    interleaved: bool = False

    def matrices(self, stack: Tensor) -> list[Tensor]:
        """Views of ``stack``'s matrices, expert by expert (gate before up)."""
        out: list[Tensor] = []
        for matrix in stack.unbind(0):
            if not self.split:
                out.append(matrix)
            elif self.interleaved:
                out += [matrix[::2], matrix[1::2]] if self.axis == 0 else [matrix[:, ::2], matrix[:, 1::2]]
            else:
                out += matrix.chunk(2, dim=self.axis)
        return out

    def shapes(self, stack: Tensor) -> list[torch.Size]:
        """The shapes of :meth:`matrices`, without making views."""
        experts, rows, cols = stack.shape
        if self.split:
            rows, cols = (rows // 2, cols) if self.axis == 0 else (rows, cols // 2)
        return [torch.Size((rows, cols))] * (experts * (2 if self.split else 1))


def expert_roles(
    named: Sequence[tuple[str | None, Tensor]], holders: Mapping[Tensor, nn.Module], patterns: Sequence[str]
) -> dict[int, ExpertStack | str]:
    """The parameters of one parameter group (by index) that belong to a mixture-of-experts layer.

    Args:
        named: The group's parameters with their names (``None`` where unnamed).
        holders: The module that holds each parameter, where known (Muon given the model itself).
        patterns: ``fnmatch`` patterns of the names of experts modules.

    Returns:
        Per index: the :class:`ExpertStack` of a stack of expert matrices, :data:`EXPERT_VECTORS` for a 2-D
        parameter of an experts module (one row per expert: biases) or :data:`ROUTER` for a router's weight.
    """

    def named_experts(module: str | None) -> bool:
        return module is not None and any(fnmatchcase(module, pattern) for pattern in patterns)

    def counts_experts(tensor: Tensor) -> bool:  # held by a module whose `num_experts` is its first dim
        experts = getattr(holders.get(tensor), "num_experts", None)
        return isinstance(experts, int) and not isinstance(experts, bool) and experts == tensor.shape[0]

    roles: dict[int, ExpertStack | str] = {}
    experts_beside: dict[str, int] = {}  # the parent of an experts module: its number of experts
    stacking = set()  # the modules (given the model) that hold a stack of expert matrices
    for index, (name, tensor) in enumerate(named):
        module = _module(name)
        if tensor.ndim == 3 and (named_experts(module) or counts_experts(tensor)):
            roles[index] = _cut(name, tensor, holders.get(tensor), named)
            stacking.add(id(holders.get(tensor)))
            if module is not None:
                experts_beside[module.rpartition(".")[0]] = tensor.shape[0]
    experts_beside = {**_listed_experts(named, named_experts), **experts_beside}
    for index, (name, tensor) in enumerate(named):
        if index in roles or tensor.ndim != 2:
            continue
        module = _module(name)
        in_stacking = tensor in holders and id(holders[tensor]) in stacking
        if named_experts(module) or (counts_experts(tensor) and in_stacking):
            roles[index] = EXPERT_VECTORS
        elif any(experts_beside.get(block) == tensor.shape[0] for block in _enclosing(module, 2)):
            roles[index] = ROUTER  # beside the experts, or in a router module of its own (Hunyuan's gate.wg)
        elif counts_experts(tensor):  # e.g. transformers' `*TopKRouter`, which says its `num_experts`
            roles[index] = ROUTER
    return roles


def _listed_experts(named: Sequence[tuple[str | None, Tensor]], named_experts: Any) -> dict[str, int]:
    """Experts kept as a list of modules (``mlp.experts.0.w1.weight``, ``mlp.experts.1.w1.weight``, ...): the
    parent of each experts module, and its number of experts (of children)."""
    children: dict[str, set[str]] = {}
    for name, _ in named:
        path = [] if name is None else name.split(".")[:-1]
        for depth in range(len(path) - 1, 0, -1):  # the innermost experts module that is not the holder
            if named_experts(".".join(path[:depth])):
                children.setdefault(".".join(path[:depth]), set()).add(path[depth])
                break
    return {module.rpartition(".")[0]: len(names) for module, names in children.items()}


def _enclosing(module: str | None, levels: int) -> list[str]:
    """The modules ``levels`` levels up from ``module`` at most (``a.b.c``, 2: ``a.b``, ``a``)."""
    out: list[str] = []
    while module and len(out) < levels:
        module = module.rpartition(".")[0]
        out.append(module)
    return out


def _module(name: str | None) -> str | None:
    return None if name is None else name.rpartition(".")[0]


def _cut(
    name: str | None, stack: Tensor, holder: nn.Module | None, named: Sequence[tuple[str | None, Tensor]]
) -> ExpertStack:
    """How ``stack`` is cut: a fused gate and up projection into its two halves where its layout is known,
    anything else into one matrix per expert."""
    if name is None or name.rpartition(".")[2] != FUSED_GATE_UP:
        return ExpertStack()
    if holder is not None and hasattr(holder, "is_transposed"):  # transformers' experts say their layout
        interleaved = not getattr(holder, "is_concatenated", True)
        return ExpertStack(split=True, axis=1 if holder.is_transposed else 0, interleaved=interleaved)
    # Otherwise transformers' default layout, [gate; up] rows of (2I, H) matrices, where the down projection
    # beside it has the shape that layout gives it, (H, I).
    down = dict(named).get(f"{_module(name)}.down_proj")
    experts, rows, cols = stack.shape
    if down is not None and tuple(down.shape) == (experts, cols, rows // 2) and rows % 2 == 0:
        return ExpertStack(split=True)
    return ExpertStack()


def describe_experts(routing: Mapping[str, Any]) -> tuple[str, str]:
    """The routing line's words for the experts (``2 expert stacks as 24 matrices (8 experts)``) and for the
    routers (``; routers on AdamW: model.layers.0.mlp.gate.weight``), empty where there are none."""
    stacks, experts = "", ""
    if routing["muon_expert_stacks"]:
        count = routing["muon_expert_stacks"]
        numbers = " or ".join(map(str, routing["experts"]))
        stacks = f"{count} expert stack{'s' * (count != 1)} as {routing['muon_expert_matrices']} matrices"
        experts = f"{stacks} ({numbers} experts)"
    routers = "".join(
        f"; routers on {part}: {', '.join(names)}"
        for part, names in (("AdamW", routing["routers"]["adamw"]), ("Muon", routing["routers"]["muon"]))
        if names
    )
    return experts, routers
