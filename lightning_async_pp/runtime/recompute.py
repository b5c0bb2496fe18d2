"""Activation checkpointing: layers that keep only their input and recompute their forward in backward.

Under 2BW a micro-batch runs on the weight version it was pinned to, not on the module's own (newest)
parameters. A recompute runs later, inside backward, so the runtime runs every backward under the same
re-parametrization as the forward (see :class:`~lightning_async_pp.runtime.stage.StageRuntime`): the
recompute reads the pinned version, whether the layer calls ``torch.utils.checkpoint`` itself or was
wrapped by :func:`checkpoint_layers`.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any, Union

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

# A typing.Union, which every jsonargparse release reads in a signature (LightningCLI).
ActivationCheckpointing = Union[bool, Sequence[int | str | type]]  # noqa: UP007
_MARK = "_async_pp_checkpointed"


def check_option(value: Any) -> None:
    """Raise a ``ValueError`` unless ``value`` is a valid ``activation_checkpointing`` setting."""
    if isinstance(value, bool):
        return
    if (
        isinstance(value, (str, bytes))
        or not isinstance(value, Sequence)
        or not all((isinstance(v, int) and not isinstance(v, bool)) or isinstance(v, (str, type)) for v in value)
    ):
        raise ValueError(
            "`activation_checkpointing` must be True (every layer), False, or a list of layer indices, layer types "
            f"or layer class names (e.g. [1, 2] or ['Block']); got {value!r}."
        )


def select_layers(layers: Sequence[nn.Module], value: ActivationCheckpointing) -> list[int]:
    """The indices of the layers ``value`` selects (see :func:`check_option`), in order.

    Raises:
        ValueError: An index is out of range, or a type or class name matches no layer.
    """
    check_option(value)
    if isinstance(value, bool):
        return list(range(len(layers))) if value else []
    chosen: set[int] = set()
    for item in value:
        if isinstance(item, int):
            if not -len(layers) <= item < len(layers):
                raise ValueError(
                    f"`activation_checkpointing` names layer index {item}, but the model has {len(layers)} pipeline "
                    f"layers (0 to {len(layers) - 1})."
                )
            chosen.add(item % len(layers))
            continue
        matches = {i for i, layer in enumerate(layers) if _is(layer, item)}
        if not matches:
            kinds = ", ".join(sorted({type(layer).__name__ for layer in layers}))
            raise ValueError(
                f"`activation_checkpointing` entry {getattr(item, '__name__', item)!r} matches no layer; the pipeline "
                f"layers are of types {kinds}."
            )
        chosen |= matches
    return sorted(chosen)


def _is(layer: nn.Module, kind: str | type) -> bool:
    if isinstance(kind, type):
        return isinstance(layer, kind)
    return any(cls.__name__ == kind or f"{cls.__module__}.{cls.__qualname__}" == kind for cls in type(layer).__mro__)


def checkpoint_layers(layers: Sequence[nn.Module], indices: Sequence[int]) -> None:
    """Make the layers at ``indices`` recompute their forward in backward instead of keeping activations.

    The layer keeps its class, attributes and parameter names (checkpoints are unchanged): only its
    ``forward`` is wrapped, in the instance, by ``torch.utils.checkpoint`` (non-reentrant). Without
    gradients (validation) it runs as before. A layer wrapped already stays as it is.
    """
    for index in indices:
        layer = layers[index]
        if getattr(layer, _MARK, False):
            continue  # the same model fitted again
        # A method bound to the layer: a deep copy of the model rebinds it to the copy.
        layer.forward = types.MethodType(_recomputed_forward, layer)
        setattr(layer, _MARK, True)


def is_checkpointed(layer: nn.Module) -> bool:
    """Whether :func:`checkpoint_layers` made ``layer`` recompute its forward."""
    return getattr(layer, _MARK, False)


def _recomputed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    forward = type(self).forward.__get__(self)
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
