"""A stage's weight versions: the copies of its trainable parameters that in-flight micro-batches run on.

Each stage keeps ``num_buffers`` copies of its trainable parameters (two for ``"2bw"``, one for ``"1f1b"``),
as separate leaf tensors; version ``v`` lives in buffer ``v % num_buffers``. The optimizer's own
``nn.Parameter`` objects alias the newest copy, so optimizer state, schedulers and checkpoints see ordinary
parameters. An update writes the new version into the copy nobody uses any more (its micro-batches are all
done), never into a tensor an in-flight autograd graph saved.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class WeightVersions:
    """The buffers of a stage's weight versions, and which version is the newest.

    Args:
        params: The stage's trainable parameters, by name (the optimizer's).
        num_buffers: ``2`` for ``"2bw"``, ``1`` for ``"1f1b"``.
        start_version: Weight version the parameters hold (non-zero when resuming).
    """

    def __init__(self, params: dict[str, nn.Parameter], num_buffers: int, start_version: int = 0) -> None:
        self.params = params
        self.num_buffers = num_buffers
        # The newest version's buffer aliases the parameters; the other 2BW buffer starts as a copy
        # (w[-1] = w[0] at the start of training; a resumed run overwrites it with the saved version).
        # `.data` (unlike `.detach()`) gives a tensor with its own autograd version counter: the optimizer's
        # in-place steps on a parameter must not look like edits of a buffer an in-flight graph saved.
        newest = {n: p.data.requires_grad_(True) for n, p in params.items()}
        self.buffers: list[dict[str, Tensor]] = [newest]
        if num_buffers == 2:
            copy = {n: p.detach().clone().requires_grad_(True) for n, p in params.items()}
            self.buffers = [newest, copy] if start_version % 2 == 0 else [copy, newest]
        self.newest = start_version
        self.used: dict[int, int] = {}
        """Step -> the weight version its micro-batches ran on (recent steps)."""

    def of(self, version: int) -> dict[str, Tensor]:
        """The buffer that holds ``version``."""
        return self.buffers[version % self.num_buffers]

    def pin(self, step: int, version: int) -> dict[str, Tensor]:
        """The buffer a micro-batch of ``step`` runs on; remembers that ``step`` ran on ``version``."""
        self.used[step] = version
        return self.of(version)

    def take_gradients(self, version: int) -> dict[str, Tensor]:
        """The gradients accumulated on ``version``'s buffer (zeros where none), cleared from the buffer."""
        grads = {}
        for name, tensor in self.of(version).items():
            grads[name] = tensor.grad if tensor.grad is not None else torch.zeros_like(tensor)
            tensor.grad = None
        return grads

    @torch.no_grad()
    def prepare(self, version: int) -> None:
        """Point the parameters at the buffer of ``version``, holding a copy of ``version - 1``, for the
        optimizer to step in place."""
        current, target = self.of(version - 1), self.of(version)
        if target is not current:
            torch._foreach_copy_([target[n] for n in self.params], [current[n] for n in self.params])
        for name, param in self.params.items():
            param.data = target[name].data

    def previous(self) -> dict[str, Tensor]:
        """The version before the newest one (what step ``newest`` will run on), keyed like the parameters."""
        return {n: t.detach() for n, t in self.of(self.newest - 1).items()}

    def restore(self, version: int) -> None:
        """Make ``version`` the newest: the buffers are relabelled so that the parameters' copy holds it."""
        if self.num_buffers == 2 and (version - self.newest) % 2:
            self.buffers.reverse()
        self.newest = version

    @torch.no_grad()
    def load_previous(self, state: dict[str, Tensor]) -> None:
        """Copy ``state`` into the version before the newest one (see :meth:`previous`)."""
        for name, tensor in self.of(self.newest - 1).items():
            tensor.copy_(state[name])
