"""``AsyncPipelineStrategy``: PipeDream-2BW and 1F1B pipeline schedules as a Lightning strategy."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import ReduceOp
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_async_pp.pipeline.contract import is_pipeline_module, require_pipeline_module, run_layers
from lightning_async_pp.pipeline.delayed import DelayedWeights
from lightning_async_pp.pipeline.microbatch import split_microbatches

log = logging.getLogger(__name__)

SCHEDULES = ("2bw", "1f1b")
CHECKPOINT_KEY = "async_pp"


class AsyncPipelineStrategy(ParallelStrategy):
    """Pipeline-parallel training with the asynchronous PipeDream-2BW schedule or synchronous 1F1B.

    ``"2bw"`` never flushes the pipeline, so it has no bubble; the price is a constant one-step gradient
    delay: ``w[t+1] = w[t] - u(grad f(w[t-1]), batch t)`` with ``w[-1] = w[0]``, where ``u`` is the whole
    optimizer update. ``"1f1b"`` is ordinary synchronous training: ``w[t+1] = w[t] - u(grad f(w[t]), batch t)``.

    On one device the strategy trains with exactly these update rules (gradient on the previous weights,
    optimizer step on the current ones, optimizer state never rewound), which makes it the reference a
    multi-stage pipeline must match, and a way to study staleness without a cluster.

    With a pipeline-ready module (see :mod:`lightning_async_pp.pipeline.contract`) the strategy computes the
    loss itself, micro-batch by micro-batch, through ``pipeline_inputs``, ``pipeline_layers`` and
    ``pipeline_loss``, and logs it as ``train/loss``; ``training_step`` is not called. Any other
    ``LightningModule`` trains through its own ``training_step`` with ``num_microbatches=1``.

    Args:
        schedule: ``"2bw"`` (asynchronous, one-step delay) or ``"1f1b"`` (synchronous).
        num_microbatches: Micro-batches each batch is split into (along its first dimension). Their
            gradients are averaged, so the update equals the full-batch one. The batch size must be a
            multiple of it.
        accelerator: Set by the ``Trainer``.
        parallel_devices: Set by the ``Trainer``.
        cluster_environment: Set by the ``Trainer``.
        checkpoint_io: Checkpoint plugin.
        precision_plugin: Set by the ``Trainer``.
        process_group_backend: ``torch.distributed`` backend for multi-process runs (default: NCCL on GPUs,
            gloo on CPUs).
        timeout: Timeout of collective and point-to-point operations between processes.
    """

    strategy_name = "async_pp"

    def __init__(
        self,
        schedule: str = "2bw",
        num_microbatches: int = 1,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta = timedelta(seconds=60),
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        if schedule not in SCHEDULES:
            raise ValueError(
                f"Unknown pipeline schedule {schedule!r}. Set `schedule` to one of {', '.join(map(repr, SCHEDULES))}."
            )
        if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
            raise ValueError(f"`num_microbatches` must be a positive integer, got {num_microbatches!r}.")
        self.schedule = schedule
        self.num_microbatches = num_microbatches
        self.process_group_backend = process_group_backend
        self.timeout = timeout
        self._delayed: DelayedWeights | None = None
        self._microbatch_losses: list[Tensor] | None = None
        self._restored_previous: dict[str, Tensor] | None = None

    # --- placement -----------------------------------------------------------------------------------

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None, "The Trainer sets `parallel_devices` before use."
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def num_stages(self) -> int:
        return max(1, self.num_processes)

    @override
    def _configure_launcher(self) -> None:
        if self.num_processes > 1 or getattr(self.cluster_environment, "world_size", lambda: 1)() > 1:
            raise MisconfigurationException(
                f"AsyncPipelineStrategy was given {self.num_processes} devices, but this version trains "
                "on a single device only (the exact one-step-delay trajectory). Set `devices=1`."
            )
        self._launcher = None

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def setup(self, trainer: Trainer) -> None:
        if trainer.accumulate_grad_batches != 1:
            raise MisconfigurationException(
                "AsyncPipelineStrategy does not support `accumulate_grad_batches` (got "
                f"{trainer.accumulate_grad_batches}): set it to 1 and raise `num_microbatches` (with a larger "
                "batch size) instead; micro-batches already accumulate gradients within a step."
            )
        module = self.lightning_module
        if self.num_microbatches > 1 and not is_pipeline_module(module):
            require_pipeline_module(module, f"needed to split batches into num_microbatches={self.num_microbatches}")
        super().setup(trainer)

    # --- the training step ---------------------------------------------------------------------------

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        if not is_pipeline_module(module):
            return super().training_step(*args, **kwargs)
        batch = kwargs["batch"] if "batch" in kwargs else args[0]
        with self.precision_plugin.train_step_context():
            self._microbatch_losses = self._microbatch_forward(module, batch)
        loss = torch.stack(self._microbatch_losses).mean()
        module.log("train/loss", loss.detach(), prog_bar=True, on_step=True, on_epoch=False)
        return loss

    def _microbatch_forward(self, module: LightningModule, batch: Any) -> list[Tensor]:
        layers = module.pipeline_layers()
        microbatches = split_microbatches(batch, self.num_microbatches)
        return [module.pipeline_loss(run_layers(layers, module.pipeline_inputs(mb)), mb) for mb in microbatches]

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        losses, self._microbatch_losses = self._microbatch_losses, None
        if losses is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        # One backward per micro-batch, in order, as a pipeline stage does: the gradients then
        # accumulate in the same order and the two agree to the last bit.
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        for loss in losses:
            self.precision_plugin.backward(loss / len(losses), module, optimizer, *args, **kwargs)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        if self.schedule == "2bw":
            closure = self._delayed_weights().wrap_closure(closure)
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    def _delayed_weights(self) -> DelayedWeights:
        if self._delayed is None:
            assert self.lightning_module is not None
            self._delayed = DelayedWeights(self.lightning_module, previous=self._restored_previous)
            self._restored_previous = None
        return self._delayed

    # --- checkpoints ---------------------------------------------------------------------------------

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        checkpoint[CHECKPOINT_KEY] = self._checkpoint_state()
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def _checkpoint_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"schedule": self.schedule, "num_stages": self.num_stages}
        if self.schedule == "2bw":
            # Before the first step the previous weights are the current ones (w[-1] = w[0]).
            state["previous_weights"] = self._delayed_weights().state_dict()
        return state

    @override
    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict=strict)
        state = checkpoint.get(CHECKPOINT_KEY, {})
        previous = state.get("previous_weights")
        if self.schedule == "2bw" and previous is not None:
            self._restored_previous = previous
            if self._delayed is not None:
                self._delayed.load_state_dict(previous)
                self._restored_previous = None

    # --- collectives (one process) -------------------------------------------------------------------

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        return tensor

    @override
    def barrier(self, name: str | None = None) -> None:
        pass

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        return tensor

    @override
    def teardown(self) -> None:
        self._delayed = None
        super().teardown()
