"""One low-precision copy of each weight per weight version, shared by the micro-batches that run on it.

Under autocast (``bf16-mixed``) each micro-batch's forward is its own autocast region, and Lightning's
autocast keeps no cast cache: every ``nn.Linear`` casts its float32 weight to bfloat16 again, and each
micro-batch's graph keeps its own cast for the backward (the matrix product needs it for the input's
gradient). A stage with ``k`` micro-batches in flight holds ``k`` bfloat16 copies of its weight matrices.

:class:`WeightCasts` casts each such weight once per weight version and puts the cast where the parameter is
registered, for the length of a forward: autocast then finds a tensor already in its dtype and casts nothing.
The cast is ``w.to(dtype)`` made with gradients on, as autocast's own is, so its backward node (which saves
nothing) turns each micro-batch's gradient into float32 and accumulates it into the version's tensor exactly
as a cast per micro-batch would: results are bitwise the same. The cache holds its casts weakly: a cast lives
as long as some in-flight micro-batch's graph keeps it, and no longer (not across an update, an evaluation or
a step whose layers recompute).

Which weights: those registered only as ``weight`` or ``bias`` of modules whose ``forward`` is exactly
``nn.Linear.forward`` or ``nn.Conv{1,2,3}d.forward`` (not an override), where autocast would cast them anyway;
not inside a layer wrapped for recomputation (a cast would only add a copy for the length of the recompute) or
inside a compiled module (``torch.compile`` runs the hooks of the check below as it traced them, so the check
cannot see the calls: such weights are cast per use, as before).
A parameter registered in two such modules (tied within the stage) gets one cast per module, so that each
use's gradient reaches float32 on its own, as today. The first training forward runs on the float32 weights
and checks, per module, that it is called once and under autocast of the cast dtype; the others (a module
called twice per forward, whose two gradients would otherwise be summed in bfloat16; a projection run with
autocast off) keep their float32 weights. Not seen: a forward that reads such a weight outside the module's
own call (``self.proj.weight.norm()``); it would read the cast.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_async_pp.runtime.recompute import is_checkpointed

_CASTING_FORWARDS = frozenset({nn.Linear.forward, nn.Conv1d.forward, nn.Conv2d.forward, nn.Conv3d.forward})


def autocast_dtype(
    forward_context: Callable[[], contextlib.AbstractContextManager], device_type: str
) -> torch.dtype | None:
    """The dtype ``forward_context`` autocasts to on ``device_type`` (entered once to find out), or ``None``."""
    with forward_context():
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    return None


class WeightCasts:
    """Puts one cached cast per weight version in place of the weights autocast would cast, during a forward.

    Args:
        module: The stage's module (or the whole model on one device).
        names: The trainable parameters' names (``module.named_parameters()``'s); a version maps each to its tensor.
        dtype: The autocast dtype, or ``None`` (nothing is cast: the context does nothing).
        device_type: The autocast device type (``"cuda"``, ``"cpu"``).

    Enter it inside the forward context and inside the parameter swap, for forwards only::

        with forward_context(), swap(version_tensors), casts(version_tensors, version):
            y = module(x)
    """

    def __init__(self, module: nn.Module, names: Sequence[str], dtype: torch.dtype | None, device_type: str) -> None:
        self.dtype, self.device_type = dtype, device_type
        wanted = set(names)
        # Recomputed layers would hold a cast only for their recompute; compiled ones run their submodules' hooks
        # as traced at compile time, so the first forward's check cannot see their calls.
        left_out = {
            id(m) for layer in module.modules() if is_checkpointed(layer) or _compiled(layer) for m in layer.modules()
        }
        # Every place each parameter is registered: castable only if each place is a casting module's own slot.
        places: dict[int, list[tuple[nn.Module, str]]] = {}
        names_of: dict[int, str] = {}
        for owner in module.modules():
            for local, param in owner._parameters.items():
                if param is not None:
                    places.setdefault(id(param), []).append((owner, local))
        for name, param in module.named_parameters():
            names_of[id(param)] = name
        self._slots: list[tuple[nn.Module, str, str]] = []  # (module, "weight"/"bias", the version's name)
        for key, registrations in places.items():
            name = names_of.get(key)
            if dtype is None or name not in wanted:
                continue
            if all(_casts_itself(owner, local) and id(owner) not in left_out for owner, local in registrations):
                self._slots.extend((owner, local, name) for owner, local in registrations)
        self._checked = not self._slots
        self._cache: dict[int, tuple[int, Tensor, int, weakref.ref]] = {}  # slot -> key, source, its _version, cast
        self._tensors: Mapping[str, Tensor] | None = None
        self._key: int | None = None
        self._restore: Mapping[str, Tensor] | None = None  # the version's tensors, put back on exit
        self._probe: dict[int, list[bool]] = {}  # module -> whether autocast was on at each of its calls
        self._handles: list[RemovableHandle] = []

    @property
    def num_cast(self) -> int:
        """How many parameter registrations get a cached cast (after the first training forward)."""
        return len(self._slots)

    def __call__(self, tensors: Mapping[str, Tensor], key: int) -> WeightCasts:
        """Prepare the casts of ``tensors``, one version's; ``key`` names that version (a cast made for another
        key is never reused)."""
        self._tensors, self._key = tensors, key
        return self

    def __enter__(self) -> None:
        tensors, key = self._tensors, self._key
        self._tensors = self._key = None
        if not self._slots or not torch.is_grad_enabled():
            return
        if not self._checked:
            self._start_probe()
            return
        self._restore = tensors
        for index, (owner, local, name) in enumerate(self._slots):
            owner._parameters[local] = self._cast(index, tensors[name], key)

    def __exit__(self, *exc_info: object) -> None:
        if self._probe:
            self._end_probe()
        if self._restore is not None:
            for owner, local, name in self._slots:
                owner._parameters[local] = self._restore[name]
            self._restore = None

    def _cast(self, index: int, source: Tensor, key: int) -> Tensor:
        entry = self._cache.get(index)
        if entry is not None:
            cached_key, cached_source, version, ref = entry
            cast = ref()
            if cast is not None and cached_key == key and cached_source is source and version == source._version:
                return cast
        if not _autocast_casts(source, self.dtype, self.device_type):
            return source
        cast = source.to(self.dtype)
        self._cache[index] = (key, source, source._version, weakref.ref(cast))
        return cast

    # --- the first training forward: which modules are called once, under autocast of the cast dtype ---------

    def _start_probe(self) -> None:
        for owner in {id(o): o for o, _, _ in self._slots}.values():
            calls = self._probe.setdefault(id(owner), [])
            self._handles.append(
                owner.register_forward_pre_hook(lambda m, a, calls=calls: calls.append(self._autocasts()))
            )

    def _autocasts(self) -> bool:
        return torch.is_autocast_enabled(self.device_type) and torch.get_autocast_dtype(self.device_type) == self.dtype

    def _end_probe(self) -> None:
        for handle in self._handles:
            handle.remove()
        probe, self._probe, self._handles = self._probe, {}, []
        self._slots = [(o, local, n) for o, local, n in self._slots if probe[id(o)] == [True]]
        self._checked = True


def _autocast_casts(tensor: Tensor, dtype: torch.dtype, device_type: str) -> bool:
    # autocast's own rule: floating tensors of its device, double excepted
    return (
        tensor.is_floating_point() and tensor.dtype not in (torch.float64, dtype) and tensor.device.type == device_type
    )


def _compiled(module: nn.Module) -> bool:
    # nn.Module.compile() in place, or the module torch.compile(module) returns
    return getattr(module, "_compiled_call_impl", None) is not None or hasattr(module, "_orig_mod")


def _casts_itself(owner: nn.Module, local: str) -> bool:
    return (
        local in ("weight", "bias")
        and type(owner).forward in _CASTING_FORWARDS
        and "forward" not in vars(owner)
        and not owner._forward_hooks
        and not owner._forward_pre_hooks
    )
