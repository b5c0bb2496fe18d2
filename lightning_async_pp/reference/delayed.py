"""The exact one-step-delay trajectory of PipeDream-2BW, on one device.

Every stage of a 2BW pipeline computes step ``t``'s gradient on the weights of the previous step and
applies it to the current ones::

    w[t+1] = w[t] - u(grad f(w[t-1]), batch t),        w[-1] = w[0]

One process reproduces that by keeping a copy of last step's weights: swap them in for the forward and
backward pass, swap the current weights back, and let the optimizer step as usual. The optimizer state
advances once per step with the delayed gradient and is never rewound. Memory: one extra copy of the
trainable parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn


class DelayedWeights:
    """Holds ``w[t-1]`` for the trainable parameters of ``module`` and computes gradients there.

    Args:
        module: The model whose trainable parameters are delayed.
        previous: Saved previous weights (from :meth:`state_dict`), or ``None`` to start from ``w[-1] = w[0]``.
    """

    def __init__(self, module: nn.Module, previous: dict[str, Tensor] | None = None) -> None:
        self.names = [name for name, p in module.named_parameters() if p.requires_grad]
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.previous = [p.detach().clone() for p in self.params]
        if previous is not None:
            self.load_state_dict(previous)

    @torch.no_grad()
    def wrap_closure(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """Return a closure that runs ``closure`` (forward and backward) on ``w[t-1]``.

        Afterwards the parameters hold ``w[t]`` again, with their ``.grad`` computed at ``w[t-1]``, and the
        stored previous weights become ``w[t]``, ready for the next step. The optimizer then steps ``w[t]``.
        """

        def delayed_closure() -> Any:
            current = [p.data for p in self.params]
            for p, old in zip(self.params, self.previous):
                p.data = old
            try:
                with torch.enable_grad():
                    result = closure()
            finally:
                for p, now in zip(self.params, current):
                    p.data = now
            with torch.no_grad():
                for old, now in zip(self.previous, current):
                    old.copy_(now)
            return result

        return delayed_closure

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
