"""What the last stage logs, on every rank of its pipeline.

Lightning's callbacks (``EarlyStopping``, ``ModelCheckpoint``, your own) read ``trainer.callback_metrics`` on
every rank and then meet in a collective (``reduce_boolean_decision``, a checkpoint save). In a pipeline only
the last stage computes the loss and runs the module's evaluation code, so the other stages would lack the
keys: ``EarlyStopping`` raises there, and a ``ModelCheckpoint`` sends the last stage alone into a collective.
:class:`MetricsRelay` copies the last stage's metrics to the other stages of its pipeline replica:

- during training, each step: the last stage posts a non-blocking broadcast of the step's metrics and the
  other stages read it one step later, so no stage waits for another (the first step of a run, which has no
  earlier message, waits for its own once: a pipeline fill);
- at the end of a training epoch, of validation and of testing: a blocking broadcast of all the last stage's
  callback metrics. Validation and testing are synchronous already (the pipeline is flushed before them); an
  epoch end costs one wait per epoch.

Decisions follow the metrics: :func:`reduce_decision` lets only the last stages vote (every rank still joins
the one all-reduce), so a stage holding a copy that is a step old never changes what ``EarlyStopping`` or
``ModelCheckpoint`` decide, and the run stops and saves exactly where one device would.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
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
    "best_k_models", "best_model_path", "best_model_score", "kth_best_model_path", "kth_value", "last_model_path",
    "current_score",
)
# Bytes of a training step's message; grows (announced one message ahead) when the metrics need more.
INITIAL_CAPACITY = 4096
_HEADER = struct.Struct("<qq")  # payload length (-1: skipped, too large), capacity of the next message


def encode(metrics: Mapping[str, Any]) -> bytes:
    """Scalar tensors of ``metrics`` as JSON (one device-to-host copy for all of them)."""
    items = [(k, v) for k, v in metrics.items() if isinstance(v, Tensor) and v.numel() == 1]
    if not items:
        return b"{}"
    values = torch.stack([v.detach().reshape(()).to(torch.float64) for _, v in items]).cpu().tolist()
    return json.dumps({k: [x, str(v.dtype).removeprefix("torch.")] for (k, v), x in zip(items, values)}).encode()


def decode(payload: bytes, device: torch.device) -> dict[str, Tensor]:
    return {k: torch.tensor(x, dtype=getattr(torch, dtype), device=device) for k, (x, dtype) in json.loads(payload).items()}


def reduce_decision(decision: bool, all: bool, votes: bool, device: torch.device) -> bool:
    """``all``/``any`` of ``decision`` over the ranks with ``votes=True``; a collective of every rank.

    The other ranks contribute the neutral element (``True`` for ``all``, ``False`` for ``any``).
    """
    vote = int(bool(decision)) if votes else int(all)
    total = torch.tensor(vote, device=device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return bool(total.item() == dist.get_world_size()) if all else bool(total.item() > 0)


class MetricsRelay:
    """Copies the last stage's metrics into ``trainer.callback_metrics`` on the other stages of its pipeline.

    Args:
        source: Global rank of the pipeline's last stage.
        group: A gloo process group of the pipeline's ranks, used only for metrics.
        rank: This process's global rank.
        device: Where relayed values are placed (the stage's device, as Lightning's own metrics).
    """

    def __init__(self, source: int, group: dist.ProcessGroup, rank: int, device: torch.device) -> None:
        self.source = source
        self.group = group
        self.is_source = rank == source
        self.device = device
        self.capacity = INITIAL_CAPACITY
        self._pending: list[tuple[dist.Work, Tensor]] = []
        self._read_once = False
        self.callback = _RelayCallback(self)

    @classmethod
    def for_pipelines(
        cls, pipelines: list[list[int]], rank: int, device: torch.device, timeout: timedelta | None = None
    ) -> MetricsRelay:
        """Create one relay group per pipeline replica (every rank creates every group, in the same order).

        Args:
            pipelines: The global ranks of each replica's stages, first stage first.
            timeout: How long a rank waits for a relayed message before it gives up (the strategy's timeout).
        """
        relay = None
        for ranks in pipelines:
            group = dist.new_group(ranks, backend="gloo", timeout=timeout)
            if rank in ranks:
                relay = cls(ranks[-1], group, rank, device)
        assert relay is not None, f"rank {rank} is in no pipeline"
        return relay

    def attach(self, trainer: Trainer) -> None:
        """Put the relay's callback first, so the metrics are in place before any other callback reads them."""
        trainer.callbacks[:] = [c for c in trainer.callbacks if not isinstance(c, _RelayCallback)]
        trainer.callbacks.insert(0, self.callback)

    # --- training: one non-blocking message per step, read a step later ------------------------------

    def step(self, trainer: Trainer) -> None:
        """Every rank of the pipeline, once per training step, after the last stage logged the step."""
        if self._pending:
            self._read(trainer)
        payload = None
        if self.is_source:
            # The step's values of what was logged during training (not the older validation values).
            payload = encode(trainer._results.metrics(True)["callback"]) if trainer._results is not None else b"{}"
        self._post(payload)
        if not self._read_once and not self.is_source:
            self._read(trainer)  # the first step of a run has no earlier message to read
        self._read_once = True

    def finish(self, trainer: Trainer) -> None:
        """Read every posted message (at the end of training)."""
        while self._pending:
            self._read(trainer)

    def _post(self, payload: bytes | None) -> None:
        buffer = torch.zeros(self.capacity, dtype=torch.uint8)
        if payload is not None:
            needed = _HEADER.size + len(payload)
            following = max(self.capacity, 1 << (needed - 1).bit_length())
            length = len(payload) if needed <= self.capacity else -1  # too large: skipped once, then fits
            buffer[: _HEADER.size] = torch.frombuffer(bytearray(_HEADER.pack(length, following)), dtype=torch.uint8)
            if length >= 0:
                buffer[_HEADER.size : needed] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            self.capacity = following
        self._pending.append((dist.broadcast(buffer, self.source, group=self.group, async_op=True), buffer))

    def _read(self, trainer: Trainer) -> None:
        work, buffer = self._pending.pop(0)
        work.wait()
        if self.is_source:
            return
        data = buffer.numpy().tobytes()
        length, self.capacity = _HEADER.unpack_from(data)
        if length >= 0:
            trainer.callback_metrics.update(decode(data[_HEADER.size : _HEADER.size + length], self.device))

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
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
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
