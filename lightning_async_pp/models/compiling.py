"""Compiling transformer blocks with ``torch.compile``, one block at a time, as torchtitan does.

Each block is compiled in place (:meth:`torch.nn.Module.compile`): the block keeps its class and its
parameter names, so state dicts and checkpoints read the same with and without compilation, and the
pipeline still cuts the model layer by layer.

Why this stays exact under 2BW, without a recompilation per weight version: a stage runs its layers with the
buffer of the micro-batch's pinned version in place of their parameters (as ``torch.func.functional_call``
does; :class:`~lightning_async_pp.runtime.versions_swap.ParameterSwap`), and ``torch.compile``
(which inlines ``nn.Module`` calls, torch >= 2.5) reads the block's parameters as graph inputs. Its guards
check a parameter's shape, dtype, device and ``requires_grad``, never its identity or storage, so both
versions' buffers run the same compiled graph. The graph differs only where the inputs do: a first call
without gradients (validation), a first block whose input needs no gradient, a new sequence length.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Union

from torch import nn

# A typing.Union, which every jsonargparse release reads in a signature (LightningCLI).
CompileOption = Union[bool, dict[str, Any]]  # noqa: UP007


def compile_kwargs(value: Any) -> dict[str, Any] | None:
    """The ``torch.compile`` keyword arguments a ``compile`` option asks for, or ``None`` for no compilation.

    Args:
        value: ``False`` (eager), ``True`` (``torch.compile``'s defaults: inductor) or a dict of
            ``torch.compile`` keyword arguments, e.g. ``{"backend": "aot_eager"}`` or ``{"mode": "max-autotune"}``.

    Raises:
        ValueError: ``value`` is none of these.
    """
    if isinstance(value, bool):
        return {} if value else None
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        return dict(value)
    raise ValueError(
        "`compile` must be True (torch.compile with its defaults), False, or a dict of torch.compile keyword "
        f"arguments such as {{'backend': 'aot_eager'}} or {{'mode': 'max-autotune'}}; got {value!r}."
    )


def compile_blocks(blocks: Iterable[nn.Module], value: CompileOption) -> int:
    """Compile each module of ``blocks`` in place, as the ``compile`` option ``value`` asks.

    Compilation is lazy: a block is traced at its first call, on the stage that runs it. A block built on
    the meta device keeps its compiled call when a stage materialises it (``to_empty`` works in place);
    a deep copy runs eagerly (``torch.nn.Module`` does not copy the compiled call).

    Args:
        blocks: The modules to compile, each on its own (the transformer blocks).
        value: See :func:`compile_kwargs`.

    Returns:
        The number of modules compiled (0 when ``value`` is ``False``).
    """
    kwargs = compile_kwargs(value)
    if kwargs is None:
        return 0
    count = 0
    for block in blocks:
        block.compile(**kwargs)
        count += 1
    return count


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` itself was compiled in place (:meth:`torch.nn.Module.compile`)."""
    return getattr(module, "_compiled_call_impl", None) is not None


__all__ = ["CompileOption", "compile_blocks", "compile_kwargs", "is_compiled"]
