"""A pipeline stage under Lightning: placing it (process groups, the data seed, the cut model), its
:class:`~lightning_async_pp.runtime.stage.StageRuntime` (for training, or for forwards only), a training or
evaluation step through it, and its Chrome trace.

The functions take the :class:`~lightning_async_pp.strategy.strategy.AsyncPipelineStrategy` whose stage they
run, as Lightning's launchers take their strategy.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor
from torch.optim import Optimizer

from lightning_async_pp.checkpoint import parameter_aliases
from lightning_async_pp.module import pipeline_evaluation_step
from lightning_async_pp.optim import updates_per_parameter
from lightning_async_pp.runtime.stage import StageRuntime
from lightning_async_pp.runtime.timing import write_chrome_trace
from lightning_async_pp.strategy.lifecycle import before_optimizer_step, local_seed
from lightning_async_pp.strategy.placement import place_stage
from lightning_async_pp.strategy.signals import install_signal_stop
from lightning_async_pp.strategy.stage_stats import StageStatistics
from lightning_async_pp.strategy.topology import ProcessGroups

__all__ = [
    "check_shardable",
    "evaluation_microbatches",
    "evaluation_runtime",
    "setup_stage",
    "stage_evaluation_step",
    "stage_training_step",
    "start_training",
    "training_runtime",
    "write_trace",
]

log = logging.getLogger("lightning.pytorch.strategies.async_pp")


def setup_stage(strategy: Any, trainer: Trainer) -> None:
    """Create the process groups, agree on the data order, and cut the module down to this rank's stage."""
    dims, rank, module = strategy.dims, strategy.global_rank, strategy.lightning_module
    strategy._groups = groups = ProcessGroups(
        dims, rank, strategy.process_group_backend, strategy.root_device, strategy.timeout
    )
    strategy._failure.start(strategy)  # the heartbeat starts while every rank is here, well within the timeout
    strategy._stage_stats = StageStatistics.for_pipeline(dims, rank, groups.stats)
    # One data order for every stage of a pipeline: the shuffle seed is rank 0's (see data_order).
    strategy._data_seed = strategy.broadcast(local_seed(), src=0)
    # A module cut by an earlier fit/validate/test of this Trainer has lost the other stages' layers.
    if strategy._placement is None or strategy._placement.module is not module:
        partition = strategy.layer_partition(module)
        strategy._placement = place_stage(
            module,
            partition,
            dims,
            rank,
            strategy.root_device,
            strategy.process_group_backend,
            strategy.activation_checkpointing,
            groups.data,
            parameter_aliases(module),  # read on the whole model, before the other stages' layers go
            strategy.timeout,
        )
    groups.metrics.attach(trainer)


def start_training(strategy: Any, trainer: Trainer) -> None:
    """After Lightning set up the optimizer: check the tied weights' updates and build the training runtime."""
    optimizers = strategy.optimizers
    if len(optimizers) == 1:  # otherwise the runtime refuses the count with its own message
        strategy._placement.check_tied_updates(strategy.stage, optimizers[0])
    strategy._runtime = training_runtime(strategy, trainer)
    install_signal_stop(trainer, strategy._groups.metrics)  # the request rides on the metrics relay
    # Stages apply their first update inside a later step, after Lightning has stepped the scheduler;
    # each update uses the learning rate of its own step (see StageRuntime). torch warns about a scheduler
    # stepped before its optimizer unless the optimizer has stepped; it will, so say so on this optimizer
    # only, instead of filtering the warning for the whole process.
    for optimizer in optimizers:
        optimizer._opt_called = True


def _stage_arguments(strategy: Any) -> dict[str, Any]:
    """The arguments every runtime of this rank shares: its place in the pipeline and the module's contract."""
    module, stage, last = strategy.lightning_module, strategy.stage, strategy.num_stages - 1
    return dict(
        stage=stage,
        num_stages=strategy.num_stages,
        layers=strategy._placement.modules,
        inputs_fn=lambda mb: module.pipeline_inputs(mb),
        loss_fn=lambda out, mb: module.pipeline_loss(out, mb),
        device=strategy.root_device,
        prev_rank=strategy.rank_of(stage - 1) if stage > 0 else None,
        next_rank=strategy.rank_of(stage + 1) if stage < last else None,
        p2p_group=strategy._groups.p2p,
        order_group=strategy._groups.order,
        forward_context=strategy.precision_plugin.forward_context,
    )


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


def training_runtime(strategy: Any, trainer: Trainer) -> StageRuntime:
    """The runtime that trains this rank's placed stage with the strategy's schedule and optimizer.

    Args:
        strategy: The ``AsyncPipelineStrategy``, its stage placed and its optimizer set up.
        trainer: The Trainer (its gradient clipping, and the hooks run before each update).
    """
    optimizers = strategy.optimizers
    if len(optimizers) != 1:
        raise MisconfigurationException(
            f"AsyncPipelineStrategy needs exactly one optimizer, got {len(optimizers)}. Return one "
            "optimizer from `configure_optimizers` (Muon and DelayCorrected are single optimizers)."
        )
    shard = strategy.shard_optimizer and strategy.data_parallel_size > 1
    if shard:
        check_shardable(optimizers[0])
    groups = strategy._groups
    return StageRuntime(
        kind=strategy.schedule,
        num_microbatches=strategy.num_microbatches,
        optimizer=optimizers[0],
        check_finite=True,
        clip_grad_norm=trainer.gradient_clip_val or None,
        norm_group=groups.norm,
        data_group=groups.data if strategy.data_parallel_size > 1 else None,
        shard_optimizer=shard,
        trace=strategy.trace_dir is not None,
        time_actions=strategy.stage_timing,
        before_update=before_optimizer_step(trainer, optimizers[0]),
        ties=strategy._placement.tied_gradients,
        **_stage_arguments(strategy),
    )


def evaluation_runtime(strategy: Any) -> StageRuntime:
    """A runtime that only runs forwards, for validation or testing outside of ``fit`` (no optimizer)."""
    count = evaluation_microbatches(strategy)
    return StageRuntime(kind="1f1b", num_microbatches=count, optimizer=None, **_stage_arguments(strategy))


def evaluation_microbatches(strategy: Any) -> int:
    """The most micro-batches an evaluation batch is split into: the strategy's ``num_microbatches``, the count
    training uses; with ``"auto"``, 1 until a training step has chosen it (a ``validate`` outside ``fit``)."""
    return 1 if strategy.auto_microbatches else strategy.num_microbatches


def stage_training_step(strategy: Any, module: LightningModule, batch: Any) -> Tensor:
    """Run one training step of the stage; log the loss on the last stages. Returns the loss (NaN elsewhere)."""
    loss, stats = strategy._runtime.run_step(module.trainer.global_step, batch)
    if loss is not None:
        if strategy.data_parallel_size > 1:  # the loss of the global batch: mean over the replicas
            dist.all_reduce(loss, group=strategy._groups.data)
            loss /= strategy.data_parallel_size
        # A device tensor: loggers read it every `log_every_n_steps`. The progress bar would read it
        # every step, a host-device synchronization per step, so it shows the loss on CPU only.
        on_cpu = loss.device.type == "cpu"
        module.log("train/loss", loss, prog_bar=on_cpu, on_step=True, on_epoch=False)
    if strategy._stage_stats is not None:
        strategy._stage_stats.report(stats, module.trainer)
    # The gradients are already in place; `backward` skips this detached value. Only the last
    # stage (rank 0) knows the loss.
    if loss is None:
        if strategy._no_loss is None:
            strategy._no_loss = torch.full((), float("nan"), device=strategy.root_device)
        loss = strategy._no_loss
    return loss


def stage_evaluation_step(strategy: Any, kind: str, args: tuple, kwargs: dict) -> Any:
    """The batch goes through the stages; the last stage hands the output to the module's
    ``pipeline_{kind}_step`` and returns what it returns, the other stages return ``None``."""
    batch = kwargs["batch"] if "batch" in kwargs else args[0]
    batch_idx = kwargs.get("batch_idx", args[1] if len(args) > 1 else 0)
    if strategy._runtime is None:  # validation or testing outside of fit
        strategy._runtime = evaluation_runtime(strategy)
    output = strategy._runtime.evaluate(batch, evaluation_microbatches(strategy))
    if output is None:
        return None
    return pipeline_evaluation_step(strategy.lightning_module, kind, output, batch, batch_idx)


def write_trace(strategy: Any) -> None:
    """Gather every stage's action timings on rank 0 into one Chrome trace (one row per stage)."""
    if strategy.trace_dir is None or strategy._runtime is None:
        return
    gathered = strategy.gather_stages((strategy.stage, strategy._runtime.events))
    if gathered is None:
        return
    path = write_chrome_trace(gathered, strategy.trace_dir)
    log.info(f"Pipeline trace written to {path} (open it in chrome://tracing or ui.perfetto.dev)")
