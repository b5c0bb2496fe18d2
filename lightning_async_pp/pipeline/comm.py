"""Point-to-point tensor transfer between neighbouring stages over ``torch.distributed``.

Every transfer is two messages: a small header (dtype and shape) and the payload, so the receiver can
allocate the right buffer even when shapes change between micro-batches. Receives are posted ahead of
time (:meth:`Channel.prefetch`), sends never block the sender.
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
    """

    def __init__(self, peer: int, device: torch.device, group: dist.ProcessGroup | None = None) -> None:
        self.peer = peer
        self.device = device
        self.group = group
        self._pending_header: tuple[Tensor, dist.Work] | None = None
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
        """Post the receive of the next header, so the peer's send completes without waiting for us."""
        if self._pending_header is None:
            header = torch.empty(2 + MAX_DIMS, dtype=torch.int64, device=self.device)
            self._pending_header = (header, dist.irecv(header, self.peer, group=self.group, tag=HEADER_TAG))

    def recv(self) -> Tensor:
        """Wait for the next tensor from the peer."""
        self.prefetch()
        assert self._pending_header is not None
        header, work = self._pending_header
        self._pending_header = None
        work.wait()
        dtype, shape = decode_header(header.cpu())
        payload = torch.empty(shape, dtype=dtype, device=self.device)
        dist.irecv(payload, self.peer, group=self.group, tag=PAYLOAD_TAG).wait()
        return payload

    def wait_sends(self) -> None:
        for works, _ in self._sends:
            for work in works:
                work.wait()
        self._sends.clear()
