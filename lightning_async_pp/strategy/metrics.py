"""What the last stage logs, on every rank of its pipeline, and a stop request, on every rank of the job.

Lightning's callbacks (``EarlyStopping``, ``ModelCheckpoint``, your own) read ``trainer.callback_metrics`` on
every rank and then meet in a collective (``reduce_boolean_decision``, a checkpoint save). In a pipeline only
the last stage computes the loss and runs the module's evaluation code, so the other stages would lack the
keys: ``EarlyStopping`` raises there, and a ``ModelCheckpoint`` sends the last stage alone into a collective.
:class:`MetricsRelay` copies the last stage's metrics to the other stages of its pipeline replica:

- during training, each step: one non-blocking all-reduce over the pipeline's ranks (a gloo group of the P
  stages of one replica, never the whole job), in which the last stage contributes the step's metrics and
  every stage a stop flag; every stage reads it one step later, so no stage waits for another (the first
  step of a run, which has no earlier message, waits for its own once: a pipeline fill). On CUDA the last
  stage copies the values to pinned host memory without blocking and sends them one step later, so the
  host never waits for the device: the other stages then see a training step's values two steps after it
  (on CPU one step after it);
- at the end of a training epoch, of validation and of testing: a blocking broadcast of all the last stage's
  callback metrics. Validation and testing are synchronous already (the pipeline is flushed before them); an
  epoch end costs one wait per epoch.

The stop flag carries a SIGTERM or a requeue signal (see :mod:`~lightning_async_pp.strategy.signals`) from any
rank to every rank: a rank sets its flag (a small code; the largest raised wins) in the message of the step it
is at; with several replicas the flags first meet in a non-blocking all-reduce (maximum) over the replicas of
each stage (a group of D ranks), read a step later, and enter the pipeline message from there, so every
pipeline's message ``j`` carries the same flags. Every rank reads message ``j`` by the end of step ``j + 1``
and, if a flag is set, stops before step ``j + 2``: all ranks at the same step.

Decisions follow the metrics: :func:`reduce_decision` lets only the last stages vote (every rank still joins
the one all-reduce), so a stage holding a copy that is a step old never changes what ``EarlyStopping`` or
``ModelCheckpoint`` decide, and the run stops and saves exactly where one device would.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor
from typing_extensions import override

__all__ = ["MetricsRelay", "reduce_decision"]

# What a ModelCheckpoint knows about the checkpoints it kept; made the last stage's on every rank at the end of fit.
CHECKPOINT_STATE = (
    "best_k_models",
    "best_model_path",
    "best_model_score",
    "kth_best_model_path",
    "kth_value",
    "last_model_path",
    "current_score",
)
# Bytes of a training step's message; grows (announced one message ahead) when the metrics need more.
INITIAL_CAPACITY = 4096
_HEADER = struct.Struct("<qq")  # payload length (-1: skipped, too large), capacity of the next message
# A training step's message: the header and the payload (last stage only, zeros elsewhere) and one stop-flag byte
# per stage, summed by an all-reduce: the sum is the last stage's bytes and each stage's flag.


def encode(metrics: Mapping[str, Any]) -> bytes:
    """Scalar tensors of ``metrics`` as JSON (one device-to-host copy for all of them)."""
    return _StagedValues(metrics).payload()


class _StagedValues:
    """Scalar tensors of a metrics dict, copied to host memory without blocking (pinned memory on CUDA).

    :meth:`payload` waits for the copy (a no-op on CPU, where the copy is synchronous) and encodes the values.
    """

    def __init__(self, metrics: Mapping[str, Any]) -> None:
        items = [(k, v) for k, v in metrics.items() if isinstance(v, Tensor) and v.numel() == 1]
        self.keys = [(k, str(v.dtype).removeprefix("torch.")) for k, v in items]
        self.host = self.event = None
        if items:
            values = torch.stack([v.detach().reshape(()).to(torch.float64) for _, v in items])
            self.host = torch.empty(values.shape, dtype=torch.float64, pin_memory=values.is_cuda)
            self.host.copy_(values, non_blocking=values.is_cuda)
            if values.is_cuda:
                self.event = torch.cuda.Event()
                self.event.record()

    @property
    def on_device(self) -> bool:
        return self.event is not None

    def payload(self) -> bytes:
        if self.host is None:
            return b"{}"
        if self.event is not None:
            self.event.synchronize()
        values = self.host.numpy().tolist()  # host memory: reading it is not a device synchronisation
        return json.dumps({k: [x, dtype] for (k, dtype), x in zip(self.keys, values)}).encode()


def decode(payload: bytes, device: torch.device) -> dict[str, Tensor]:
    """The values of :func:`encode`'s payload on ``device``: one copy, from pinned memory without blocking on CUDA
    (a copy from pageable memory would wait for the device's queued work)."""
    items = json.loads(payload)
    if not items:
        return {}
    on_cuda = torch.device(device).type == "cuda"
    values = torch.tensor([x for x, _ in items.values()], dtype=torch.float64)
    values = (values.pin_memory() if on_cuda else values).to(device, non_blocking=on_cuda)
    return {k: v.to(getattr(torch, dtype)) for (k, (_, dtype)), v in zip(items.items(), values.unbind())}


def reduce_decision(decision: bool, all: bool, votes: bool, device: torch.device) -> bool:
    """``all``/``any`` of ``decision`` over the ranks with ``votes=True``; a collective of every rank.

    The other ranks contribute the neutral element (``True`` for ``all``, ``False`` for ``any``).
    """
    vote = int(bool(decision)) if votes else int(all)
    total = torch.tensor(vote, device=device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return bool(total.item() == dist.get_world_size()) if all else bool(total.item() > 0)


class MetricsRelay:
    """Copies the last stage's metrics into ``trainer.callback_metrics`` on the other stages of its pipeline, and
    agrees on every rank when to stop.

    Args:
        source: Global rank of the pipeline's last stage.
        group: A gloo process group of the pipeline's ranks, used only for metrics and the stop flag.
        rank: This process's global rank.
        device: Where relayed values are placed (the stage's device, as Lightning's own metrics).
        ranks: The global ranks of the pipeline, first stage first (default: ``[rank, source]`` without
            duplicates, enough for a rank that never raises a stop flag).
        replica_group: With several pipeline replicas, a gloo group of this stage's replicas, on which stop
            flags cross from one pipeline to the others; ``None`` for one pipeline.
    """

    def __init__(
        self,
        source: int,
        group: dist.ProcessGroup,
        rank: int,
        device: torch.device,
        ranks: list[int] | None = None,
        replica_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.source = source
        self.group = group
        self.is_source = rank == source
        self.device = device
        self.ranks = list(ranks) if ranks is not None else sorted({rank, source})
        self.position = self.ranks.index(rank)
        self.replica_group = replica_group
        self.capacity = INITIAL_CAPACITY
        self._pending: list[tuple[dist.Work, Tensor, int]] = []
        self._replica_flag: tuple[dist.Work, Tensor] | None = None
        self._staged: _StagedValues | None = None
        self._read_once = False
        self.posted = 0
        self.stop_before: int | None = None
        """The step (count of training steps run) before which every rank stops; ``None``: no stop requested."""
        self.stop_reason = 0
        """The largest stop code any rank raised in the message that set :attr:`stop_before` (0: none)."""
        self.stop_requested: Callable[[], int] = lambda: 0
        """This rank's stop code (0: none, at most 255), sampled once per step (set by
        :func:`lightning_async_pp.strategy.signals.install_signal_stop`)."""
        self.callback = _RelayCallback(self)

    @classmethod
    def for_pipelines(
        cls, pipelines: list[list[int]], rank: int, device: torch.device, timeout: timedelta | None = None
    ) -> MetricsRelay:
        """Create one relay group per pipeline replica, and with several replicas one stop-flag group per stage
        (every rank creates every group, in the same order).

        Args:
            pipelines: The global ranks of each replica's stages, first stage first.
            timeout: How long a rank waits for a relayed message before it gives up (the strategy's timeout).
        """
        mine = None
        for ranks in pipelines:
            group = dist.new_group(ranks, backend="gloo", timeout=timeout)
            if rank in ranks:
                mine = (ranks, group)
        assert mine is not None, f"rank {rank} is in no pipeline"
        replica_group = None
        if len(pipelines) > 1:
            for replicas in zip(*pipelines):
                group = dist.new_group(list(replicas), backend="gloo", timeout=timeout)
                if rank in replicas:
                    replica_group = group
        ranks, group = mine
        return cls(ranks[-1], group, rank, device, ranks=ranks, replica_group=replica_group)

    def attach(self, trainer: Trainer) -> None:
        """Put the relay's callback first, so the metrics are in place before any other callback reads them."""
        trainer.callbacks[:] = [c for c in trainer.callbacks if not isinstance(c, _RelayCallback)]
        trainer.callbacks.insert(0, self.callback)

    def should_stop(self) -> bool:
        """Whether the steps run so far reached the agreed stop (the same answer on every rank at every step)."""
        return self.stop_before is not None and self.posted >= self.stop_before

    # --- training: one non-blocking message per step, read a step later ------------------------------

    def step(self, trainer: Trainer) -> None:
        """Every rank of the pipeline, once per training step, after the last stage logged the step."""
        if self._pending:
            self._read(trainer)
        payload = None
        if self.is_source:
            # The step's values of what was logged during training (not the older validation values). On CUDA
            # the previous step's, whose copy to the host has had a step to land.
            staged = _StagedValues(trainer._results.metrics(True)["callback"] if trainer._results is not None else {})
            if staged.on_device:
                staged, self._staged = self._staged, staged
            payload = staged.payload() if staged is not None else b"{}"
        self._post(payload, self._stop_flag())
        if not self._read_once and not self.is_source:
            self._read(trainer)  # the first step of a run has no earlier message to read
        self._read_once = True

    def finish(self, trainer: Trainer) -> None:
        """Read every posted message (at the end of training)."""
        while self._pending:
            self._read(trainer)
        if self._replica_flag is not None:
            self._replica_flag[0].wait()
            self._replica_flag = None
        self._staged = None

    def _stop_flag(self) -> int:
        """The code this rank puts into the pipeline message: its own, or with replicas the largest that the replicas
        of its stage raised a step earlier (the same value on each of them)."""
        local = int(self.stop_requested())
        if self.replica_group is None:
            return local
        agreed = 0
        if self._replica_flag is not None:
            work, flag = self._replica_flag
            work.wait()
            agreed = int(flag.numpy()[0])
        flag = torch.tensor([local], dtype=torch.uint8)
        self._replica_flag = (
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.replica_group, async_op=True),
            flag,
        )
        return agreed

    def _post(self, payload: bytes | None, stop: int) -> None:
        flags = len(self.ranks)
        buffer = torch.zeros(self.capacity, dtype=torch.uint8)
        if payload is not None:
            needed = _HEADER.size + flags + len(payload)
            following = max(self.capacity, 1 << (needed - 1).bit_length())
            length = len(payload) if needed <= self.capacity else -1  # too large: skipped once, then fits
            buffer[: _HEADER.size] = torch.frombuffer(bytearray(_HEADER.pack(length, following)), dtype=torch.uint8)
            if length >= 0:
                start = _HEADER.size + flags
                buffer[start : start + length] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            self.capacity = following
        buffer[_HEADER.size + self.position] = int(stop)
        work = dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self._pending.append((work, buffer, self.posted))
        self.posted += 1

    def _read(self, trainer: Trainer) -> None:
        work, buffer, index = self._pending.pop(0)
        work.wait()
        data = buffer.numpy().tobytes()
        flags = len(self.ranks)
        codes = data[_HEADER.size : _HEADER.size + flags]
        if any(codes) and self.stop_before is None:
            self.stop_before = index + 2  # every rank has read message `index` by the end of step `index + 1`
            self.stop_reason = max(codes)
        if self.is_source:
            return
        length, self.capacity = _HEADER.unpack_from(data)
        if length >= 0:
            start = _HEADER.size + flags
            trainer.callback_metrics.update(decode(data[start : start + length], self.device))

    # --- epoch, validation and test ends: one blocking broadcast --------------------------------------

    def sync(self, trainer: Trainer) -> None:
        """Every rank of the pipeline: the last stage's callback metrics, now (a collective)."""
        holder = [encode(trainer.callback_metrics) if self.is_source else None]
        dist.broadcast_object_list(holder, self.source, group=self.group)
        if not self.is_source:
            trainer.callback_metrics.update(decode(holder[0], self.device))

    def share_checkpoint_state(self, trainer: Trainer) -> None:
        """Give every ``ModelCheckpoint`` the last stage's record of the checkpoints it kept (a collective).

        During training the other stages see training metrics a step late, so their own record of the scores can
        differ although they saved the same files; ``ckpt_path="best"`` must name the same file on every rank.
        """
        callbacks = [c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)]
        states = [{k: getattr(c, k) for k in CHECKPOINT_STATE} for c in callbacks] if self.is_source else None
        holder = [move_data_to_device(states, "cpu")]
        dist.broadcast_object_list(holder, self.source, group=self.group)
        if not self.is_source:
            for callback, state in zip(callbacks, move_data_to_device(holder[0], self.device)):
                for key, value in state.items():
                    setattr(callback, key, value)


class _RelayCallback(Callback):
    """Runs the relay at the points where Lightning's callbacks read metrics; kept first in ``trainer.callbacks``."""

    def __init__(self, relay: MetricsRelay) -> None:
        self.relay = relay

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.relay.step(trainer)

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.relay.sync(trainer)

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self.relay.sync(trainer)

    @override
    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.relay.sync(trainer)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.relay.finish(trainer)
        self.relay.share_checkpoint_state(trainer)
