"""The precision of Muon's Newton-Schulz products: float32 or bfloat16, per optimizer or for a block of code.

:func:`newton_schulz_dtype` sets it for a block (torch's own ``torch.optim.Muon`` included, whose module it
patches while the block runs); :class:`~lightning_async_pp.optim.Muon` reads :func:`block_dtype` when built with
``ns_dtype="auto"``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.optim._muon as _torch_muon
from torch import Tensor

__all__ = [
    "NEWTON_SCHULZ_DTYPES",
    "auto_newton_schulz_dtype",
    "block_dtype",
    "check_ns_dtype",
    "newton_schulz_dtype",
    "torch_newton_schulz",
    "use_float32_newton_schulz",
    "zeropower_via_newtonschulz_float32",
]


def zeropower_via_newtonschulz_float32(
    grad: Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float
) -> Tensor:
    """``torch.optim._muon._zeropower_via_newtonschulz`` with float32 instead of bfloat16 products.

    Args:
        grad: The 2-D update to orthogonalize.
        ns_coefficients: The iteration's ``(a, b, c)``.
        ns_steps: Iterations.
        eps: Floor of the norm that ``grad`` is divided by first.

    Returns:
        The orthogonalized update, in ``grad``'s dtype.
    """
    a, b, c = ns_coefficients
    x = grad.float()
    if grad.size(0) > grad.size(1):
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    if grad.size(0) > grad.size(1):
        x = x.T
    return x.to(grad.dtype)


NEWTON_SCHULZ_DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16")
"""Values of :class:`~lightning_async_pp.optim.Muon`'s ``ns_dtype``: the precision of the Newton-Schulz products."""

# torch's own iteration (bfloat16 products), kept before anything patches the module.
_TORCH_NEWTON_SCHULZ = _torch_muon._zeropower_via_newtonschulz
_NEWTON_SCHULZ = {"float32": zeropower_via_newtonschulz_float32, "bfloat16": _TORCH_NEWTON_SCHULZ}
# The precision `newton_schulz_dtype` sets for the block it runs, or None outside any block.
_process_dtype: str | None = None


def check_ns_dtype(ns_dtype: str, *, allow_auto: bool = True) -> str:
    """``ns_dtype`` if it is one of :data:`NEWTON_SCHULZ_DTYPES` (``"auto"`` only if ``allow_auto``)."""
    allowed = NEWTON_SCHULZ_DTYPES if allow_auto else NEWTON_SCHULZ_DTYPES[1:]
    if ns_dtype not in allowed:
        raise ValueError(f"`ns_dtype` must be one of {', '.join(map(repr, allowed))}, got {ns_dtype!r}.")
    return ns_dtype


def auto_newton_schulz_dtype(device: torch.device) -> str:
    """The precision ``ns_dtype="auto"`` picks on ``device``: bfloat16 on CUDA, float32 elsewhere.

    bfloat16 products are a GPU speed trick: tensor cores run them at twice the float32 rate. A CPU runs them
    in software unless it has bfloat16 matrix units (an AMD EPYC without AVX512-BF16: 14x slower than float32 on a
    128 x 512 update), and float32 is also the more precise iteration, whose result does not depend on the
    CPU's bfloat16 rounding: on a CPU, float32 is both faster and reproducible across machines.

    Args:
        device: The device of the parameters that the step updates.
    """
    return "bfloat16" if device.type == "cuda" else "float32"


@contextlib.contextmanager
def torch_newton_schulz(ns_dtype: str) -> Iterator[None]:
    """torch.optim.Muon's iteration in ``ns_dtype`` for the block (one optimizer's step)."""
    # torch.optim.Muon looks the iteration up in its module at each step: swap it for the block, then put
    # back whatever was there (an enclosing block's choice included).
    previous = _torch_muon._zeropower_via_newtonschulz
    _torch_muon._zeropower_via_newtonschulz = _NEWTON_SCHULZ[ns_dtype]
    try:
        yield
    finally:
        _torch_muon._zeropower_via_newtonschulz = previous


@contextlib.contextmanager
def newton_schulz_dtype(ns_dtype: str) -> Iterator[None]:
    """Within the block, Newton-Schulz runs in ``ns_dtype`` for every :class:`torch.optim.Muon` step and for
    every :class:`~lightning_async_pp.optim.Muon` built with ``ns_dtype="auto"`` (one given ``"float32"`` or
    ``"bfloat16"`` keeps its own).

    For studies and tests that compare runs across machines or pipeline shapes, where the bfloat16 rounding
    of the hardware must not enter: a float32 rounding difference in a gradient (another summation order of a
    clipping norm, say) can flip a bfloat16 rounding and move an update by ~1e-4, by an amount that differs
    from one CPU to the next; in float32 the same difference stays at float32 rounding. Patches
    ``torch.optim._muon`` for the whole process while the block runs.

    Args:
        ns_dtype: ``"float32"`` or ``"bfloat16"``.

    Raises:
        ValueError: For another ``ns_dtype``.
    """
    global _process_dtype
    check_ns_dtype(ns_dtype, allow_auto=False)
    previous, _process_dtype = _process_dtype, ns_dtype
    try:
        with torch_newton_schulz(ns_dtype):
            yield
    finally:
        _process_dtype = previous


def block_dtype() -> str | None:
    """The precision the innermost running :func:`newton_schulz_dtype` block sets, ``None`` outside any."""
    return _process_dtype


def use_float32_newton_schulz() -> contextlib.AbstractContextManager[None]:
    """``newton_schulz_dtype("float32")``: float32 Newton-Schulz in the block, for torch.optim.Muon too."""
    return newton_schulz_dtype("float32")
