"""Running a stage's layers on one weight version: the version's tensors stand in for the parameters.

:func:`torch.func.functional_call` does this by walking the module's parameters on every call (names, ties,
accessors): a fixed cost per call that, at two calls per micro-batch (forward, and backward for recomputing
layers), is host time the model never asked for. A stage's module does not change while it trains, so
:class:`ParameterSwap` finds every place a trainable parameter is registered once, and a swap is then one
dictionary assignment per place, in and back out.

Tied parameters (one tensor registered under several names inside the stage) are replaced at every name, as
``functional_call(..., tie_weights=True)`` does. Buffers and frozen parameters are left as they are.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from torch import Tensor, nn


class ParameterSwap:
    """Puts a weight version's tensors in place of a module's trainable parameters, for the length of a ``with``.

    Args:
        module: The stage's module. Its submodules and parameters must not be replaced afterwards (the
            optimizer holds the parameters too, so a training module never does).
        names: The names of the parameters to swap (``module.named_parameters()``'s, which name a tied
            parameter once); a version maps each of them to its tensor.

    Example::

        swap = ParameterSwap(module, params)
        with swap(version_tensors):
            y = module(x)
    """

    def __init__(self, module: nn.Module, names: Iterable[str]) -> None:
        wanted = set(names)
        canonical = {id(p): name for name, p in module.named_parameters() if name in wanted}
        missing = wanted - set(canonical.values())
        if missing:
            raise KeyError(f"{type(module).__name__} has no parameters named {sorted(missing)}.")
        # (the dict a parameter is registered in, its key there, the version's name for it), aliases included
        self._slots: list[tuple[dict[str, Tensor], str, str]] = []
        for full_name, param in module.named_parameters(remove_duplicate=False):
            name = canonical.get(id(param))
            if name is not None:
                owner, _, local = full_name.rpartition(".")
                self._slots.append((module.get_submodule(owner)._parameters, local, name))
        self._tensors: Mapping[str, Tensor] | None = None
        self._saved: list[Tensor] = []

    def __call__(self, tensors: Mapping[str, Tensor]) -> ParameterSwap:
        """Prepare a swap to ``tensors`` (by parameter name); it takes effect on entering the ``with``."""
        self._tensors = tensors
        return self

    def __enter__(self) -> None:
        tensors, saved = self._tensors, self._saved
        if tensors is None or saved:
            raise RuntimeError("ParameterSwap is entered once per call, with the tensors of one version.")
        for registry, key, name in self._slots:
            saved.append(registry[key])
            registry[key] = tensors[name]

    def __exit__(self, *exc_info: object) -> None:
        for (registry, key, _), original in zip(self._slots, self._saved):
            registry[key] = original
        self._saved = []
        self._tensors = None
