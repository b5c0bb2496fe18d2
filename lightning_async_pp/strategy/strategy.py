"""``AsyncPipelineStrategy``: PipeDream-2BW and 1F1B pipeline schedules as a Lightning strategy.

The strategy implements Lightning's hooks and delegates to the objects it builds from its settings: the job's
processes and groups to :class:`~lightning_async_pp.strategy.processes.PipelineProcesses`, a rank's stage (its
placed layers, :class:`~lightning_async_pp.runtime.stage.StageRuntime` and statistics) to
:class:`~lightning_async_pp.strategy.stage_runtime.PipelineStage`, one device to
:class:`~lightning_async_pp.strategy.single_device.SingleDevice`, checkpoints to
:class:`~lightning_async_pp.strategy.checkpointing.PipelineCheckpoint`, failures to
:class:`~lightning_async_pp.strategy.failure.FailureGuard`.

On one device the strategy trains with exactly the same update rules (gradient on the previous weights,
optimizer step on the current ones, optimizer state never rewound), through a path that shares with the
multi-process runtime only the model's computation and the batch's cut (no schedule, weight versions or
transfers): it is the reference a pipeline must match, and a way to study staleness without a cluster.

With a pipeline-ready module (see :mod:`lightning_async_pp.runtime.contract`) the strategy computes the
loss itself, micro-batch by micro-batch, through ``pipeline_inputs``, ``pipeline_layers`` and
``pipeline_loss``, and logs it as ``train/loss``; ``training_step`` is not called. On one device any
other ``LightningModule`` trains through its own ``training_step`` with ``num_microbatches=1``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections import deque
from collections.abc import Callable, Generator, Sequence
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_async_pp.meta import MetaLayers
from lightning_async_pp.runtime.contract import is_pipeline_module
from lightning_async_pp.runtime.recompute import ActivationCheckpointing, check_option
from lightning_async_pp.runtime.timing import StepStats
from lightning_async_pp.strategy.checkpointing import (
    CheckpointRestore,
    PipelineCheckpoint,
    base_checkpoint_io,
    checkpoint_folders,
    remove_checkpoint,
    sharded_checkpoint_io,
    single_file_form,
)
from lightning_async_pp.strategy.failure import FailureGuard
from lightning_async_pp.strategy.launch import (
    check_arguments,
    check_pipeline_model,
    check_trainer_settings,
    configure_launcher,
)
from lightning_async_pp.strategy.lifecycle import (
    ResumableLoader,
    local_seed,
    resume_mid_epoch,
    same_order_loader,
    sampler_kwargs,
)
from lightning_async_pp.strategy.microbatches import MicrobatchCount
from lightning_async_pp.strategy.optimizer_steps import AccumulationWindow
from lightning_async_pp.strategy.placement import layer_costs, partition_layers, place_stage
from lightning_async_pp.strategy.processes import PipelineProcesses
from lightning_async_pp.strategy.progress import show_epoch_without_total
from lightning_async_pp.strategy.routing import report_routing
from lightning_async_pp.strategy.single_device import SingleDevice
from lightning_async_pp.strategy.stage_runtime import PipelineStage, StageOptions
from lightning_async_pp.strategy.summary import use_pipeline_summary
from lightning_async_pp.strategy.throughput import install_throughput_monitor

# A child of Lightning's logger, so rank 0's messages are shown with Lightning's own.
log = logging.getLogger("lightning.pytorch.strategies.async_pp")


class AsyncPipelineStrategy(PipelineProcesses):
    """Pipeline-parallel training with the asynchronous PipeDream-2BW schedule or synchronous 1F1B.

    ``"2bw"`` never flushes the pipeline, so it has no bubble; the price is a constant one-step gradient
    delay: ``w[t+1] = w[t] - u(grad f(w[t-1]), batch t)`` with ``w[-1] = w[0]``, where ``u`` is the whole
    optimizer update. ``"1f1b"`` is ordinary synchronous training: ``w[t+1] = w[t] - u(grad f(w[t]), batch t)``.

    With ``devices=P > 1`` the model's layers are cut into ``P`` contiguous stages, one per process, and
    micro-batches stream through them (see :mod:`lightning_async_pp.runtime.stage`). The last stage,
    which computes the loss, runs on global rank 0, so ``train/loss`` is logged where Lightning logs,
    without a per-step collective that would stall the pipeline.

    Args:
        schedule: ``"2bw"`` (asynchronous, one-step delay) or ``"1f1b"`` (synchronous).
        num_microbatches: Micro-batches each batch is split into (along its first dimension). Their
            gradients are averaged, so the update equals the full-batch one. The batch size must be a
            multiple of it; ``"2bw"`` needs at least as many micro-batches as stages. ``"auto"``: the smallest
            number that is at least the number of stages and divides the batch size, chosen at the first
            training batch and logged on rank 0 (1 on one device).
        pipeline_parallel_size: Stages per pipeline ``P``. ``None`` makes every process a stage of one pipeline;
            otherwise the ``devices * num_nodes`` processes form ``D = processes / P`` replicas of the pipeline
            (data parallelism), each reading its own shard of the data, whose stages average their gradients
            over the replicas before each (delayed) update.
        split_points: Explicit stage boundaries as layer indices: stage ``k`` starts at layer
            ``split_points[k-1]`` (``P-1`` increasing values). ``None`` balances the stages by ``balance``.
        balance: What to balance when ``split_points`` is not given: ``"parameters"`` (parameter count per
            layer), ``"time"`` (forward+backward time of each layer, measured on rank 0 with the module's
            ``example_input_array`` as the first layer's input), or a list with one cost per layer.
        activation_checkpointing: Layers that keep only their input and recompute their forward in backward,
            trading compute for activation memory: ``True`` (every pipeline layer), a list of layer indices,
            layer types or layer class names (``["Block"]``), or ``False``. The recompute uses the weight
            version the micro-batch was pinned to, as does a layer that calls ``torch.utils.checkpoint`` itself.
        trace_dir: If set, each stage writes a Chrome trace (``chrome://tracing`` / Perfetto JSON) of the
            actions it executed, with their real start and end times, to this folder.
        shard_optimizer: With ``D > 1`` replicas, each replica of a stage keeps the optimizer state of a disjoint
            set of the stage's tensors (about ``1/D`` of it): gradients are reduce-scattered to their owners and
            the new weights all-gathered (see :mod:`~lightning_async_pp.runtime.sharding`). The optimizer must
            update each parameter from its own gradient and state only (AdamW, SGD, Muon, ``DelayCorrected``).
        throughput_monitor: Add a ``PipelineThroughputMonitor`` (``throughput/*`` of the whole job) to a ``fit`` with
            a logger and no monitor; ``None``: with several processes (on one device Lightning's counts right).
        stage_timing: Time every action for the ``pipeline/stage{s}/*`` metrics (two CUDA events per action on
            GPUs). ``False`` logs only ``version_lag`` of them; a trace (``trace_dir``) times actions regardless.
        start_method: How processes are started for ``devices > 1``: ``"popen"`` re-runs the script
            (like ``strategy="ddp"``); ``"spawn"`` works in notebooks and tests.
        accelerator: Set by the ``Trainer``.
        parallel_devices: Set by the ``Trainer``.
        cluster_environment: Set by the ``Trainer``.
        save_distributed_checkpoint: As ``ModelParallelStrategy``'s: ``True`` writes a directory of shards (see
            :mod:`lightning_async_pp.checkpoint`), ``False`` Lightning's single file (gathered by rank 0, see
            :mod:`~lightning_async_pp.checkpoint.single_file`); ``None``: a file on one process, else the directory.
        checkpoint_io: Checkpoint plugin. :class:`~lightning_async_pp.checkpoint.ShardedCheckpointIO` writes both
            forms; another plugin given here writes the files (and ``meta.pt``), Lightning's ``AsyncCheckpointIO``
            runs the whole save in its thread.
        precision_plugin: Set by the ``Trainer``.
        process_group_backend: ``torch.distributed`` backend (default: NCCL on GPUs, gloo on CPUs).
        timeout: How long a process waits for a transfer or collective before it gives up and brings the job
            down. A stage that fails or dies is noticed within seconds by a heartbeat on the control traffic (see
            :mod:`~lightning_async_pp.strategy.failure`); the timeout catches a hung one. In YAML, ``"0:05:00"``.
    """

    strategy_name = "async_pp"

    def __init__(
        self,
        schedule: str = "2bw",
        num_microbatches: int | Literal["auto"] = "auto",
        pipeline_parallel_size: int | None = None,
        split_points: Sequence[int] | None = None,
        balance: Literal["parameters", "time"] | Sequence[float] = "parameters",
        activation_checkpointing: ActivationCheckpointing = False,
        trace_dir: str | None = None,
        stage_timing: bool = True,
        throughput_monitor: bool | None = None,
        shard_optimizer: bool = False,
        start_method: Literal["popen", "spawn"] = "popen",
        save_distributed_checkpoint: bool | None = None,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta = timedelta(minutes=5),
    ) -> None:
        check_arguments(schedule, num_microbatches, pipeline_parallel_size, balance, start_method)
        check_option(activation_checkpointing)
        single_file_form(save_distributed_checkpoint, multi_process=False)  # refuses another value
        super().__init__(
            accelerator,
            parallel_devices,
            cluster_environment,
            checkpoint_io,
            precision_plugin,
            pipeline_parallel_size,
            process_group_backend,
            timeout,
        )
        self.schedule = schedule
        self.microbatches = MicrobatchCount(num_microbatches)
        self.split_points = list(split_points) if split_points is not None else None
        self.balance = balance if isinstance(balance, str) else [float(c) for c in balance]
        self.activation_checkpointing = activation_checkpointing
        self.trace_dir = trace_dir
        self.stage_timing = stage_timing
        self.throughput_monitor = throughput_monitor
        self.shard_optimizer = shard_optimizer
        self.start_method = start_method
        self.save_distributed_checkpoint = save_distributed_checkpoint
        self._data_seed = 0
        self._stage: PipelineStage | None = None
        self._window = AccumulationWindow()  # the batches of one optimizer step (gradient accumulation)
        self._single_device = SingleDevice(self._window)
        self._restore = CheckpointRestore()
        self._failure = FailureGuard()

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per training batch (with ``"auto"``: decided by the first training batch)."""
        return self.microbatches.value

    @property
    def pipeline_stage(self) -> PipelineStage | None:
        """This rank's stage once it is placed (several processes only)."""
        return self._stage

    @property
    def stage_layers(self) -> range | None:
        """The indices of this stage's layers once it is placed (several processes only)."""
        return self._stage.placement.stage_layers if self._stage is not None else None

    @property
    def stage_stats(self) -> dict[int, deque[StepStats]]:
        """On global rank 0: every stage's :class:`StepStats` of the last ``STAGE_STATS_HISTORY`` steps (see
        :mod:`lightning_async_pp.strategy.stage_stats`), per stage, in step order."""
        return self._stage.stats.records if self._stage is not None else {}

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return sampler_kwargs(self.data_parallel_size, self.replica, self._data_seed)

    @override
    def _configure_launcher(self) -> None:
        known = self.microbatches.at_launch(self.num_stages)
        self._launcher = configure_launcher(self, self.start_method, self.schedule, known, self.check_model)

    def check_model(self, module: LightningModule) -> None:
        """Raise a clear error if ``module`` cannot be trained as this pipeline (called before launching)."""
        precision = self.precision_plugin.precision if self.precision_plugin is not None else "32-true"
        time_balanced = self.balance == "time" and self.split_points is None
        num_stages = self.num_stages if self.multi_process else None
        check_pipeline_model(
            module, precision, self.activation_checkpointing, num_stages, time_balanced, self.layer_partition
        )

    def layer_partition(self, module: LightningModule) -> list[range]:
        """The layers of each stage, from ``split_points`` or balanced by ``balance``."""
        layers = list(module.pipeline_layers())
        costs = None
        if self.split_points is None:
            device = self.root_device if self.balance == "time" else None  # where rank 0 times the layers
            broadcast = functools.partial(self.broadcast, src=0)
            costs = layer_costs(module, layers, self.balance, device, broadcast, self.global_rank)
        return partition_layers(layers, self.num_stages, self.split_points, costs)

    @override
    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # `trainer.init_module(empty_init=True)` builds a multi-stage model's layers on the meta device: each rank
        # materialises only its own stage's layers in `setup`.
        if self.multi_process and empty_init:
            with MetaLayers():
                yield
            return
        with super().tensor_init_context(empty_init):
            yield

    @override
    @contextlib.contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        # Layers created in `configure_model` start on the meta device too.
        if self.multi_process:
            with MetaLayers():
                yield
            return
        yield

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def setup(self, trainer: Trainer) -> None:
        check_trainer_settings(trainer, self.multi_process)
        module = self.lightning_module
        self.check_model(module)
        use_pipeline_summary(trainer)  # one table of every stage, not this rank's stage only
        show_epoch_without_total(trainer)
        # Before the stage is cut: rank 0 copies the layers to meta.
        install_throughput_monitor(trainer, module, self.is_global_zero, self.throughput_monitor)
        if self.multi_process:
            self._stage = self._setup_stage(trainer, module)
        else:
            self._single_device.setup(module, self.num_microbatches, self.activation_checkpointing, self.schedule)
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            total = functools.partial(self.reduce, reduce_op="sum")
            report_routing(self.optimizers, self.root_device, self.dims, self.global_rank, total)
            if self.multi_process:
                self._stage.start_training(trainer, self.optimizers, self.microbatches.known)
        group = self._stage.groups.checkpoint if self.multi_process else None
        base_checkpoint_io(self.checkpoint_io).setup(group, checkpoint_folders(trainer))
        self._restore.into_stage(self._checkpoint(), trainer.state.fn == TrainerFn.FITTING)

    def _setup_stage(self, trainer: Trainer, module: LightningModule) -> PipelineStage:
        """Create the process groups, agree on the data order, and cut the module down to this rank's stage."""
        dims, rank = self.dims, self.global_rank
        groups = self.create_process_groups()
        # The heartbeat starts while every rank is here, well within the timeout.
        self._failure.start(groups.watchdog, dims, rank, self.timeout)
        # One data order for every stage of a pipeline: the shuffle seed is rank 0's (see data_order).
        self._data_seed = self.broadcast(local_seed(), src=0)
        earlier = self._stage
        # A module cut by an earlier fit/validate/test of this Trainer has lost the other stages' layers.
        if earlier is not None and earlier.placement.module is module:
            placement, runtime = earlier.placement, earlier.runtime
        else:
            partition, checkpointing = self.layer_partition(module), self.activation_checkpointing
            where = (dims, rank, self.root_device, self.process_group_backend, checkpointing, groups.data, self.timeout)
            placement, runtime = place_stage(module, partition, *where), None
        groups.metrics.attach(trainer)
        options = StageOptions(self.schedule, self.trace_dir, self.stage_timing, self.shard_optimizer)
        forward_context = self.precision_plugin.forward_context
        return PipelineStage(dims, rank, self.root_device, groups, placement, options, forward_context, runtime)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        batch = kwargs["batch"] if "batch" in kwargs else args[0]
        cut = self._stage is not None or is_pipeline_module(module)  # not a module's own step on one device
        self.microbatches.decide(batch, self.num_stages, cut, self.is_global_zero)
        self._window.add(batch, module.trainer)
        if self._stage is not None:
            return self._stage.training_step(module, self._window, self.num_microbatches)
        if not is_pipeline_module(module):
            return super().training_step(*args, **kwargs)
        return self._single_device.training_step(module, batch, self.num_microbatches, self.precision_plugin)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        if self._stage is not None:
            return closure_loss
        loss = self._single_device.backward(self, closure_loss, optimizer, *args, **kwargs)
        return loss if loss is not None else super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        with self._window.optimizer_step():  # the training step in `closure` is the window's last
            if self._stage is not None:  # the stage runtime applies its updates itself, inside the step
                return closure()
            return super().optimizer_step(optimizer, self._single_device.wrap(optimizer, closure), model, **kwargs)

    @override
    def block_backward_sync(self) -> contextlib.AbstractContextManager:
        return self._single_device.accumulating()  # around the batches of an accumulation window before its last

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not trainer.training or isinstance(dataloader, ResumableLoader):
            return dataloader
        if self.multi_process:  # one order for every stage; one device reads the user's loader as Lightning does
            dataloader = same_order_loader(dataloader, self._data_seed, self.data_parallel_size, self.replica)
        # A resumed run continues mid-epoch exactly where the checkpoint was taken.
        return resume_mid_epoch(trainer, dataloader)

    def flush(self) -> None:
        """Finish all in-flight micro-batches and apply pending updates (no-op on one device)."""
        if self._stage is not None:
            self._stage.drain()

    @override
    def on_validation_start(self) -> None:
        self.flush()
        super().on_validation_start()

    @override
    def on_train_end(self) -> None:
        self.flush()
        if self._stage is not None:
            self._stage.finish(self.lightning_module.trainer, self.gather_stages)
        super().on_train_end()

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("validation", super().validation_step, args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("test", super().test_step, args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("predict", super().predict_step, args, kwargs)

    def _evaluation_step(self, kind: str, on_one_device: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if not self.multi_process:
            return on_one_device(*args, **kwargs)
        batch = kwargs["batch"] if "batch" in kwargs else args[0]
        batch_idx = kwargs.get("batch_idx", args[1] if len(args) > 1 else 0)
        return self._stage.evaluation_step(self.lightning_module, kind, batch, batch_idx, self.microbatches.evaluated)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        # A checkpoint holds settled weights: every started micro-batch finished, every update applied.
        self.flush()
        return super().lightning_module_state_dict()

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Lightning's order (hooks and callbacks restored before `setup`); the tensors of a sharded or
        # several-process checkpoint are read at the end of `setup`, into the placed stage.
        return False

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        self._checkpoint_io = sharded_checkpoint_io(self._checkpoint_io)
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        self._checkpoint_io = io

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write a checkpoint in the form ``save_distributed_checkpoint`` asks: a directory (each stage its own
        shard, rank 0 the metadata) or a single file.

        Every rank calls this (Lightning's ``trainer.save_checkpoint`` and ``ModelCheckpoint`` do).
        """
        self._checkpoint().save(self.checkpoint_io, checkpoint, filepath, storage_options)

    def _checkpoint(self) -> PipelineCheckpoint:
        return PipelineCheckpoint(
            self.lightning_module,
            self.optimizers,
            self.schedule,
            self.dims,
            self.global_rank,
            self.num_microbatches,
            self.root_device,
            single_file_form(self.save_distributed_checkpoint, self.multi_process),
            self.shard_optimizer,
            self._stage,
            self._single_device.delayed_weights,
        )

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            remove_checkpoint(self.checkpoint_io, filepath)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """What Lightning restores from; each stage reads its part of the tensors at the end of ``setup``."""
        return self._restore.read(self._checkpoint(), self.checkpoint_io, checkpoint_path, weights_only)

    @override
    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        if self._restore.lightning_restores:
            super().load_model_state_dict(checkpoint, strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        if self._restore.lightning_restores:
            super().load_optimizer_state_dict(checkpoint)
        self._restore.after_optimizers(self._checkpoint())

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._failure.on_exception(exception)  # first: the error, on stderr, before any other rank's
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        self._restore.restored = None
        if self._failure.teardown(self.flush):  # failed: no drain (peers are not draining), groups aborted
            return
        # The (drained) runtime and the delayed weights stay, so that `trainer.save_checkpoint` after `fit`
        # still records both weight versions.
        super().teardown()
