"""Point-to-point transfer of messages between neighbouring stages over ``torch.distributed``.

A message is a sequence of tensors (an activation, or several; the gradients that flow back). Each
:class:`Channel` is one link between two neighbouring stages, carrying messages both ways.

Layouts are negotiated, not sent with every message. The first message a channel sends after it was
created or after :meth:`Channel.forget_layout` (a run start, evaluation micro-batches of new shapes) is
preceded by one small header that lists each tensor's dtype and shape; from then on only payloads travel,
and the receiver allocates the next message's buffers from the layout it learnt, which lets it post the
receive ahead of time. A sender checks each later message only against the negotiated layout (each tensor's
dtype and shape); one that no longer matches stops with an error that says what to change (pipelines need a
fixed micro-batch shape).

Every transfer goes through :func:`torch.distributed.batch_isend_irecv`, and a send is batched with the
receive that follows it on the same link (``send(..., post_recv=True)``). On NCCL, point-to-point
operations between two ranks run in posting order on one stream, and a receive queued before a send the
peer is waiting for blocks both ranks for good; batching lets the two run together, as
``torch.distributed.pipelining`` and Megatron-LM do. The runtime posts operations in the order
:func:`lightning_async_pp.schedule.posting_plan` gives, which
:func:`lightning_async_pp.schedule.check_transfers` proves free of deadlocks under those
semantics. Sends never block the sender.

A posted send keeps its tensors referenced until it is known to be complete. NCCL's works say so
(``is_completed``); gloo's never do before ``wait()``, and a gloo send's ``wait()`` blocks until the peer has
posted the matching receive. So the runtime tells a channel which of its messages the peer has certainly
received (:meth:`Channel.peer_received`, from what the schedule implies about a message it got back), and
the channel then waits for those sends, which returns at once, and lets their tensors go. Without that a
run on gloo would hold every activation it sent until the next drain.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

MAX_DIMS = 8
MAX_TENSORS = 32
# The dtypes NCCL transfers; it has no int16 (runtime.activations sends int16 widened to int32).
DTYPES = [
    torch.float32, torch.bfloat16, torch.float16, torch.float64,
    torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool,
]  # fmt: skip
_ENTRY = 2 + MAX_DIMS  # dtype, ndim, shape
HEADER_LEN = 1 + MAX_TENSORS * _ENTRY

Layout = tuple[tuple[torch.dtype, tuple[int, ...]], ...]


def layout_of(tensors: Sequence[Tensor]) -> Layout:
    """Dtypes and shapes of a message, refusing what a header cannot describe."""
    if not 1 <= len(tensors) <= MAX_TENSORS:
        raise ValueError(f"A message between stages holds 1 to {MAX_TENSORS} tensors, got {len(tensors)}.")
    for t in tensors:
        if not isinstance(t, Tensor):
            raise TypeError(f"Stages exchange tensors only, got a {type(t).__name__}.")
        if t.dim() > MAX_DIMS:
            raise ValueError(f"Tensors between stages may have at most {MAX_DIMS} dimensions, got {t.dim()}.")
        if t.dtype not in DTYPES:
            raise ValueError(f"Cannot send a {t.dtype} tensor between stages; supported: {DTYPES}.")
    return tuple((t.dtype, tuple(t.shape)) for t in tensors)


def _matches(tensors: Sequence[Tensor], layout: Layout) -> bool:
    """Whether ``tensors`` have ``layout``'s dtypes and shapes: the check of every message once the layout is
    negotiated, cheaper than building the message's layout with :func:`layout_of`, whose validation the
    negotiated layout has passed."""
    if len(tensors) != len(layout):
        return False
    for t, (dtype, shape) in zip(tensors, layout):
        if t.dtype != dtype or t.shape != shape:
            return False
    return True


def encode_layout(layout: Layout) -> Tensor:
    """The header describing ``layout``: a fixed-size int64 CPU tensor."""
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0] = len(layout)
    for index, (dtype, shape) in enumerate(layout):
        base = 1 + index * _ENTRY
        header[base] = DTYPES.index(dtype)
        header[base + 1] = len(shape)
        header[base + 2 : base + 2 + len(shape)] = torch.tensor(shape, dtype=torch.int64)
    return header


def decode_layout(header: Tensor) -> Layout:
    values = header.tolist()
    out = []
    for index in range(values[0]):
        base = 1 + index * _ENTRY
        ndim = values[base + 1]
        out.append((DTYPES[values[base]], tuple(values[base + 2 : base + 2 + ndim])))
    return tuple(out)


def describe(layout: Layout) -> str:
    return "[" + ", ".join(f"{str(dtype).removeprefix('torch.')}{list(shape)}" for dtype, shape in layout) + "]"


@dataclass
class _Receive:
    """A posted receive: either the header (layout unknown) or the payload buffers."""

    header: Tensor | None
    payload: list[Tensor] | None
    works: list[dist.Work] = field(default_factory=list)


class Channel:
    """Ordered message stream with one peer rank, in both directions.

    Args:
        peer: Global rank of the neighbouring stage.
        device: Device the tensors live on (headers travel on it too, as NCCL requires).
        group: Process group of the link, ``None`` for the default group. On NCCL give each link its own
            two-rank group, so that each link has its own stream and ordering.
        name: Names the link in error messages, e.g. ``"stage 1 <- stage 0"``.
    """

    def __init__(self, peer: int, device: torch.device, group: dist.ProcessGroup | None = None, name: str = "") -> None:
        self.peer = peer
        self.name = name or f"rank {peer}"
        self.device = device
        self.group = group
        self._posted: _Receive | None = None
        self._recv_layout: Layout | None = None
        self._send_layout: Layout | None = None
        self._sends: deque[tuple[Any, list[dist.Work], list[Tensor]]] = deque()  # (tag, works, tensors), in order

    # --- sending -----------------------------------------------------------------------------------------

    def send(self, tensors: Sequence[Tensor], post_recv: bool = False, tag: Any = None) -> None:
        """Post a non-blocking send of one message; the tensors stay referenced until it completes.

        Args:
            tensors: The message.
            post_recv: Also post the next receive from the peer, in the same batch (see the module docstring).
            tag: Names the message for :meth:`peer_received` (e.g. its step and micro-batch); tags must grow
                from one message to the next. ``None``: the send is let go only by :meth:`wait_sends` or once
                its work says it completed.
        """
        tensors = [t.detach().contiguous() for t in tensors]
        ops, keep = [], list(tensors)
        if self._send_layout is None:
            layout = layout_of(tensors)
            header = encode_layout(layout).to(self.device)  # once per run: not in the steady state
            ops.append(self._op(dist.isend, header))
            keep.append(header)
            self._send_layout = layout
        elif not _matches(tensors, self._send_layout):
            layout = layout_of(tensors)  # what a header cannot describe has its own error
            raise RuntimeError(
                f"The message to rank {self.peer} changed from {describe(self._send_layout)} to "
                f"{describe(layout)} (dtype and shape of each tensor). Pipeline stages exchange fixed-shape "
                "activations: keep every micro-batch the same shape (batch size a multiple of num_microbatches, "
                "DataLoader(drop_last=True), fixed sequence length)."
            )
        ops += [self._op(dist.isend, t) for t in tensors]
        receive = None
        if post_recv and self._posted is None:
            receive = self._receive_ops()
            ops += [self._op(dist.irecv, t) for t in _buffers(receive)]
        works = send_works = self._post(ops)
        if receive is not None:
            # NCCL answers one work for the whole batch, gloo one per operation; gloo's works must not be
            # waited twice (a second wait waits for another message).
            if len(works) == len(ops):
                count = len(_buffers(receive))
                send_works, receive.works = works[:-count], works[-count:]
            else:
                receive.works = works
            self._posted = receive
        sends = self._sends
        while sends and all(w.is_completed() for w in sends[0][1]):  # NCCL's works say so; gloo's never do
            sends.popleft()
        sends.append((tag, send_works, keep))

    def peer_received(self, through: Any) -> None:
        """The peer has received every message sent with a tag ``<= through``: let their sends go.

        Waiting for such a send does not block (its receive has matched), on gloo as on NCCL.
        """
        self.wait_sends(through)

    @property
    def pending_sends(self) -> int:
        """Messages whose sends are still held (their tensors referenced)."""
        return len(self._sends)

    def wait_sends(self, through: Any = None) -> None:
        """Wait for the posted sends with a tag ``<= through``, or for every posted send (``None``: before the
        pipeline is considered empty); their tensors are let go."""
        sends = self._sends
        while sends and (through is None or (sends[0][0] is not None and sends[0][0] <= through)):
            for work in sends.popleft()[1]:
                self._wait(work)

    # --- receiving ---------------------------------------------------------------------------------------

    def prefetch(self) -> None:
        """Post the receive of the next message, so the peer's send completes while we compute."""
        if self._posted is None:
            receive = self._receive_ops()
            receive.works = self._post([self._op(dist.irecv, t) for t in _buffers(receive)])
            self._posted = receive

    def recv(self) -> list[Tensor]:
        """Wait for the next message from the peer (posting its receive first if it is not posted yet)."""
        self.prefetch()
        receive, self._posted = self._posted, None
        assert receive is not None
        if receive.header is not None:
            for work in receive.works:
                self._wait(work)
            self._recv_layout = decode_layout(receive.header.cpu())  # once per run: not in the steady state
            receive = self._receive_ops()
            receive.works = self._post([self._op(dist.irecv, t) for t in _buffers(receive)])
        for work in receive.works:
            self._wait(work)
        assert receive.payload is not None
        return receive.payload

    def forget_layout(self) -> None:
        """Negotiate the layout again with the next message each way (after a flush, or for evaluation).

        Both ends of a link must call it at the same point of their message streams.
        """
        assert self._posted is None, "forget_layout() while a receive is posted"
        self._recv_layout = self._send_layout = None

    @property
    def receive_posted(self) -> bool:
        return self._posted is not None

    # --- internals ---------------------------------------------------------------------------------------

    def _receive_ops(self) -> _Receive:
        if self._recv_layout is None:
            return _Receive(torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device), None)
        payload = [torch.empty(shape, dtype=dtype, device=self.device) for dtype, shape in self._recv_layout]
        return _Receive(None, payload)

    def _op(self, fn, tensor: Tensor) -> dist.P2POp:
        return dist.P2POp(fn, tensor, self.peer, self.group)

    def _post(self, ops: list[dist.P2POp]) -> list[dist.Work]:
        try:
            return dist.batch_isend_irecv(ops)
        except RuntimeError as error:
            raise self._broken(error) from error

    def _wait(self, work: dist.Work) -> None:
        try:
            work.wait()
        except RuntimeError as error:
            raise self._broken(error) from error

    def _broken(self, error: Exception) -> RuntimeError:
        return RuntimeError(
            f"Pipeline link {self.name} (rank {self.peer}) broke while waiting for data: {error}. The other "
            "stage has most likely failed (see its error above) or hung past the strategy's `timeout`; "
            "this process stops too."
        )


def _buffers(receive: _Receive) -> list[Tensor]:
    return [receive.header] if receive.header is not None else list(receive.payload or [])
