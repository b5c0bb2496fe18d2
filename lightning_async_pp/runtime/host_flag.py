"""A boolean computed on the device and read on the host without making the host wait for the device."""

from __future__ import annotations

import torch
from torch import Tensor


class HostFlag:
    """Copies a device boolean into host memory (pinned on CUDA) without blocking.

    :meth:`ready` asks a CUDA event whether the copy has landed (at once on CPU); :meth:`get` waits for it (a
    no-op once ready) and returns the value.

    Args:
        flag: A boolean scalar tensor on any device.
    """

    def __init__(self, flag: Tensor) -> None:
        self._host = torch.empty((), dtype=torch.bool, pin_memory=flag.is_cuda)
        self._host.copy_(flag, non_blocking=True)
        self._event = None
        if flag.is_cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def get(self) -> bool:
        if self._event is not None:
            self._event.synchronize()
        return bool(self._host.numpy())  # host memory: reading it is not a device synchronisation
