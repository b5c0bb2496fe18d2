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
    the weights taken before the base optimizer's step; it becomes the parameter's buffer (holding :math:`u_t`)
    and the old buffer is released, so no parameter-sized tensor outlives the step besides the one buffer.
    Around the base optimizer's step the correction makes a fixed number of multi-tensor operations per device
    and dtype, whatever the number of parameters: four with a fixed ``coefficient`` (a copy of the weights, then
    :math:`u_t`, :math:`u_{t-1} - u_t` and the weights), about twenty-five with ``"auto"``.

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

        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        # One multi-tensor op per device and dtype (a mixed list would fall back to one kernel per tensor). The
        # snapshot is made out of place, so that one op allocates every parameter's copy (multiplying by 1 copies
        # exactly, unless `torch.set_flush_denormal` flushes subnormal weights). It becomes the parameter's new
        # buffer, and the old one is released when the step ends.
        groups = _by_device_and_dtype(params)
        snapshots = [torch._foreach_mul(weights, 1.0) for weights in groups]
        self.base_optimizer.step()

        for weights, updates in zip(groups, snapshots):
            torch._foreach_sub_(updates, weights)  # u_t = w_before - w_after, exact where they are close
            states = [self.state[p] for p in weights]
            if self.coefficient == AUTO:
                _auto_correct(weights, updates, states)
            else:
                _fixed_correct(weights, updates, states, self.coefficient)
            for state, update in zip(states, updates):
                state[STATE_KEY] = update
        return loss


def _continuing(
    weights: list[Tensor], updates: list[Tensor], states: list[dict[str, Any]]
) -> tuple[list[Tensor], list[Tensor], list[Tensor], list[dict[str, Any]]]:
    """The weights, updates, previous updates and states of the parameters that have a previous update."""
    kept = [i for i, state in enumerate(states) if STATE_KEY in state]
    return (
        [weights[i] for i in kept],
        [updates[i] for i in kept],
        [states[i][STATE_KEY] for i in kept],
        [states[i] for i in kept],
    )


def _fixed_correct(weights: list[Tensor], updates: list[Tensor], states: list[dict[str, Any]], c: float) -> None:
    """``w += c * (u_prev - u)`` for the parameters that have a previous update ``u_prev``; the others stay plain.

    ``u_prev - u`` is formed in the previous update's buffer, which the caller then replaces with ``u``.
    """
    weights, updates, previous, _ = _continuing(weights, updates, states)
    if weights:
        torch._foreach_sub_(previous, updates)
        torch._foreach_add_(weights, previous, alpha=c)


def _auto_correct(weights: list[Tensor], updates: list[Tensor], states: list[dict[str, Any]]) -> None:
    r"""``coefficient="auto"``: ``w += c_prev * u_prev - c * u`` per tensor, for the parameters that have a
    previous update ``u_prev``; the others take a plain step and a look-ahead of 0.

    On entry ``weights`` hold the base optimizer's new weights and ``updates`` :math:`u_t`. Each tensor's
    :math:`c_t` is the least-squares slope of its update on its previous one,
    :math:`\langle u_t, u_{t-1}\rangle / \|u_{t-1}\|^2`, from running averages, in [0, AUTO_MAX]. Per tensor
    rather than per group, so that a pipeline stage, which holds whole tensors, computes what one device would.
    The inner products come from norms, :math:`(\|u_t + u_{t-1}\|^2 - \|u_t\|^2 - \|u_{t-1}\|^2) / 2`, so that
    one multi-tensor norm serves every tensor; the statistics are stacked into vectors, so that the step's
    arithmetic is a fixed number of ops whatever the number of tensors. Everything stays on the device (no host
    synchronization).
    """
    for weight, state in zip(weights, states):
        if STATE_KEY not in state:
            state[LOOKAHEAD_KEY] = torch.zeros((), device=weight.device)
    weights, updates, previous, states = _continuing(weights, updates, states)
    if not weights:
        return
    n = len(weights)
    # Statistics in float32 at least (float64 for float64 parameters).
    dtype = torch.float64 if weights[0].dtype == torch.float64 else torch.float32
    sums = torch._foreach_add(updates, previous)
    squares = torch.stack(torch._foreach_norm([*sums, *updates, *previous], 2, dtype=dtype)).square()
    del sums
    total, current, before = squares.split(n)
    dots = (total - current - before) * 0.5

    zero = None
    if any(ALIGNMENT_KEY not in s or SQUARE_KEY not in s or LOOKAHEAD_KEY not in s for s in states):
        zero = dots.new_zeros(())
    # Both running averages of every tensor in one vector: alignments, then squares.
    averages = torch.stack([s.get(key, zero) for key in (ALIGNMENT_KEY, SQUARE_KEY) for s in states]).to(dtype)
    averages.mul_(AUTO_DECAY).add_(torch.cat([dots, before]), alpha=1 - AUTO_DECAY)
    alignment, norm = averages.split(n)
    coefficients = torch.where(norm > 0, alignment / norm.clamp(min=torch.finfo(dtype).tiny), 0.0)
    coefficients = coefficients.clamp_(0.0, AUTO_MAX).unbind()
    # The weights are kept c_{t-1} u_{t-1} ahead of the uncorrected trajectory: move them back by that and
    # forward by c_t u_t.
    torch._foreach_addcmul_(weights, previous, [s.get(LOOKAHEAD_KEY, zero) for s in states])
    torch._foreach_addcmul_(weights, updates, coefficients, value=-1)
    values = averages.unbind()
    for state, c, a, b in zip(states, coefficients, values[:n], values[n:]):
        state[LOOKAHEAD_KEY], state[ALIGNMENT_KEY], state[SQUARE_KEY] = c, a, b


def _by_device_and_dtype(params: list[Tensor]) -> list[list[Tensor]]:
    """Split ``params`` into lists of one device and dtype, in their order."""
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for param in params:
        groups.setdefault((param.device, param.dtype), []).append(param)
    return list(groups.values())
