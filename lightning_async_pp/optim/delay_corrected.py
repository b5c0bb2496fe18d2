"""Error-feedback correction of a one-step gradient delay, around any optimizer."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_async_pp.optim.granularity import updates_per_parameter

STATE_KEY = "previous_update"
"""Key of the previous uncorrected update in the base optimizer's per-parameter state."""

AUTO = "auto"
LOOKAHEAD_KEY = "lookahead"
"""``coefficient="auto"``: the coefficient applied to a parameter's previous update (a 0-d tensor)."""
ALIGNMENT_KEY = "update_alignment"
"""``coefficient="auto"``: running average of the parameter's :math:`\\langle u_t, u_{t-1} \rangle` (0-d tensor)."""
SQUARE_KEY = "update_square"
r"""``coefficient="auto"``: running average of the parameter's :math:`\|u_{t-1}\|^2` (0-d tensor)."""
AUTO_DECAY = 0.9
"""Decay of the running averages of ``coefficient="auto"`` (about ten steps of memory)."""
AUTO_MAX = 1.0
"""Upper bound of the automatic coefficient."""


class DelayCorrected(Optimizer):
    r"""Wrap an optimizer so that it compensates a one-step delay of the gradients.

    With a one-step gradient delay (PipeDream-2BW), the gradient used at step :math:`t` was computed on the
    weights of step :math:`t-1`. Let :math:`u_t` be the update the base optimizer makes at step :math:`t`
    (learning rate and weight decay included). This wrapper applies

    .. math::
        w_{t+1} = w_t - u_t - c\,(u_t - u_{t-1}),

    i.e. it extrapolates the change of the update by one step (:math:`c = 1`: :math:`w_t - 2u_t + u_{t-1}`).
    Summed over the steps this is :math:`w_{t+1} = v_{t+1} - c\,u_t` with :math:`v_{t+1} = v_t - u_t` the
    uncorrected trajectory: the weights are kept :math:`c` updates ahead of it, so the gradient of the next
    step, one step stale, is taken about where the uncorrected trajectory will be (a Nesterov-style
    look-ahead).
    :math:`u_t` is measured as the change of the weights made by the base optimizer's own ``step``, so any
    optimizer works and its state (moments, momentum) is never touched; only what is subtracted from the
    weights changes. The first step, and the first step of a parameter that had no gradient before, is plain.
    Parameters without a gradient are skipped, as torch optimizers skip them.

    The wrapper is an :class:`~torch.optim.Optimizer` whose :attr:`param_groups`, :attr:`state` and
    :attr:`defaults` are the base optimizer's own objects, so learning-rate schedulers, Lightning and
    checkpointing treat it like the base optimizer. :math:`u_{t-1}` is stored in the base optimizer's
    per-parameter state under ``"previous_update"`` and is part of :meth:`state_dict`.

    Memory: one parameter-sized buffer per parameter (:math:`u_{t-1}`) between steps. During a step, a copy of
    the weights taken before the base optimizer's step (one block per device and dtype), freed when the step
    ends; on a parameter's first step its copy becomes its buffer.

    Two forms:

    * Python: ``DelayCorrected(torch.optim.AdamW(model.parameters(), lr=1e-3), coefficient=1.0)``.
    * Factory, as jsonargparse / ``LightningCLI`` call optimizer classes:
      ``DelayCorrected(model.parameters(), base=partial(torch.optim.AdamW, lr=1e-3), coefficient=1.0)``.

    Args:
        params: The optimizer to wrap, or the parameters to build it from with ``base``: anything the base
            optimizer accepts (tensors, ``(name, tensor)`` pairs, groups), passed to ``base`` unchanged. In
            particular ``model.named_parameters()`` pairs reach the base optimizer with their names, so
            :class:`~lightning_async_pp.optim.Muon` under the wrapper routes by name exactly as without it.
        base: Callable that builds the base optimizer from ``params``; in YAML, a ``class_path`` with
            ``init_args``. ``None`` means :class:`torch.optim.AdamW` with its defaults. Only with parameters,
            not with an optimizer instance.
        coefficient: :math:`c`. ``0`` is exactly the base optimizer; ``1`` is the paper's setting. ``"auto"``
            chooses :math:`c` per parameter tensor and step as the least-squares prediction of an update from
            the previous one, :math:`c_t = \mathrm{clip}(A_t / B_t, 0, 1)` with :math:`A_t` and :math:`B_t`
            running averages (decay 0.9) of the tensor's :math:`\langle u_t, u_{t-1} \rangle` and
            :math:`\|u_{t-1}\|^2` (per tensor, not per group, so that a pipeline stage computes what one
            device would), and applies :math:`w_{t+1} = w_t - u_t - c_t u_t + c_{t-1} u_{t-1}`, which
            keeps the weights exactly :math:`c_t u_t` ahead of the uncorrected trajectory even when :math:`c`
            changes. It adds three 0-d tensors of state per parameter (``"lookahead"``, ``"update_alignment"``,
            ``"update_square"``), no parameter-sized buffer.

    Raises:
        ValueError: If ``coefficient`` is negative or a string other than ``"auto"``, if both an optimizer
            instance and ``base`` are given, or if the optimizer is already a ``DelayCorrected``.
        TypeError: If ``base`` does not return a :class:`~torch.optim.Optimizer`.

    .. note::
        The base optimizer's ``step`` runs once per call and without the closure, so optimizers that need to
        re-evaluate the closure (:class:`~torch.optim.LBFGS`) are not supported.
    """

    def __init__(
        self,
        params: Optimizer | Iterable[Tensor] | Iterable[tuple[str, Tensor]] | Iterable[dict[str, Any]],
        base: Callable[[Iterable], Optimizer] | None = None,
        coefficient: float | str = 1.0,
    ) -> None:
        if isinstance(coefficient, str):
            if coefficient != AUTO:
                raise ValueError(
                    f"`coefficient` must be a number >= 0 or {AUTO!r} (a coefficient per parameter tensor from the"
                    f" alignment of successive updates), got {coefficient!r}."
                )
        elif not coefficient >= 0:
            raise ValueError(
                f"`coefficient` must be >= 0 (0 disables the correction, 1 is the default) or {AUTO!r}, got"
                f" {coefficient}."
            )
        else:
            coefficient = float(coefficient)
        if isinstance(params, Optimizer):
            if base is not None:
                raise ValueError(
                    "Got both an optimizer instance and `base`. Pass either an optimizer, e.g."
                    " `DelayCorrected(torch.optim.AdamW(params))`, or parameters together with `base`, e.g."
                    " `DelayCorrected(params, base=partial(torch.optim.AdamW, lr=1e-3))`."
                )
            optimizer = params
        else:
            optimizer = (torch.optim.AdamW if base is None else base)(params)
            if not isinstance(optimizer, Optimizer):
                raise TypeError(
                    f"`base` must build a `torch.optim.Optimizer` from the parameters, but it returned a"
                    f" {type(optimizer).__name__}."
                )
        if isinstance(optimizer, DelayCorrected):
            raise ValueError("The optimizer is already a `DelayCorrected`; wrap its base optimizer instead.")
        # `Optimizer.__init__` would create new `param_groups` and `state`; the wrapper uses the base
        # optimizer's, so only the hook bookkeeping is set up, the way unpickling does it.
        self.__setstate__({"base_optimizer": optimizer, "coefficient": coefficient})

    @property
    def per_parameter(self) -> bool:
        """Whether each parameter's update reads only its own gradient and state: the correction's state (its
        previous update, and ``"auto"``'s statistics) is per tensor, so as the base optimizer's."""
        return updates_per_parameter(self.base_optimizer)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.base_optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.base_optimizer.param_groups = value

    @property
    def state(self) -> dict[Tensor, Any]:
        return self.base_optimizer.state

    @state.setter
    def state(self, value: dict[Tensor, Any]) -> None:
        self.base_optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.base_optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.base_optimizer.defaults = value

    def __getstate__(self) -> dict[str, Any]:
        return {"base_optimizer": self.base_optimizer, "coefficient": self.coefficient}

    def __repr__(self) -> str:
        base = "\n".join(f"    {line}" if line else "" for line in repr(self.base_optimizer).splitlines())
        return f"{type(self).__name__}(coefficient={self.coefficient},\n{base}\n)"

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group to the base optimizer; its parameters are corrected from their second step."""
        self.base_optimizer.add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients, as the base optimizer does."""
        self.base_optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The base optimizer's state dict; it includes the previous updates."""
        return self.base_optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict saved by :meth:`state_dict`, previous updates included."""
        self.base_optimizer.load_state_dict(state_dict)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one corrected optimization step.

        Args:
            closure: A callable that re-evaluates the model and returns the loss; called exactly once, before
                the base optimizer's step.

        Returns:
            The closure's return value, or ``None`` without a closure.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.coefficient == 0:
            self.base_optimizer.step()
            return loss

        continuing, previous, first = [], [], []
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                buffer = self.state[param].get(STATE_KEY)
                if buffer is None:
                    first.append(param)
                else:
                    continuing.append(param)
                    previous.append(buffer)
        # On a parameter's first step its snapshot becomes its buffer; afterwards snapshots are temporary.
        first_updates = [p.clone() for p in first]
        updates = _empty_like_in_one_block(continuing)
        # One multi-tensor kernel per device and dtype (a mixed list would fall back to one kernel per tensor).
        grouped = _by_device_and_dtype(continuing, previous, updates)
        for weights, _, snapshots in grouped:
            torch._foreach_copy_(snapshots, weights)
        self.base_optimizer.step()

        if first:
            torch._foreach_sub_(first_updates, first)
            for param, update in zip(first, first_updates):
                self.state[param][STATE_KEY] = update
        if self.coefficient == AUTO:
            for param in first:
                self.state[param][LOOKAHEAD_KEY] = torch.zeros((), device=param.device)
            for weights, buffers, snapshots in grouped:
                torch._foreach_sub_(snapshots, weights)
                _auto_correct(weights, snapshots, buffers, [self.state[p] for p in weights])
        else:
            for weights, buffers, snapshots in grouped:
                # u_t = w_before - w_after; then w_after + c * (u_{t-1} - u_t), and u_t is copied into the old
                # buffer rather than replacing it, so that the persistent state is never reallocated.
                torch._foreach_sub_(snapshots, weights)
                torch._foreach_sub_(buffers, snapshots)
                torch._foreach_add_(weights, buffers, alpha=self.coefficient)
                torch._foreach_copy_(buffers, snapshots)
        return loss


def _auto_correct(
    params: list[Tensor], updates: list[Tensor], previous: list[Tensor], states: list[dict[str, Any]]
) -> None:
    """``coefficient="auto"``: ``w += c_prev * u_prev - c * u`` per tensor, then ``u_prev = u``.

    On entry ``params`` hold the base optimizer's new weights, ``updates`` :math:`u_t` and ``previous``
    :math:`u_{t-1}`. Each tensor's :math:`c_t` is the least-squares slope of its update on its previous one,
    :math:`\\langle u_t, u_{t-1}\rangle / \\|u_{t-1}\\|^2`, from running averages, in [0, AUTO_MAX]. Per tensor
    rather than per group, so that a pipeline stage, which holds whole tensors, computes what one device would.
    Everything stays on the device (no host synchronization).
    """
    # Statistics in float32 at least (float64 for float64 parameters).
    dtype = torch.promote_types(params[0].dtype, torch.float32)
    dots = torch.stack([torch.dot(u.reshape(-1), p.reshape(-1)).to(dtype) for u, p in zip(updates, previous)])
    squares = torch.stack(torch._foreach_norm(previous)).to(dtype).square()
    zero = dots.new_zeros(())
    alignment = torch.stack([state.get(ALIGNMENT_KEY, zero).to(dtype) for state in states])
    norm = torch.stack([state.get(SQUARE_KEY, zero).to(dtype) for state in states])
    lookahead = [state.get(LOOKAHEAD_KEY, zero) for state in states]
    alignment = alignment * AUTO_DECAY + dots * (1 - AUTO_DECAY)
    norm = norm * AUTO_DECAY + squares * (1 - AUTO_DECAY)
    coefficients = torch.where(norm > 0, alignment / norm.clamp(min=torch.finfo(dtype).tiny), zero)
    coefficients = coefficients.clamp(0.0, AUTO_MAX).unbind()
    # The weights are kept c_{t-1} u_{t-1} ahead of the uncorrected trajectory: move them back by that and
    # forward by c_t u_t. `previous` is scaled in place, then overwritten with u_t.
    torch._foreach_mul_(previous, lookahead)
    torch._foreach_add_(params, previous)
    torch._foreach_copy_(previous, updates)
    torch._foreach_mul_(updates, coefficients)
    torch._foreach_sub_(params, updates)
    for state, c, a, n in zip(states, coefficients, alignment.unbind(), norm.unbind()):
        state[LOOKAHEAD_KEY], state[ALIGNMENT_KEY], state[SQUARE_KEY] = c, a, n


def _by_device_and_dtype(*lists: list[Tensor]) -> list[tuple[list[Tensor], ...]]:
    """Split parallel lists of tensors into groups of one device and dtype (that of the first list's tensor)."""
    groups: dict[tuple[torch.device, torch.dtype], tuple[list[Tensor], ...]] = {}
    for tensors in zip(*lists):
        key = (tensors[0].device, tensors[0].dtype)
        if key not in groups:
            groups[key] = tuple([] for _ in lists)
        for group, tensor in zip(groups[key], tensors):
            group.append(tensor)
    return list(groups.values())


def _empty_like_in_one_block(tensors: list[Tensor]) -> list[Tensor]:
    """Uninitialized tensors shaped like ``tensors``, backed by one allocation per device and dtype.

    Freeing many parameter-sized blocks every step lets the CPU allocator hand the memory back to the
    operating system and fault it in again on the next step, which costs more than the arithmetic; a single
    block of the same size every step is kept by the allocator and reused.
    """
    blocks: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for index, tensor in enumerate(tensors):
        blocks.setdefault((tensor.device, tensor.dtype), []).append(index)
    out: list[Tensor] = [None] * len(tensors)  # type: ignore[list-item]
    for (device, dtype), indices in blocks.items():
        sizes = [tensors[i].numel() for i in indices]
        block = torch.empty(sum(sizes), device=device, dtype=dtype)
        for i, chunk in zip(indices, block.split(sizes)):
            out[i] = chunk.view_as(tensors[i])
    return out
