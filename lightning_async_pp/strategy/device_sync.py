"""Device-wide synchronisation that can hang a pipeline on NCCL while an all-reduce is pending.

With gradient clipping or tied weights, a stage's ``UPDATE`` posts an all-reduce (the clipping norm, the tied
gradients) and waits for it only when the version it produces is first needed, possibly a step later; in 2BW
the last stage posts it before the first stage has sent the next step's activations. Until every stage has
joined, the NCCL kernel of that all-reduce waits on the device. Anything that waits for the *whole* device in
between waits for it too, and with it for the other stages, which in turn wait for this stage's next
transfers: ``torch.cuda.synchronize()`` or ``torch.cuda.empty_cache()`` in a callback between steps, and
``CUDA_DEVICE_MAX_CONNECTIONS=1`` (one hardware queue per device, so every kernel issued after the waiting
one waits). :func:`lightning_async_pp.schedule.check_transfers` finds these deadlocks
(``tests/unit/schedule/test_transfers.py``); the runtime's own order is free of them.
"""

from __future__ import annotations

import os

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

__all__ = ["warn_unsafe_device_settings"]

_ONE_CONNECTION = (
    "CUDA_DEVICE_MAX_CONNECTIONS=1 is set: every CUDA stream of a device then shares one hardware queue, so a "
    "kernel issued after an NCCL operation that waits for another stage waits too. With gradient clipping or "
    "tied weights a stage leaves an all-reduce pending across steps, and a pipeline can hang (the deadlock "
    "model finds such hangs for 2BW; see docs/troubleshooting.md, 'The run hangs'). Unset it for pipeline "
    "training: Megatron-style tensor-parallel overlap sets it, this package does not need it."
)


def warn_unsafe_device_settings(backend: str | None, multi_process: bool) -> None:
    """Warn (once, on rank 0) about environment settings under which pending collectives can hang.

    Args:
        backend: The training process groups' backend (``"nccl"``, ``"gloo"``, or a device map such as
            ``"cpu:gloo,cuda:nccl"``).
        multi_process: Whether the job has more than one process (one process posts no collective).
    """
    if multi_process and "nccl" in (backend or "") and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        rank_zero_warn(_ONE_CONNECTION)
