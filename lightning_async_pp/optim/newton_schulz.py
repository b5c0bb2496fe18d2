"""Muon's Newton-Schulz iteration: one matrix at a time or a stack of them at once, and its precision (float32 or
bfloat16), per optimizer or for a block of code.

:func:`newton_schulz_dtype` sets the precision for a block (torch's own ``torch.optim.Muon`` included, whose
module it patches while the block runs); :class:`~lightning_async_pp.optim.Muon` reads :func:`block_dtype` when
built with ``ns_dtype="auto"``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.optim._muon as _torch_muon
from torch import Tensor

__all__ = [
    "NEWTON_SCHULZ_DTYPES",
    "NS_BATCH_BYTES",
    "NS_BATCH_BYTES_CPU",
    "auto_newton_schulz_dtype",
    "auto_ns_batch_bytes",
    "block_dtype",
    "check_ns_batch_bytes",
    "check_ns_dtype",
    "newton_schulz_dtype",
    "newton_schulz_iterations",
    "normalize_",
    "torch_newton_schulz",
    "use_float32_newton_schulz",
    "zeropower_via_newtonschulz_batched",
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


def zeropower_via_newtonschulz_batched(
    stack: Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float
) -> Tensor:
    """The Newton-Schulz iteration of :func:`zeropower_via_newtonschulz_float32` (and of torch's bfloat16 one)
    on a stack of wide matrices at once, in the stack's dtype.

    Each matrix is divided by its own norm and iterated with batched products (``bmm``/``baddbmm``), so its
    result does not depend on the other matrices of the stack. A norm is summed in the order of the matrix's
    memory: pass tall matrices as a transposed view (``torch.stack(tall).mT``), as the per-matrix functions
    transpose them, and on CPU each result has the bits of the per-matrix iteration (another summation order
    moves it by up to ~2e-6 relative in float32).

    Args:
        stack: ``(n, rows, cols)`` with ``rows <= cols``, overwritten.
        ns_coefficients: The iteration's ``(a, b, c)``.
        ns_steps: Iterations.
        eps: Floor of the norm that each matrix is divided by first.

    Returns:
        The orthogonalized matrices, ``(n, rows, cols)`` in ``stack``'s dtype.
    """
    return newton_schulz_iterations(normalize_(stack, eps), ns_coefficients, ns_steps)


def normalize_(stack: Tensor, eps: float) -> Tensor:
    """Divide each matrix of ``stack`` by its norm (at least ``eps``), in place."""
    return stack.div_(stack.norm(dim=(-2, -1), keepdim=True).clamp_(min=eps))


def newton_schulz_iterations(x: Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int) -> Tensor:
    if ns_steps >= 100:
        raise ValueError(f"`ns_steps` must be less than 100 (torch.optim.Muon's limit), got {ns_steps}.")
    if len(ns_coefficients) != 3:
        raise ValueError(f"`ns_coefficients` must be three numbers (a, b, c), got {ns_coefficients!r}.")
    if ns_steps == 0:
        return x
    a, b, c = ns_coefficients
    # The products write into buffers taken once and reused by every iteration: on CPU a fresh block of this
    # size is fresh pages from the kernel each time, and `baddbmm` copies its first argument into its output,
    # which costs as much as the products when the memory is cold. (`contiguous()`: tall matrices come as a
    # transposed view.)
    x = x.contiguous()
    n, rows, _ = x.shape
    gram = x.new_empty(n, rows, rows)
    polynomial = x.new_empty(n, rows, rows)
    other = torch.empty_like(x)
    pair, other_pair = (x, x.mT), (other, other.mT)
    for _ in range(ns_steps):
        torch.bmm(*pair, out=gram)
        torch.baddbmm(gram, gram, gram, beta=b, alpha=c, out=polynomial)
        torch.baddbmm(pair[0], polynomial, pair[0], beta=a, out=other_pair[0])
        pair, other_pair = other_pair, pair
    return pair[0]


NEWTON_SCHULZ_DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16")
"""Values of :class:`Muon`'s ``ns_dtype``: the precision of the Newton-Schulz products."""

# torch's own iteration (bfloat16 products), kept before anything patches the module.
_TORCH_NEWTON_SCHULZ = _torch_muon._zeropower_via_newtonschulz
NS_BATCH_BYTES = 128 * 2**20
"""What ``ns_batch_bytes=None`` means on a GPU (anything but a CPU): at most this many bytes of matrices (in
the Newton-Schulz precision) are orthogonalized in one batch."""
NS_BATCH_BYTES_CPU = 4 * 2**20
"""What ``ns_batch_bytes=None`` means on CPU: batches of about the cache a core has."""


def check_ns_batch_bytes(ns_batch_bytes: int | None) -> int | None:
    """``ns_batch_bytes`` if it is ``None`` or a positive number of bytes.

    Raises:
        ValueError: For anything else, naming both defaults.
    """
    if ns_batch_bytes is not None and (
        isinstance(ns_batch_bytes, bool) or not isinstance(ns_batch_bytes, int) or ns_batch_bytes < 1
    ):
        raise ValueError(
            f"`ns_batch_bytes` must be a positive number of bytes, or None for {NS_BATCH_BYTES_CPU} on CPU and"
            f" {NS_BATCH_BYTES} elsewhere, got {ns_batch_bytes!r}."
        )
    return ns_batch_bytes


def auto_ns_batch_bytes(device: torch.device) -> int:
    """The batch bound ``ns_batch_bytes=None`` picks on ``device``: 4 MiB on CPU, 128 MiB elsewhere.

    On a GPU a batch is the more efficient the larger it is (each product is one launch, and larger ones fill
    the device); 128 MiB keeps its temporaries at a few hundred MiB. A CPU runs the same arithmetic whichever
    the batch, but the batched step's memory-bound passes (stacking, and ``baddbmm`` copying its input into
    its output) run from the cache for a small batch and from memory for a large one: at 24 blocks of width
    256, one batch per shape took 1.2x the per-matrix step's time, 4 MiB batches 1.03-1.07x (on a shared machine).

    Args:
        device: The device of the matrices.
    """
    return NS_BATCH_BYTES_CPU if device.type == "cpu" else NS_BATCH_BYTES


_NEWTON_SCHULZ = {"float32": zeropower_via_newtonschulz_float32, "bfloat16": _TORCH_NEWTON_SCHULZ}
# The precision `newton_schulz_dtype` sets for the block it runs, or None outside any block.
_process_dtype: str | None = None


def check_ns_dtype(ns_dtype: str, *, allow_auto: bool = True) -> str:
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
    every :class:`Muon` built with ``ns_dtype="auto"`` (a :class:`Muon` given ``"float32"`` or ``"bfloat16"``
    keeps its own).

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


def use_float32_newton_schulz() -> contextlib.AbstractContextManager[None]:
    """``newton_schulz_dtype("float32")``: float32 Newton-Schulz in the block, for torch.optim.Muon too."""
    return newton_schulz_dtype("float32")


def block_dtype() -> str | None:
    """The precision a :func:`newton_schulz_dtype` block sets, or ``None`` outside any block."""
    return _process_dtype
