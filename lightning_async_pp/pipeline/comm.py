"""Point-to-point tensor transfer between neighbouring stages over ``torch.distributed``.

Every transfer is two messages: a small header (dtype and shape) and the payload. The first header of a
channel tells the receiver what to allocate; from then on it posts the next payload's receive ahead of
time (:meth:`Channel.prefetch`) with the same shape, so the transfer overlaps the receiver's compute, and
the header only confirms the shape. Pipelines therefore need a fixed micro-batch shape. Sends never
block the sender.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

MAX_DIMS = 8
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32]
HEADER_TAG, PAYLOAD_TAG = 0, 1


def encode_header(t: Tensor) -> Tensor:
    if t.dim() > MAX_DIMS:
        raise ValueError(f"Activations between stages may have at most {MAX_DIMS} dimensions, got {t.dim()}.")
    if t.dtype not in DTYPES:
        raise ValueError(f"Cannot send a {t.dtype} tensor between stages; supported: {DTYPES}.")
    header = torch.zeros(2 + MAX_DIMS, dtype=torch.int64)
    header[0], header[1] = t.dim(), DTYPES.index(t.dtype)
    header[2 : 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return header


def decode_header(header: Tensor) -> tuple[torch.dtype, list[int]]:
    ndim, dtype = int(header[0]), DTYPES[int(header[1])]
    return dtype, header[2 : 2 + ndim].tolist()


class Channel:
    """Ordered tensor stream with one peer rank, in one direction for receiving and one for sending.

    Args:
        peer: Global rank of the neighbouring stage.
        device: Device the tensors live on (headers travel on it too, as NCCL requires).
        group: Process group of the transfer, ``None`` for the default group.
        name: Names the link in error messages, e.g. ``"stage 1 <- stage 0"``.
    """

    def __init__(
        self, peer: int, device: torch.device, group: dist.ProcessGroup | None = None, name: str = ""
    ) -> None:
        self.peer = peer
        self.name = name or f"rank {peer}"
        self.device = device
        self.group = group
        self._pending: tuple[Tensor, dist.Work, Tensor | None, dist.Work | None] | None = None
        self._layout: tuple[torch.dtype, list[int]] | None = None
        self._sends: list[tuple[list[dist.Work], tuple[Tensor, Tensor]]] = []

    def send(self, tensor: Tensor) -> None:
        """Post a non-blocking send; the tensors stay referenced until the transfer completes."""
        tensor = tensor.detach().contiguous()
        header = encode_header(tensor).to(self.device)
        works = [
            dist.isend(header, self.peer, group=self.group, tag=HEADER_TAG),
            dist.isend(tensor, self.peer, group=self.group, tag=PAYLOAD_TAG),
        ]
        self._sends = [entry for entry in self._sends if not all(w.is_completed() for w in entry[0])]
        self._sends.append((works, (header, tensor)))

    def prefetch(self) -> None:
        """Post the receives of the next tensor, so the peer's send completes while we compute."""
        if self._pending is not None:
            return
        header = torch.empty(2 + MAX_DIMS, dtype=torch.int64, device=self.device)
        header_work = dist.irecv(header, self.peer, group=self.group, tag=HEADER_TAG)
        payload, payload_work = None, None
        if self._layout is not None:
            dtype, shape = self._layout
            payload = torch.empty(shape, dtype=dtype, device=self.device)
            payload_work = dist.irecv(payload, self.peer, group=self.group, tag=PAYLOAD_TAG)
        self._pending = (header, header_work, payload, payload_work)

    def forget_layout(self) -> None:
        """Read the next tensor's shape from its header (after a flush, or for evaluation batches)."""
        assert self._pending is None, "forget_layout() while a receive is posted"
        self._layout = None

    def recv(self) -> Tensor:
        """Wait for the next tensor from the peer."""
        self.prefetch()
        assert self._pending is not None
        header, header_work, payload, payload_work = self._pending
        self._pending = None
        self._wait(header_work)
        layout = decode_header(header.cpu())
        if payload is None:
            self._layout = layout
            payload = torch.empty(layout[1], dtype=layout[0], device=self.device)
            payload_work = dist.irecv(payload, self.peer, group=self.group, tag=PAYLOAD_TAG)
        elif layout != self._layout:
            raise RuntimeError(
                f"The tensor from rank {self.peer} changed from {self._layout} to {layout} (dtype, shape). "
                "Pipeline stages exchange fixed-shape activations: keep every micro-batch the same shape "
                "(batch size a multiple of num_microbatches, DataLoader(drop_last=True), fixed sequence length)."
            )
        self._wait(payload_work)
        return payload

    def _wait(self, work: dist.Work) -> None:
        try:
            work.wait()
        except RuntimeError as error:
            raise RuntimeError(
                f"Pipeline link {self.name} (rank {self.peer}) broke while waiting for data: {error}. The other "
                "stage has most likely failed (see its error above) or hung past the strategy's `timeout`; "
                "this process stops too."
            ) from error

    def wait_sends(self) -> None:
        for works, _ in self._sends:
            for work in works:
                work.wait()
        self._sends.clear()
