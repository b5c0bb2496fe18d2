"""A pipeline stage under Lightning: :class:`PipelineStage` holds what one rank of a multi-process job builds at
``setup`` (its process groups, its placed layers, the step statistics) and the
:class:`~lightning_async_pp.runtime.stage.StageRuntime` that trains or evaluates them, and runs a training or
evaluation step through it.

The training runtime is built once the number of micro-batches is known: when training starts, or with
``num_microbatches="auto"`` at the first training batch, which shows the batch size. A checkpoint restored
before then is held (:meth:`PipelineStage.restore_version`) and handed to the runtime when it is built.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor
from torch.optim import Optimizer

from lightning_async_pp.module import pipeline_evaluation_step
from lightning_async_pp.optim import updates_per_parameter
from lightning_async_pp.runtime.stage import StageRuntime
from lightning_async_pp.runtime.timing import StepStats, write_chrome_trace
from lightning_async_pp.schedule import get_schedule
from lightning_async_pp.strategy.lifecycle import before_optimizer_step
from lightning_async_pp.strategy.optimizer_steps import STAGE_STEP, AccumulationWindow, check_closure_use
from lightning_async_pp.strategy.placement import StagePlacement
from lightning_async_pp.strategy.signals import install_signal_stop
from lightning_async_pp.strategy.stage_stats import StageStatistics
from lightning_async_pp.strategy.topology import PipelineDims, ProcessGroups

__all__ = ["PipelineStage", "StageOptions", "check_shardable"]

log = logging.getLogger("lightning.pytorch.strategies.async_pp")


@dataclass(frozen=True)
class StageOptions:
    """The strategy's settings a stage's runtime is built with (see ``AsyncPipelineStrategy``'s arguments)."""

    schedule: str
    trace_dir: str | None = None
    stage_timing: bool = True
    shard_optimizer: bool = False


def check_shardable(optimizer: Optimizer) -> None:
    """Refuse an optimizer whose update of a parameter may read other parameters' gradients or state.

    Raises:
        ValueError: Naming the optimizer and what to change.
    """
    if not updates_per_parameter(optimizer):
        name = type(optimizer).__name__
        raise ValueError(
            f"Sharding the optimizer state over the replicas (`shard_optimizer=True`) splits a stage's parameters "
            f"between optimizers, one per replica, which gives the same updates only when the update of each "
            f"parameter reads nothing but that parameter's gradient and state (AdamW, SGD, Muon, ...). `{name}` is "
            f"not known to be such an optimizer. If it is, declare it: `{name}.per_parameter = True`. Otherwise "
            f"set `shard_optimizer=False`."
        )


class PipelineStage:
    """This rank's stage of a multi-process job: its groups, placed layers, statistics and runtime.

    Args:
        dims: The job's stages and replicas.
        rank: This process's global rank.
        device: This stage's device.
        groups: This rank's process groups.
        placement: This rank's placed layers.
        options: The runtime's settings.
        forward_context: Context manager factory around forwards (the precision plugin's).
        runtime: A runtime of an earlier ``fit`` or ``validate`` on the same placement, kept so that evaluation
            and checkpoints after ``fit`` see its weight versions.
    """

    def __init__(
        self,
        dims: PipelineDims,
        rank: int,
        device: torch.device,
        groups: ProcessGroups,
        placement: StagePlacement,
        options: StageOptions,
        forward_context: Callable[[], Any],
        runtime: StageRuntime | None = None,
    ) -> None:
        self.dims, self.rank, self.device = dims, rank, device
        self.stage = dims.stage_of(rank)
        self.groups = groups
        self.placement = placement
        self.options = options
        self.forward_context = forward_context
        self.stats = StageStatistics.for_pipeline(dims, rank, groups.stats)
        self.runtime: StageRuntime | None = runtime
        """The training runtime once built, else the evaluation one, if any."""
        self._training: tuple[Trainer, Optimizer] | None = None
        self._restored: tuple[int, dict[str, Tensor] | None] | None = None  # read before the runtime is built
        self._no_loss: Tensor | None = None

    @property
    def trains(self) -> bool:
        """Whether :attr:`runtime` is a training runtime (one with an optimizer)."""
        return self.runtime is not None and self.runtime.optimizer is not None

    # --- building the runtime ----------------------------------------------------------------------

    def start_training(self, trainer: Trainer, optimizers: list[Optimizer], num_microbatches: int | None) -> None:
        """After Lightning set up the optimizer: check it and the tied weights' updates, and build the training
        runtime (``num_microbatches=None``: at the first training batch, which decides the count)."""
        if len(optimizers) != 1:
            raise MisconfigurationException(
                f"AsyncPipelineStrategy needs exactly one optimizer, got {len(optimizers)}. Return one "
                "optimizer from `configure_optimizers` (Muon and DelayCorrected are single optimizers)."
            )
        optimizer = optimizers[0]
        self.placement.check_tied_updates(self.stage, optimizer)
        if self._shards_optimizer:
            check_shardable(optimizer)
        check_closure_use(optimizer, STAGE_STEP)
        self._training = (trainer, optimizer)
        self.runtime, self._restored = None, None
        if num_microbatches is not None:
            self._build_training_runtime(num_microbatches)
        install_signal_stop(trainer, self.groups.metrics)  # the request rides on the metrics relay
        # Stages apply their first update inside a later step, after Lightning has stepped the scheduler;
        # each update uses the learning rate of its own step (see StageRuntime). torch warns about a scheduler
        # stepped before its optimizer unless the optimizer has stepped; it will, so say so on this optimizer
        # only, instead of filtering the warning for the whole process.
        optimizer._opt_called = True

    @property
    def _shards_optimizer(self) -> bool:
        return self.options.shard_optimizer and self.dims.data_parallel_size > 1

    def _stage_arguments(self, module: LightningModule) -> dict[str, Any]:
        """The arguments every runtime of this rank shares: its place in the pipeline and the module's contract."""
        dims, stage, replica = self.dims, self.stage, self.dims.replica_of(self.rank)
        return dict(
            stage=stage,
            num_stages=dims.num_stages,
            layers=self.placement.modules,
            inputs_fn=lambda mb: module.pipeline_inputs(mb),
            loss_fn=lambda out, mb: module.pipeline_loss(out, mb),
            device=self.device,
            prev_rank=dims.rank_of(stage - 1, replica) if stage > 0 else None,
            next_rank=dims.rank_of(stage + 1, replica) if stage < dims.num_stages - 1 else None,
            p2p_group=self.groups.p2p,
            order_group=self.groups.order,
            forward_context=self.forward_context,
        )

    def _build_training_runtime(self, num_microbatches: int) -> None:
        assert self._training is not None, "start_training comes first"
        trainer, optimizer = self._training
        version, previous = self._restored if self._restored is not None else (0, None)
        runtime = StageRuntime(
            kind=self.options.schedule,
            num_microbatches=num_microbatches,
            optimizer=optimizer,
            check_finite=True,
            clip_grad_norm=trainer.gradient_clip_val or None,
            norm_group=self.groups.norm,
            data_group=self.groups.data if self.dims.data_parallel_size > 1 else None,
            shard_optimizer=self._shards_optimizer,
            trace=self.options.trace_dir is not None,
            time_actions=self.options.stage_timing,
            before_update=before_optimizer_step(trainer, optimizer),
            ties=self.placement.tied_gradients,
            start_version=version,
            **self._stage_arguments(trainer.lightning_module),
        )
        if previous is not None:
            runtime_names = self._runtime_names(runtime, trainer.lightning_module)
            runtime.load_previous_weights({runtime_names[n]: t for n, t in previous.items()})
        self.runtime, self._restored = runtime, None

    @staticmethod
    def _runtime_names(runtime: StageRuntime, module: LightningModule) -> dict[str, str]:
        """The module's name of each trainable parameter to the runtime's."""
        module_names = {id(p): n for n, p in module.named_parameters()}
        return {module_names[id(p)]: n for n, p in runtime.params.items()}

    # --- steps ------------------------------------------------------------------------------------

    def training_step(self, module: LightningModule, window: AccumulationWindow, num_microbatches: int) -> Tensor:
        """At the optimizer step, run the stage's step on the batches of ``window``; log the loss on the last stages.
        Returns the loss (NaN elsewhere, and for a batch whose window has not reached its optimizer step yet).

        Args:
            module: The LightningModule, for logging.
            window: The batches of this optimizer step (more than one with gradient accumulation).
            num_microbatches: The micro-batches per batch, decided by the first batch at the latest; the training
                runtime is built with it if it was not yet.
        """
        if not self.trains:
            self._build_training_runtime(num_microbatches)
        loss, stats = None, None
        if window.complete:  # else the batch waits for the rest of its window
            step = module.trainer.global_step
            loss, stats = self.runtime.run_step(step, *window.batches, accumulation=window.size)
        if loss is not None:
            if self.dims.data_parallel_size > 1:  # the loss of the global batch: mean over the replicas
                dist.all_reduce(loss, group=self.groups.data)
                loss /= self.dims.data_parallel_size
            # A device tensor: loggers read it every `log_every_n_steps`. The progress bar would read it
            # every step, a host-device synchronization per step, so it shows the loss on CPU only.
            on_cpu = loss.device.type == "cpu"
            module.log("train/loss", loss, prog_bar=on_cpu, on_step=True, on_epoch=False)
        self.stats.report(stats, module.trainer)
        # The gradients are already in place; `backward` skips this detached value. Only the last
        # stage (rank 0) knows the loss.
        if loss is None:
            if self._no_loss is None:
                self._no_loss = torch.full((), float("nan"), device=self.device)
            loss = self._no_loss
        return loss

    def evaluation_step(self, module: LightningModule, kind: str, batch: Any, batch_idx: int, count: int) -> Any:
        """The batch goes through the stages in up to ``count`` micro-batches; the last stage hands the output to
        the module's ``pipeline_{kind}_step`` and returns what it returns, the other stages return ``None``."""
        if self.runtime is None:  # validation or testing outside of fit, or before the first training batch
            self.runtime = StageRuntime(
                kind="1f1b", num_microbatches=count, optimizer=None, **self._stage_arguments(module)
            )
        output = self.runtime.evaluate(batch, count)
        if output is None:
            return None
        return pipeline_evaluation_step(module, kind, output, batch, batch_idx)

    # --- flushes, the end of training, checkpoints ---------------------------------------------------

    def drain(self) -> None:
        """Finish all in-flight micro-batches and apply pending updates."""
        if self.runtime is not None:
            self.runtime.drain()

    def finish(self, trainer: Trainer, gather_stages: Callable[[Any], list[Any] | None]) -> None:
        """At the end of training: report the last steps' statistics, and write the Chrome trace on rank 0.

        Args:
            trainer: The Trainer, whose loggers get the statistics.
            gather_stages: Collects an object from every stage on rank 0 (a collective; ``None`` elsewhere).
        """
        remaining: list[StepStats] = self.runtime.take_stats() if self.trains else []
        self.stats.finish(remaining, trainer)
        if self.options.trace_dir is None or self.runtime is None:
            return
        gathered = gather_stages((self.stage, self.runtime.events))
        if gathered is not None:
            path = write_chrome_trace(gathered, self.options.trace_dir)
            log.info(f"Pipeline trace written to {path} (open it in chrome://tracing or ui.perfetto.dev)")

    def newest_version(self, default: int) -> int:
        """The weight version the parameters hold (``default`` before a training runtime has any)."""
        if self.trains:
            return self.runtime.newest_version
        return self._restored[0] if self._restored is not None else default

    def previous_weights(self, module: LightningModule) -> dict[str, Tensor] | None:
        """``w[t-1]`` of this stage's trainable parameters, keyed like the module's parameters (2BW only, during or
        after training); before the training runtime is built, ``w[-1] = w[0]`` or what a checkpoint restored."""
        if 1 not in get_schedule(self.options.schedule).checkpoint_lags:
            return None
        if self.trains:
            names = self._runtime_names(self.runtime, module)
            runtime_names = {r: n for n, r in names.items()}
            return {runtime_names[n]: t for n, t in self.runtime.previous_weights().items()}
        if self._training is None:
            return None
        if self._restored is not None and self._restored[1] is not None:
            return self._restored[1]
        return self._trainable_copy(module)

    def _trainable_copy(self, module: LightningModule) -> dict[str, Tensor]:
        """A copy of this stage's trainable parameters, keyed like the module's parameters (``w[-1] = w[0]``)."""
        module_names = {id(p): n for n, p in module.named_parameters()}
        trained = [p for p in self.placement.params.values() if p.requires_grad]
        return {module_names[id(p)]: p.detach().clone() for p in trained}

    def restore_version(self, version: int, module: LightningModule) -> None:
        """Resuming training from ``version``: the runtime's weight versions (before the first step), or, before
        the runtime is built, held for it; load ``w[t-1]`` into :meth:`previous_weights` after."""
        if self.trains:
            self.runtime.restore_version(version)
        else:
            lags = get_schedule(self.options.schedule).checkpoint_lags
            previous = self._trainable_copy(module) if 1 in lags else None
            self._restored = (version, previous)
