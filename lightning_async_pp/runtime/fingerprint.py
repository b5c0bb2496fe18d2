"""A micro-batch's fingerprint: proof that neighbouring stages read the same data.

Every stage runs its own dataloader; the first uses a micro-batch's inputs, the last its targets. Each stage
computes the fingerprints of a step's micro-batches, the same way, in one pass over the batch
(:func:`step_fingerprints`), and sends them to the next stage once per step
(:class:`~lightning_async_pp.runtime.data_order.DataOrderLink`); the receiving stage compares them with its
own before it runs the step's first micro-batch. A mismatch stops the job with :class:`DataOrderError`,
naming the step, the first differing micro-batch and the two stages.

The fingerprint is two int64 numbers, computed on the device without waiting for it: a position-weighted hash
of each tensor's elements (the bit patterns of floats, the values of integers), and a checksum of the
tensors' shapes and dtypes. A tensor of up to :data:`SAMPLE` elements is hashed whole, so any changed value or
order changes it; a larger one through :data:`SAMPLE` evenly spaced elements, which keeps the cost of a
large input (a batch of images) to a few milliseconds on a CPU while still telling different samples apart.
Integer arithmetic wraps around identically everywhere, in any summation order, so equal data give equal
fingerprints on any two devices of the same kind.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
from torch import Tensor

from lightning_async_pp.runtime.host_flag import HostFlag
from lightning_async_pp.runtime.microbatch import batch_size_of, tensors_of

SAMPLE = 1 << 14
_SPREAD, _OFFSET, _MIX = 0x2545F4914F6CDD1D, 0x1B873593, 0x5851F42D4C957F2D
_BITS = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}


def _words(t: Tensor) -> Tensor:
    """The tensor's elements as integers: the bit pattern of floats, the value of integers and booleans."""
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.is_floating_point():
        bits = _BITS.get(t.dtype)
        if bits is None:  # e.g. float8: hash its value
            return t.to(torch.float32).contiguous().view(torch.int32)
        return t.contiguous().view(bits)
    return t


def fingerprint(batch: Any) -> Tensor:
    """Two int64 numbers that identify the tensors of ``batch`` (on their device; no host synchronisation).

    Args:
        batch: A micro-batch: a tensor or any collection of tensors.

    Returns:
        An int64 tensor of shape ``(2,)`` on the device of the batch's first tensor.
    """
    tensors = tensors_of(batch)
    if not tensors:
        return torch.zeros(2, dtype=torch.int64)
    device = tensors[0].device
    content = torch.zeros((), dtype=torch.int64, device=device)
    layout = 0
    for t in tensors:
        words = _words(t.detach()).reshape(-1)
        stride = max(1, -(-words.numel() // SAMPLE))  # ceil: at most SAMPLE elements
        sample = words[::stride].to(torch.int64)
        weights = torch.arange(sample.numel(), dtype=torch.int64, device=device) * _SPREAD + _OFFSET
        content = content * _MIX + (sample * weights).sum()
        layout = zlib.crc32(f"{tuple(t.shape)} {t.dtype}".encode(), layout)  # not hash(): salted per process
    # Adding a Python number passes it to the kernel: no host-to-device copy.
    return torch.stack([content, torch.zeros_like(content) + layout])


def step_fingerprints(batch: Any, num_microbatches: int) -> Tensor:
    """The fingerprints of the ``num_microbatches`` micro-batches of ``batch``, computed in one pass over it.

    Row ``i`` equals :func:`fingerprint` of micro-batch ``i`` as
    :func:`~lightning_async_pp.runtime.microbatch.split_microbatches` cuts it (a tensor without a batch
    dimension belongs to every micro-batch whole), for the cost of one micro-batch's kernels.

    Args:
        batch: A batch: a tensor or any collection of tensors, whose size ``num_microbatches`` divides.
        num_microbatches: How many equal micro-batches the batch is cut into.

    Returns:
        An int64 tensor of shape ``(num_microbatches, 2)`` on the device of the batch's first tensor.
    """
    M = num_microbatches
    tensors = tensors_of(batch)
    if not tensors:
        return torch.zeros(M, 2, dtype=torch.int64)
    device = tensors[0].device
    rows = batch_size_of(batch) // M
    content = torch.zeros(M, dtype=torch.int64, device=device)
    layout = 0
    for t in tensors:
        split = t.dim() > 0
        words = _words(t.detach())
        words = words.reshape(M, words.numel() // M) if split else words.reshape(1, -1)
        stride = max(1, -(-words.shape[1] // SAMPLE))
        sample = words[:, ::stride].to(torch.int64)
        weights = torch.arange(sample.shape[1], dtype=torch.int64, device=device) * _SPREAD + _OFFSET
        content = content * _MIX + (sample * weights).sum(dim=1)
        shape = (rows, *t.shape[1:]) if split else tuple(t.shape)
        layout = zlib.crc32(f"{shape} {t.dtype}".encode(), layout)
    return torch.stack([content, torch.zeros_like(content) + layout], dim=1)


class DataOrderError(RuntimeError):
    """Two stages of one pipeline read different data for the same micro-batch."""


class FingerprintCheck:
    """Compares the fingerprints of a step's micro-batches received from the previous stage with this stage's own,
    without making the host wait for the device.

    The comparison runs on the device and reaches the host as a :class:`HostFlag`: :meth:`ready` says whether it
    has arrived (at once on CPU) and :meth:`raise_if_different` waits for it and raises :class:`DataOrderError`
    naming the first micro-batch whose fingerprints differ.

    Args:
        mine: This stage's fingerprints of the step's micro-batches (:func:`step_fingerprints`).
        received: The previous stage's.
        step: The step, for the error message.
        stage: The stage that compares (the sender is ``stage - 1``).
    """

    def __init__(self, mine: Tensor, received: Tensor, step: int, stage: int) -> None:
        self.mine, self.received = mine, received
        self.step, self.stage = step, stage
        self._different = HostFlag((mine != received).any())

    def ready(self) -> bool:
        return self._different.ready()

    def raise_if_different(self) -> None:
        if not self._different.get():
            return
        sender, receiver = self.stage - 1, self.stage
        microbatch = int((self.mine != self.received).reshape(len(self.mine), -1).any(dim=1).nonzero()[0])
        raise DataOrderError(
            f"Pipeline stages {sender} and {receiver} read different data for step {self.step}, micro-batch "
            f"{microbatch} (fingerprints {self.received[microbatch].tolist()} on stage {sender}, "
            f"{self.mine[microbatch].tolist()} on stage {receiver}): the first stage would feed the inputs of one "
            "batch and the last stage compute the loss against the targets of another. Training stops before using "
            "it. Every process must produce the same batches in the same order: the strategy seeds shuffled "
            "DataLoaders and their workers alike on every stage, but not a sampler of your own, random transforms "
            "in the main process (num_workers=0), or data that depend on the rank. Seed those identically in every "
            "process (a torch.Generator with a fixed seed, or seed_everything before creating the data), or make "
            "them deterministic."
        )
