"""The two optimizers :class:`~lightning_async_pp.optim.Muon` hands its parameters to: :class:`MatrixMuon` for
matrices and kernels (the Newton-Schulz of a step batched over matrices of one shape) and :class:`AdamWPart` for
the rest.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.optim._muon as _torch_muon
from torch import Tensor, nn
from torch.optim import AdamW
from torch.optim.optimizer import _to_scalar

from lightning_async_pp.optim.muon_routing import ExpertStack
from lightning_async_pp.optim.newton_schulz import (
    auto_newton_schulz_dtype,
    auto_ns_batch_bytes,
    block_dtype,
    newton_schulz_iterations,
    normalize_,
    torch_newton_schulz,
)

__all__ = ["AdamWPart", "MatrixMuon"]


def _as_matrix(tensor: Tensor) -> Tensor:
    """A kernel (more than 2 dims) as the (out_channels, in_channels x kernel) matrix Muon orthogonalizes."""
    return tensor if tensor.ndim == 2 else tensor.view(tensor.shape[0], -1)


class MatrixMuon(torch.optim.Muon):
    """:class:`torch.optim.Muon`, whose step also takes kernels and stacks of expert matrices: a kernel is updated
    as its matrix ``(shape[0], -1)``, a view of the parameter, its gradient and its momentum buffer, as Muon's
    reference implementation does for convolution filters; a stack in :attr:`expert_stacks` as the matrices its
    :class:`ExpertStack` cuts it into, views likewise. The learning-rate adjustment then sees the matrix shape.
    2-D parameters go through torch's code unchanged."""

    expert_stacks: dict[Tensor, ExpertStack]
    """The parameters that are stacks of expert matrices, and how each is cut (the others are matrices or
    kernels). Kept here rather than in the parameter groups, whose dicts a state dict replaces."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.expert_stacks = {}
        super().__init__(*args, **kwargs)

    def _init_group(
        self,
        group: MutableMapping,
        params_with_grad: list[Tensor],
        grads: list[Tensor],
        muon_momentum_bufs: list[Tensor],
    ) -> bool:
        kernels = [p for p in group["params"] if p.grad is not None and p.ndim > 2]
        if not kernels:
            return super()._init_group(group, params_with_grad, grads, muon_momentum_bufs)
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.ndim == 2:
                super()._init_group({"params": [p]}, params_with_grad, grads, muon_momentum_bufs)
                continue
            if torch.is_complex(p) or p.grad.is_sparse:
                raise RuntimeError("Muon supports neither complex parameters nor sparse gradients")
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            elif not state["momentum_buffer"].is_contiguous():
                state["momentum_buffer"] = state["momentum_buffer"].contiguous()
            flat = p
            if not p.is_contiguous():  # e.g. channels_last: update a contiguous copy, written back after the step
                flat = p.contiguous()
                self._write_back.append((p, flat))
            stack = self.expert_stacks.get(p)
            if stack is not None:
                params_with_grad += stack.matrices(flat)
                grads += stack.matrices(p.grad)
                muon_momentum_bufs += stack.matrices(state["momentum_buffer"])
                continue
            params_with_grad.append(_as_matrix(flat))
            grads.append(p.grad.reshape(p.shape[0], -1))
            muon_momentum_bufs.append(_as_matrix(state["momentum_buffer"]))
        return False

    ns_dtype: str = "auto"
    batched: bool = True
    ns_batch_bytes: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        # Optimizer pickles only defaults, state and groups.
        return {
            **super().__getstate__(),
            "ns_dtype": self.ns_dtype,
            "batched": self.batched,
            "ns_batch_bytes": self.ns_batch_bytes,
            "expert_stacks": self.expert_stacks,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        state.setdefault("expert_stacks", {})  # pickled before stacks of experts existed
        super().__setstate__(state)

    def resolved_ns_dtype(self) -> str | None:
        """The precision of this step's Newton-Schulz products, ``None`` without a parameter to update."""
        if self.ns_dtype != "auto":
            return self.ns_dtype
        if block_dtype() is not None:
            return block_dtype()
        param = next((p for group in self.param_groups for p in group["params"]), None)
        return None if param is None else auto_newton_schulz_dtype(param.device)

    def ns_batches(self) -> list[tuple[tuple[int, int], int, int]]:
        """The batches the next step orthogonalizes, if every parameter has a gradient: per group of matrices
        that are iterated together, its wide shape ``(rows, cols)``, its number of matrices and the number of
        chunks it is split into (``ns_batch_bytes``). Empty without a parameter or with ``batched=False``."""
        ns_dtype = self.resolved_ns_dtype()
        if not self.batched or ns_dtype is None:
            return []
        sizes: dict[tuple, int] = {}
        for group in self.param_groups:
            for p in group["params"]:
                stack = self.expert_stacks.get(p)
                shapes = stack.shapes(p) if stack is not None else [_as_matrix(p).shape]
                for shape in shapes:
                    key = _batch_key(shape, p.device, p.dtype, p.dtype, group)
                    sizes[key] = sizes.get(key, 0) + 1
        return [(key[0], n, len(_even_chunks(n, self._per_chunk(key, ns_dtype)))) for key, n in sizes.items()]

    def _per_chunk(self, key: tuple, ns_dtype: str) -> int:
        (rows, cols), device = key[0], key[1]
        limit = self.ns_batch_bytes or auto_ns_batch_bytes(device)
        return max(1, limit // (rows * cols * (4 if ns_dtype == "float32" else 2)))

    @torch.no_grad()
    def step(self, closure=None):
        self._write_back: list[tuple[Tensor, Tensor]] = []
        ns_dtype = self.resolved_ns_dtype()
        if self.batched:
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            if ns_dtype is not None:
                self._batched_step(ns_dtype)
        else:
            with torch_newton_schulz(ns_dtype) if ns_dtype is not None else contextlib.nullcontext():
                loss = super().step(closure)
        for param, flat in self._write_back:
            param.copy_(flat)
        self._write_back = []
        return loss

    def _batched_step(self, ns_dtype: str) -> None:
        """torch.optim.Muon's update of every parameter, with the same operations per matrix, but each applied
        to many tensors at once: momentum, weight decay and the update with ``torch._foreach_*`` per group, and
        Newton-Schulz on stacks of matrices of one wide shape (:func:`zeropower_via_newtonschulz_batched`)."""
        batches: dict[tuple, list[_Matrix]] = {}
        for group in self.param_groups:
            params: list[Tensor] = []
            grads: list[Tensor] = []
            bufs: list[Tensor] = []
            self._init_group(group, params, grads, bufs)
            if not params:
                continue
            lr = _to_scalar(group["lr"])
            torch._foreach_lerp_(bufs, grads, 1 - group["momentum"])
            decay = 1 - lr * group["weight_decay"]
            if isinstance(decay, Tensor) or decay != 1:  # torch multiplies by 1 too: the same bits
                if _foreach_scalars_exact(params):
                    torch._foreach_mul_(params, decay)
                else:
                    for param in params:
                        param.mul_(decay)
            for param, grad, buf in zip(params, grads, bufs):
                alpha = -_torch_muon._adjust_lr(lr, group["adjust_lr_fn"], param.shape)
                matrix = _Matrix(param, grad, buf, alpha, tall=param.shape[0] > param.shape[1])
                key = _batch_key(param.shape, param.device, param.dtype, grad.dtype, group)
                batches.setdefault(key, []).append(matrix)
        for key, matrices in batches.items():
            (wide_shape, _, _, _, momentum, nesterov, coefficients, ns_steps, eps) = key
            for chunk in _even_chunks(len(matrices), self._per_chunk(key, ns_dtype)):
                _orthogonalize_and_apply(
                    [matrices[i] for i in chunk], momentum, nesterov, coefficients, ns_steps, eps, ns_dtype
                )


@dataclass
class _Matrix:
    """One matrix of a batched step: parameter, gradient and momentum (matrix views for kernels), the
    learning rate it is added with (shape adjustment and sign included), and whether it is transposed."""

    param: Tensor
    grad: Tensor
    buf: Tensor
    alpha: float | Tensor
    tall: bool


def _batch_key(
    shape: torch.Size, device: torch.device, dtype: torch.dtype, grad_dtype: torch.dtype, group: MutableMapping
) -> tuple:
    """What matrices must share to be orthogonalized in one stack: the shape with rows <= cols (a tall matrix
    is iterated transposed, so it joins its transpose), device, dtypes and the group's iteration settings."""
    rows, cols = shape
    return (
        (min(rows, cols), max(rows, cols)),
        device,
        dtype,
        grad_dtype,
        group["momentum"],
        group["nesterov"],
        tuple(group["ns_coefficients"]),
        group["ns_steps"],
        group["eps"],
    )


def _even_chunks(n: int, per_chunk: int) -> list[range]:
    """``range(n)`` in the fewest chunks of at most ``per_chunk``, their sizes differing by at most one."""
    chunks = math.ceil(n / per_chunk)
    bounds = [n * i // chunks for i in range(chunks + 1)]
    return [range(start, stop) for start, stop in zip(bounds, bounds[1:])]


def _orthogonalize_and_apply(
    matrices: list[_Matrix],
    momentum: float,
    nesterov: bool,
    coefficients: tuple[float, float, float],
    ns_steps: int,
    eps: float,
    ns_dtype: str,
) -> None:
    """Nesterov update, Newton-Schulz and ``param += alpha * update`` for matrices of one batch key."""
    wide = [m for m in matrices if not m.tall]
    tall = [m for m in matrices if m.tall]
    ordered = wide + tall
    bufs = [m.buf for m in ordered]
    updates = torch._foreach_lerp([m.grad for m in ordered], bufs, momentum) if nesterov else bufs
    # Each orientation is stacked (new memory, so normalized in place) in the per-matrix iteration's precision
    # (its `grad.float()` / `grad.bfloat16()`) and normalized as it lies in memory, which sums each norm in
    # the order of the per-matrix path; tall matrices are then transposed as one view of their stack.
    dtype = torch.float32 if ns_dtype == "float32" else torch.bfloat16
    parts = []
    if wide:
        parts.append(normalize_(torch.stack(updates[: len(wide)]).to(dtype), eps))
    if tall:
        parts.append(normalize_(torch.stack(updates[len(wide) :]).to(dtype), eps).mT)
    del updates
    stack = parts[0] if len(parts) == 1 else torch.cat(parts)
    del parts
    result = newton_schulz_iterations(stack, coefficients, ns_steps).to(ordered[0].param.dtype)
    views: list[Tensor] = []
    if wide:
        views += (result[: len(wide)] if tall else result).unbind(0)
    if tall:
        views += (result[len(wide) :] if wide else result).mT.unbind(0)
    # One multi-tensor add per learning rate: a group's wide and tall matrices differ with `adjust_lr_fn=None`.
    by_alpha: dict[Any, tuple[list[Tensor], list[Tensor]]] = {}
    for matrix, view in zip(ordered, views):
        params, updates_ = by_alpha.setdefault(_alpha_key(matrix.alpha), ([], []))
        params.append(matrix.param)
        updates_.append(view)
    for (_, alpha), (params, updates_) in by_alpha.items():
        torch._foreach_add_(params, updates_, alpha=alpha)


def _foreach_scalars_exact(tensors: list[Tensor]) -> bool:
    """Whether ``torch._foreach_mul_(tensors, scalar)`` gives the bits of ``tensor.mul_(scalar)``: not on CPU for
    dtypes narrower than float32, whose multi-tensor path first rounds the scalar to the tensors' dtype (a
    weight decay factor 0.998 becomes 0.996 in bfloat16, twice the decay); ``Tensor.mul_`` computes in float32."""
    return all(t.device.type != "cpu" or t.dtype in _CPU_FOREACH_DTYPES for t in tensors)


def _alpha_key(alpha: float | Tensor) -> tuple[Any, float | Tensor]:
    # A tensor learning rate (torch.optim.Muon accepts one) is its own group: comparing it would synchronize.
    return (id(alpha), alpha) if isinstance(alpha, Tensor) else (alpha, alpha)


_CPU_FOREACH_DTYPES = (torch.float32, torch.float64)


class AdamWPart(AdamW):
    """:class:`torch.optim.AdamW` that takes the multi-tensor path (``foreach``) on CPU too, where torch's
    default is the tensor-by-tensor loop: the same arithmetic per tensor in one operation per group. Only in
    groups that leave ``foreach`` and ``fused`` unset and hold float32 or float64 CPU tensors (for narrower
    dtypes, the CPU multi-tensor path rounds ``beta2`` and the decay factor to the tensors' dtype; on GPUs,
    torch's default already is the multi-tensor path). The choice is made at each step and not stored in the
    groups, so that the state dict is AdamW's own (and checkpoints written either way load either way).
    ``batched=False`` keeps torch's default."""

    batched: bool = True

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "batched": self.batched}

    @torch.no_grad()
    def step(self, closure=None):
        unset = []
        if self.batched:
            unset = [
                group
                for group in self.param_groups
                if group["foreach"] is None
                and not group["fused"]
                and not group["differentiable"]
                and all(
                    type(p) in (Tensor, nn.Parameter) and p.device.type == "cpu" and p.dtype in _CPU_FOREACH_DTYPES
                    for p in group["params"]
                )
            ]
        for group in unset:
            group["foreach"] = True
        try:
            return super().step(closure)
        finally:
            for group in unset:
                group["foreach"] = None
