"""What an asynchronous save hands to its thread: a copy of the payload in host memory, and the stage's device.

A save that runs in a background thread while training goes on must not read the live tensors: the next
optimizer step changes them in place, and the checkpoint would mix two steps. It must not read them from
another thread either: a thread's current CUDA device is device 0 until it says otherwise, and DCP's writer
copies each tensor to the host with ``non_blocking=True`` and then synchronizes only the current device's
stream, so on a stage on any other GPU a shard can be written before its copy lands. Lightning's
``AsyncCheckpointIO`` clones the tensors in the caller's thread since 2.5.4 (Lightning issue #20953), on
their own GPU (doubling the stage's memory for the save, issue #21630), and runs the save on device 0.

Hence :func:`snapshot_to_cpu`, called in the training thread, where the copy is synchronous (when it
returns, every byte is in host memory, whatever stream wrote the tensor), and :func:`use_device`, called
first in the thread that writes.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

__all__ = ["snapshot_to_cpu", "use_device"]


def snapshot_to_cpu(payload: Any) -> Any:
    """``payload`` with every tensor copied to host memory now (containers rebuilt, other values kept).

    Args:
        payload: A checkpoint payload: nested dicts, lists and tuples holding tensors and plain values.

    Returns:
        The same structure, whose tensors share no memory with the originals: training may change those at once.
    """
    return apply_to_collection(payload, Tensor, _to_host)


def _to_host(tensor: Tensor) -> Tensor:
    tensor = tensor.detach()
    if tensor.device.type == "cpu":
        return tensor.clone()
    # Blocking: it waits for the work queued on the tensor's own device, so the copy is complete when it returns.
    return tensor.to("cpu")


def use_device(device: torch.device | None) -> None:
    """Make ``device`` the calling thread's current CUDA device (every thread starts on device 0).

    Args:
        device: The stage's device; nothing happens for ``None`` or a device that is not CUDA.
    """
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)
