"""The exact one-step-delay trajectory of PipeDream-2BW, on one device.

Every stage of a 2BW pipeline computes step ``t``'s gradient on the weights of the previous step and
applies it to the current ones::

    w[t+1] = w[t] - u(grad f(w[t-1]), batch t),        w[-1] = w[0]

That is the delay profile (see :mod:`lightning_async_pp.reference.profile`) in which every trainable
parameter is one step stale: one process keeps a copy of last step's weights, swaps it in for the forward and
backward pass, swaps the current weights back and lets the optimizer step as usual. The optimizer state
advances once per step with the delayed gradient and is never rewound. Memory: one extra copy of the
trainable parameters.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_async_pp.reference.profile import DelayProfile

__all__ = ["DelayedWeights"]


class DelayedWeights(DelayProfile):
    """Holds ``w[t-1]`` for the trainable parameters of ``module`` and computes gradients there.

    :meth:`wrap_closure` runs a closure (forward and backward) on ``w[t-1]``; afterwards the parameters hold
    ``w[t]`` again, with their ``.grad`` computed at ``w[t-1]``, and the stored previous weights are ``w[t]``,
    ready for the next step.

    Args:
        module: The model whose trainable parameters are delayed.
        previous: Saved previous weights (from :meth:`state_dict`), or ``None`` to start from ``w[-1] = w[0]``.
    """

    def __init__(self, module: nn.Module, previous: dict[str, Tensor] | None = None) -> None:
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        super().__init__([[p for _, p in named]], [1])
        self.names = [name for name, _ in named]
        if previous is not None:
            self.load_state_dict(previous)

    @property
    def previous(self) -> list[Tensor]:
        """``w[t-1]``, one tensor per trainable parameter, in the order of :attr:`names`."""
        return self.history[0][0]

    def state_dict(self) -> dict[str, Tensor]:
        return {name: t.detach().clone() for name, t in zip(self.names, self.previous)}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        missing = sorted(set(self.names) - set(state))
        unexpected = sorted(set(state) - set(self.names))
        if missing or unexpected:
            raise KeyError(
                "The checkpoint's previous (delayed) weights do not match the model's trainable parameters: "
                f"missing {missing}, unexpected {unexpected}. Resume with the same model and frozen layers."
            )
        for name, old in zip(self.names, self.previous):
            old.copy_(state[name])
