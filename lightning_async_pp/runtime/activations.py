"""What travels between two stages: a tensor, or a tuple, list or dict of tensors, as one message.

A layer may return several tensors (hidden states plus whatever the next layer needs). A stage sends them
together, as one message of the :class:`~lightning_async_pp.runtime.comm.Channel`: the tensors in order
(a dict's in its key order), followed by a small int64 tensor, the *spec*, that says how to rebuild the
structure and which tensors carry gradients. A plain tensor travels alone, as before, without a spec.

Only floating-point tensors that require grad on the sending side get a gradient back; integer tensors,
masks and anything computed without grad travel forward only. The backward message holds exactly those
gradients, in order.

NCCL has no 16-bit integer type, so an ``int16`` tensor travels widened to ``int32`` and is narrowed back on
arrival (exact: every ``int16`` value is an ``int32``); its message always carries a spec, even for a plain
tensor, so that the receiver knows which tensors to narrow.

The spec is decoded once per negotiated layout (the receiver reads it when the layout was just learnt, at a
run start or for evaluation micro-batches of new shapes), so the steady state reads nothing on the host; the
sender checks that the structure does not change while the layout stays the same. The sender copies each spec
to the device once and sends that same tensor with every later message of that spec, so the steady state
copies nothing from the host either.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

_KINDS = ("tuple", "list", "dict", "tensor")
# dtypes NCCL cannot transfer, and the wider dtype that holds each of their values exactly.
WIDENED = {torch.int16: torch.int32}


@dataclass(frozen=True)
class Spec:
    """How a flat list of tensors is rebuilt into what a layer returned.

    Args:
        kind: ``"tensor"``, ``"tuple"``, ``"list"`` or ``"dict"``.
        keys: A dict's keys, in order.
        grads: Per tensor, whether it gets a gradient back (floating point and requiring grad when sent).
        widened: Per tensor, whether it travels in a wider dtype (:data:`WIDENED`) and is narrowed back on
            arrival; empty when none does.
    """

    kind: str
    keys: tuple[str, ...] = ()
    grads: tuple[bool, ...] = ()
    widened: tuple[bool, ...] = ()


# The encoded spec per (spec, device) (see `encoded`): a few per model, one per distinct payload structure.
_ENCODED: dict[tuple[Spec, torch.device], Tensor] = {}


def flatten(value: Any) -> tuple[list[Tensor], Spec]:
    """The tensors of ``value`` in order, and the spec that rebuilds it."""
    if isinstance(value, Tensor):
        return [value], Spec("tensor", grads=(_carries_grad(value),))
    if isinstance(value, Mapping):
        keys = tuple(value)
        if not all(isinstance(k, str) for k in keys):
            raise TypeError(f"A dict passed between pipeline stages must have string keys, got {keys}.")
        tensors, kind = [value[k] for k in keys], "dict"
    elif isinstance(value, (tuple, list)):
        keys, tensors, kind = (), list(value), "tuple" if isinstance(value, tuple) else "list"
    else:
        raise TypeError(_WHAT_TRAVELS + f" Got a {type(value).__name__}.")
    if not tensors or not all(isinstance(t, Tensor) for t in tensors):
        found = [type(t).__name__ for t in tensors]
        raise TypeError(_WHAT_TRAVELS + f" Got a {kind} of {found or 'nothing'}.")
    return tensors, Spec(kind, keys, tuple(_carries_grad(t) for t in tensors))


def unflatten(tensors: Sequence[Tensor], spec: Spec) -> Any:
    """Rebuild what :func:`flatten` took apart."""
    if spec.kind == "tensor":
        return tensors[0]
    if spec.kind == "dict":
        return dict(zip(spec.keys, tensors))
    return tuple(tensors) if spec.kind == "tuple" else list(tensors)


def encode(spec: Spec) -> Tensor:
    """``spec`` as an int64 CPU tensor: kind, tensor count, per tensor its flags (bit 0: gets a gradient,
    bit 1: widened), then each key's length and bytes."""
    widened = spec.widened or (False,) * len(spec.grads)
    values = [_KINDS.index(spec.kind), len(spec.grads), *(int(g) | int(w) << 1 for g, w in zip(spec.grads, widened))]
    for key in spec.keys:
        data = key.encode("utf-8")
        values += [len(data), *data]
    return torch.tensor(values, dtype=torch.int64)


def decode(tensor: Tensor) -> Spec:
    values = tensor.tolist()
    kind, count = _KINDS[values[0]], values[1]
    flags = values[2 : 2 + count]
    grads = tuple(bool(v & 1) for v in flags)
    widened = tuple(bool(v & 2) for v in flags) if any(v & 2 for v in flags) else ()
    keys, position = [], 2 + count
    while position < len(values):
        length = values[position]
        keys.append(bytes(values[position + 1 : position + 1 + length]).decode("utf-8"))
        position += 1 + length
    return Spec(kind, tuple(keys), grads, widened)


def message(value: Any) -> tuple[list[Tensor], Spec]:
    """The tensors to send for ``value`` (a plain tensor alone, otherwise followed by its encoded spec).

    The encoded spec is the same device tensor for every message of one spec (see :func:`encoded`): callers
    must not write to it.
    """
    tensors, spec = flatten(value)
    widened = tuple(t.dtype in WIDENED for t in tensors)
    if any(widened):
        spec = Spec(spec.kind, spec.keys, spec.grads, widened)
        tensors = [t.to(WIDENED[t.dtype]) if w else t for t, w in zip(tensors, widened)]
    elif spec.kind == "tensor":
        return tensors, spec
    return [*tensors, encoded(spec, tensors[0].device)], spec


def encoded(spec: Spec, device: torch.device) -> Tensor:
    """:func:`encode` of ``spec``, on ``device``: built and copied there once, then the same tensor every time.

    Every message of a multi-tensor payload carries its spec, but the receiver reads it only when it learns a
    layout; copying it from host memory for each micro-batch would cost a pageable host-to-device copy (and,
    on CUDA, a wait for the host's data) per send. The tensor is only read, by the sends, so one copy serves
    every message.
    """
    key = (spec, device)
    tensor = _ENCODED.get(key)
    if tensor is None:
        tensor = _ENCODED[key] = encode(spec).to(device)
    return tensor


def read_message(tensors: Sequence[Tensor], known: Spec | None) -> tuple[Any, Spec]:
    """Rebuild a received message; ``known`` is the spec learnt earlier in this layout (``None``: decode it)."""
    if len(tensors) == 1:
        spec = Spec("tensor", grads=(tensors[0].is_floating_point(),))
        return tensors[0], spec
    spec = known if known is not None else decode(tensors[-1])
    received = list(tensors[:-1])
    if spec.widened:
        narrow = {wide: narrow for narrow, wide in WIDENED.items()}
        received = [t.to(narrow[t.dtype]) if w else t for t, w in zip(received, spec.widened)]
    return unflatten(received, spec), spec


def with_grad_inputs(value: Any, spec: Spec) -> Any:
    """Mark the received tensors that get a gradient back as requiring grad (in place)."""
    tensors, _ = flatten(value)
    for tensor, grad in zip(tensors, spec.grads):
        if grad:
            tensor.requires_grad_(True)
    return value


def differentiable(value: Any, spec: Spec) -> list[Tensor]:
    """The tensors of ``value`` that get (or send back) a gradient, in order."""
    tensors, _ = flatten(value)
    return [t for t, grad in zip(tensors, spec.grads) if grad]


def input_grads(value: Any, spec: Spec) -> list[Tensor]:
    """After a backward: the gradients of the received tensors that carry one (zeros where a tensor was unused)."""
    return [t.grad if t.grad is not None else torch.zeros_like(t) for t in differentiable(value, spec)]


def _carries_grad(t: Tensor) -> bool:
    return t.is_floating_point() and t.requires_grad


_WHAT_TRAVELS = (
    "What a pipeline layer passes to the next one must be a tensor, or a tuple, list or dict (string keys) of "
    "tensors; recompute other values from the micro-batch in the layer that needs them (`reads_batch = True`)."
)


class LinkStructures:
    """The structure (:class:`Spec`) of the messages on a stage's two links: learnt from the first message of a
    layout, then held to for the rest of the run, so that a stage whose output changes structure is stopped
    with a message instead of sending what the next stage would misread.

    Args:
        stage: The stage's index, for the message.
    """

    def __init__(self, stage: int) -> None:
        self.stage = stage
        self.received: Spec | None = None
        self.sent: Spec | None = None

    def forget(self) -> None:
        """A new layout: learn both structures again from the next messages."""
        self.received = self.sent = None

    def read(self, tensors: Sequence[Tensor]) -> tuple[Any, Spec]:
        """A message from the previous stage, as the value it sent, and its structure."""
        value, self.received = read_message(tensors, self.received)
        return value, self.received

    def message(self, value: Any) -> tuple[list[Tensor], Spec]:
        """``value`` as the tensors of a message to the next stage, after checking it has the run's structure."""
        tensors, spec = message(value)
        if self.sent is None:
            self.sent = spec
        elif spec != self.sent:
            raise RuntimeError(
                f"Pipeline stage {self.stage} passed {spec} to the next stage after {self.sent} in the same run "
                "(structure, keys or which tensors require grad). Make every micro-batch's output the same "
                "structure."
            )
        return tensors, spec
