"""``AsyncPipelineStrategy``: PipeDream-2BW and 1F1B pipeline schedules as a Lightning strategy."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections import deque
from collections.abc import Callable, Generator, Sequence
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    ReduceOp,
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_async_pp.checkpoint import (
    CHECKPOINT_KEY,
    FORMAT_VERSION,
    SHARD_KEY,
    ShardedCheckpointIO,
    align_lr_schedulers,
    check_compatible,
    is_sharded_checkpoint,
    load_stage,
    parameter_aliases,
    read_index,
    stage_shard,
)
from lightning_async_pp.module import pipeline_evaluation_step
from lightning_async_pp.reference.delayed import DelayedWeights
from lightning_async_pp.runtime.contract import is_pipeline_module, require_pipeline_module, run_layers
from lightning_async_pp.runtime.microbatch import auto_num_microbatches, batch_size_of, split_microbatches
from lightning_async_pp.runtime.recompute import ActivationCheckpointing, check_option, checkpoint_layers, select_layers
from lightning_async_pp.runtime.stage import StageRuntime, StepStats, check_finite_losses
from lightning_async_pp.runtime.ties import (
    Tie,
    TiedGradients,
    broadcast_ties,
    check_tied_updates,
    find_ties,
    new_tie_groups,
    parameter_slots,
    retie,
)
from lightning_async_pp.runtime.timing import StatsRelay, write_chrome_trace
from lightning_async_pp.schedule import SCHEDULES, validate
from lightning_async_pp.schedule.partition import count_parameters
from lightning_async_pp.strategy.lifecycle import (
    ResumableLoader,
    before_optimizer_step,
    check_gradient_clipping_hook,
    local_seed,
    same_order_loader,
    sampler_kwargs,
)
from lightning_async_pp.strategy.metrics import MetricsRelay, install_sigterm_stop, reduce_decision
from lightning_async_pp.strategy.placement import (
    MetaLayers,
    keep_only_layers,
    materialize,
    measure_layer_times,
    partition_layers,
)
from lightning_async_pp.strategy.routing import report_routing
from lightning_async_pp.strategy.stage_stats import StageStatistics
from lightning_async_pp.strategy.topology import barrier as distributed_barrier
from lightning_async_pp.strategy.topology import init_process_group

# A child of Lightning's logger, so each rank's placement line is shown with Lightning's own messages.
log = logging.getLogger("lightning.pytorch.strategies.async_pp")


class AsyncPipelineStrategy(ParallelStrategy):
    """Pipeline-parallel training with the asynchronous PipeDream-2BW schedule or synchronous 1F1B.

    ``"2bw"`` never flushes the pipeline, so it has no bubble; the price is a constant one-step gradient
    delay: ``w[t+1] = w[t] - u(grad f(w[t-1]), batch t)`` with ``w[-1] = w[0]``, where ``u`` is the whole
    optimizer update. ``"1f1b"`` is ordinary synchronous training: ``w[t+1] = w[t] - u(grad f(w[t]), batch t)``.

    With ``devices=P > 1`` the model's layers are cut into ``P`` contiguous stages, one per process, and
    micro-batches stream through them (see :mod:`lightning_async_pp.runtime.stage`). The last stage,
    which computes the loss, runs on global rank 0, so ``train/loss`` is logged where Lightning logs,
    without a per-step collective that would stall the pipeline.

    On one device the strategy trains with exactly the same update rules (gradient on the previous weights,
    optimizer step on the current ones, optimizer state never rewound), through a path that shares no
    code with the multi-process runtime: it is the reference a pipeline must match, and a way to study
    staleness without a cluster.

    With a pipeline-ready module (see :mod:`lightning_async_pp.runtime.contract`) the strategy computes the
    loss itself, micro-batch by micro-batch, through ``pipeline_inputs``, ``pipeline_layers`` and
    ``pipeline_loss``, and logs it as ``train/loss``; ``training_step`` is not called. On one device any
    other ``LightningModule`` trains through its own ``training_step`` with ``num_microbatches=1``.

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
        start_method: How processes are started for ``devices > 1``: ``"popen"`` re-runs the script
            (like ``strategy="ddp"``); ``"spawn"`` works in notebooks and tests.
        accelerator: Set by the ``Trainer``.
        parallel_devices: Set by the ``Trainer``.
        cluster_environment: Set by the ``Trainer``.
        checkpoint_io: Checkpoint plugin. Checkpoints are directories with one shard per stage (see
            :mod:`lightning_async_pp.checkpoint`), written by :class:`~lightning_async_pp.checkpoint.ShardedCheckpointIO`;
            another plugin given here writes their metadata file, and Lightning's ``AsyncCheckpointIO`` runs the
            whole save in its background thread.
        precision_plugin: Set by the ``Trainer``.
        process_group_backend: ``torch.distributed`` backend (default: NCCL on GPUs, gloo on CPUs).
        timeout: How long a process waits for a transfer or collective before it gives up and brings the job
            down. A stage that dies is noticed at once (its connections close); the timeout catches a hung one.
            In YAML, a duration string such as ``"0:05:00"``.
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
        start_method: Literal["popen", "spawn"] = "popen",
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta = timedelta(minutes=5),
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
        if num_microbatches != "auto" and (
            isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1
        ):
            raise ValueError(f"`num_microbatches` must be a positive integer or 'auto', got {num_microbatches!r}.")
        if not (balance in ("parameters", "time") or (not isinstance(balance, str) and len(balance) > 0)):
            raise ValueError(f"`balance` must be 'parameters', 'time' or a list of per-layer costs, got {balance!r}.")
        if start_method not in ("popen", "spawn"):
            raise ValueError(f"`start_method` must be 'popen' or 'spawn', got {start_method!r}.")
        self.schedule = schedule
        # With "auto", one per stage until the first training batch shows the batch size.
        self.auto_microbatches = num_microbatches == "auto"
        self.num_microbatches: int = 1 if num_microbatches == "auto" else num_microbatches
        if pipeline_parallel_size is not None and (
            isinstance(pipeline_parallel_size, bool)
            or not isinstance(pipeline_parallel_size, int)
            or pipeline_parallel_size < 1
        ):
            raise ValueError(f"`pipeline_parallel_size` must be a positive integer, got {pipeline_parallel_size!r}.")
        self.pipeline_parallel_size = pipeline_parallel_size
        self.split_points = list(split_points) if split_points is not None else None
        self.balance = balance if isinstance(balance, str) else [float(c) for c in balance]
        check_option(activation_checkpointing)
        self.activation_checkpointing = activation_checkpointing
        self.trace_dir = trace_dir
        self.start_method = start_method
        self.process_group_backend = process_group_backend
        self.timeout = timeout
        self._num_nodes = 1
        self._delayed: DelayedWeights | None = None
        self._microbatch_losses: list[Tensor] | None = None
        self._restored_sharded = False
        self._partition: list[range] | None = None
        self._model_shapes: dict[str, tuple[int, ...]] | None = None
        self._parameter_aliases: dict[str, str] = {}
        self._runtime: StageRuntime | None = None
        self._stage_stats: StageStatistics | None = None
        self._metrics: MetricsRelay | None = None
        self._steps_run = 0
        self._no_loss: Tensor | None = None
        self._ties: TiedGradients | None = None
        self._tie_groups: tuple[list[Tie], list[Any]] | None = None
        self.stage_layers: range | None = None
        self._partition: list[range] | None = None
        self._data_seed = 0

    # --- processes and placement ---------------------------------------------------------------------

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None, "The Trainer sets `parallel_devices` before use."
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def num_workers(self) -> int:
        """All processes of the job: ``devices * num_nodes``."""
        return max(1, self.num_processes * self.num_nodes)

    @property
    def num_stages(self) -> int:
        """Pipeline depth ``P``: ``pipeline_parallel_size``, or one stage per process."""
        return self.pipeline_parallel_size or self.num_workers

    @property
    def data_parallel_size(self) -> int:
        """Number of pipeline replicas ``D``, each reading its own shard of the data."""
        return max(1, self.num_workers // self.num_stages)

    @property
    def multi_process(self) -> bool:
        return self.num_workers > 1

    @property
    def replica(self) -> int:
        """This process's pipeline replica (data-parallel rank)."""
        return self.global_rank % self.data_parallel_size

    @property
    def stage(self) -> int:
        """This process's stage. Last stages (which have the loss) take the lowest global ranks, replica 0's
        on rank 0, so Lightning logs the loss where it lives."""
        return self.num_stages - 1 - self.global_rank // self.data_parallel_size

    @property
    def stage_stats(self) -> dict[int, deque[StepStats]]:
        """On global rank 0: every stage's :class:`StepStats` of the last ``STAGE_STATS_HISTORY`` steps (see
        :mod:`lightning_async_pp.strategy.stage_stats`), per stage, in step order."""
        return self._stage_stats.records if self._stage_stats is not None else {}

    def rank_of(self, stage: int, replica: int | None = None) -> int:
        """Global rank of ``stage`` in ``replica`` (default: this process's replica)."""
        replica = self.replica if replica is None else replica
        return (self.num_stages - 1 - stage) * self.data_parallel_size + replica

    @property
    def is_distributed(self) -> bool:
        # The stages of one pipeline read the same batches; only replicas need a DistributedSampler.
        return self.data_parallel_size > 1

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return sampler_kwargs(self.data_parallel_size, self.replica, self._data_seed)

    @override
    def _configure_launcher(self) -> None:
        if self.num_workers % self.num_stages != 0:
            raise MisconfigurationException(
                f"devices x num_nodes = {self.num_processes} x {self.num_nodes} = {self.num_workers} processes cannot "
                f"hold whole pipelines of pipeline_parallel_size={self.num_stages}. Use a number of processes that "
                f"is a multiple of {self.num_stages}, or change `pipeline_parallel_size`."
            )
        if self.auto_microbatches:
            self.num_microbatches = self.num_stages
        validate(self.schedule, self.num_stages, self.num_microbatches)
        if not self.multi_process:
            self._launcher = None
            return
        if self.start_method == "popen":
            assert self.cluster_environment is not None
            launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            launcher = _SpawnLauncher(self, start_method=self.start_method)
        launcher.launch = functools.partial(self._checked_launch, launcher.launch)
        self._launcher = launcher

    def _checked_launch(self, launch: Callable, function: Callable, *args: Any, **kwargs: Any) -> Any:
        # `fit(model, ...)`: find configuration errors here, before any other process starts.
        if args and isinstance(args[0], LightningModule):
            self.check_model(args[0])
        return launch(function, *args, **kwargs)

    def check_model(self, module: LightningModule) -> None:
        """Raise a clear error if ``module`` cannot be trained as this pipeline (called before launching)."""
        precision = self.precision_plugin.precision if self.precision_plugin is not None else "32-true"
        if str(precision) in ("16-mixed", "16-true", "16"):
            raise MisconfigurationException(
                f"AsyncPipelineStrategy does not support precision={precision!r}: fp16 needs a loss scale shared by "
                "all stages. Use precision='bf16-mixed' or '32-true'."
            )
        if self.activation_checkpointing is not False:
            require_pipeline_module(module, "needed to apply `activation_checkpointing` to its layers")
            select_layers(list(module.pipeline_layers()), self.activation_checkpointing)
        if self.multi_process:
            require_pipeline_module(module, f"needed to cut it into {self.num_stages} stages")
            check_gradient_clipping_hook(module)
            if self.balance == "time":  # measured in `setup`; here only the layer count
                partition_layers(list(module.pipeline_layers()), self.num_stages, costs=None)
            else:
                self.layer_partition(module)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self.multi_process:
            reset_seed()
            assert self.cluster_environment is not None
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_workers)
            rank_zero_only.rank = self.global_rank
            backend = self.process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
            self.process_group_backend = backend
            if _distributed_is_initialized():
                return
            env = self.cluster_environment
            init_process_group(
                backend,
                env.global_rank(),
                env.world_size(),
                env.main_address,
                env.main_port,
                self.timeout,
                self.root_device,
            )

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
        if trainer.accumulate_grad_batches != 1:
            raise MisconfigurationException(
                "AsyncPipelineStrategy does not support `accumulate_grad_batches` (got "
                f"{trainer.accumulate_grad_batches}): set it to 1 and raise `num_microbatches` (with a larger "
                "batch size) instead; micro-batches already accumulate gradients within a step."
            )
        module = self.lightning_module
        self.check_model(module)
        if self.multi_process:
            self._create_groups()
            # One data order for every stage of a pipeline: the shuffle seed is rank 0's (see data_order).
            self._data_seed = self.broadcast(local_seed(), src=0)
            self._place_stage(module)
            self._metrics.attach(trainer)
        else:
            # The same shuffled order as a pipeline of any depth, so a run can move between P=1 and P>1.
            self._data_seed = local_seed()
            if self.num_microbatches > 1 and not is_pipeline_module(module):
                require_pipeline_module(
                    module, f"needed to split batches into num_microbatches={self.num_microbatches}"
                )
            if self.activation_checkpointing is not False:
                layers = list(module.pipeline_layers())
                checkpoint_layers(layers, select_layers(layers, self.activation_checkpointing))
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            report_routing(self, self.optimizers)
        if self.multi_process and trainer.state.fn == TrainerFn.FITTING:
            self._check_tied_updates()
            self._runtime = self._build_runtime(trainer)
            install_sigterm_stop(trainer, self._metrics)  # the flag rides on the metrics relay
            self._steps_run = 0
            # Stages apply their first update inside a later step, after Lightning has stepped the scheduler;
            # each update uses the learning rate of its own step (see StageRuntime). torch warns about a scheduler
            # stepped before its optimizer unless the optimizer has stepped; it will, so say so on this optimizer
            # only, instead of filtering the warning for the whole process.
            for optimizer in self.optimizers:
                optimizer._opt_called = True
        if self.multi_process:
            self._sharded_io().process_group = self._groups["checkpoint"]

    def _create_groups(self) -> None:
        """Process groups. Every rank creates every group, in the same order, as torch.distributed requires."""
        P, D = self.num_stages, self.data_parallel_size
        backend = self.process_group_backend
        self._groups: dict[str, Any] = {}
        for stage in range(P):  # the replicas of one stage average their gradients
            group = dist.new_group([self.rank_of(stage, d) for d in range(D)], backend=backend)
            if stage == self.stage:
                self._groups["data"] = group
        for replica in range(D):  # one pipeline: activations, and the clipping norm, each on its own group
            ranks = [self.rank_of(s, replica) for s in range(P)]
            p2p, norm = dist.new_group(ranks, backend=backend), dist.new_group(ranks, backend=backend)
            if replica == self.replica:
                self._groups["p2p"], self._groups["norm"] = p2p, norm
        # Statistics travel on gloo (CPU tensors) from replica 0's stages to rank 0.
        stats_ranks = [self.rank_of(s, 0) for s in range(P)]
        stats_group = dist.new_group(stats_ranks, backend="gloo")
        peers = [r for r in stats_ranks if r != 0]
        self._stage_stats = StageStatistics(
            P,
            self.stage,
            self.is_global_zero,
            StatsRelay(self.global_rank, peers, stats_group),
            stage_of_rank=lambda rank: P - 1 - rank // D,
        )
        # What the last stage logs reaches the other stages of its replica (see lightning_async_pp.strategy.metrics).
        pipelines = [[self.rank_of(s, replica) for s in range(P)] for replica in range(D)]
        self._metrics = MetricsRelay.for_pipelines(pipelines, self.global_rank, self.root_device, self.timeout)
        self._steps_run = 0
        # Checkpoints plan on a group of their own, so that an asynchronous save never meets training traffic.
        self._groups["checkpoint"] = dist.new_group(backend="gloo")

    def layer_partition(self, module: LightningModule) -> list[range]:
        """The layers of each stage, from ``split_points`` or balanced by ``balance``."""
        layers = list(module.pipeline_layers())
        costs = None
        if self.split_points is None and self.balance == "time":
            costs = self._measured_layer_times(module, layers)
        elif self.split_points is None and not isinstance(self.balance, str):
            costs = self.balance
        return partition_layers(layers, self.num_stages, self.split_points, costs)

    def _measured_layer_times(self, module: LightningModule, layers: list[nn.Module]) -> list[float]:
        example = getattr(module, "example_input_array", None)
        if not isinstance(example, Tensor):
            raise MisconfigurationException(
                "balance='time' times every layer on `example_input_array`, which is not set. Set "
                "`self.example_input_array` in your LightningModule to the first layer's input for one "
                "micro-batch, or use balance='parameters' or explicit `split_points`."
            )
        costs = measure_layer_times(layers, example, device=self.root_device) if self.global_rank == 0 else None
        # Every rank must cut the model the same way: rank 0's measurement decides.
        return self.broadcast(costs, src=0)

    def _place_stage(self, module: LightningModule) -> None:
        if getattr(self, "_placed_module", None) is module:
            return  # cut by an earlier fit/validate/test of this Trainer: the other stages' layers are gone
        self._placed_module = module
        layers = list(module.pipeline_layers())
        ranges = self.layer_partition(module)
        owner = [stage for stage, r in enumerate(ranges) for _ in r]
        own = ranges[self.stage]
        self._partition = ranges
        # The whole model's names and shapes (cheap on meta too): a checkpoint is checked against them.
        self._model_shapes = {n: tuple(t.shape) for n, t in module.state_dict().items()}
        # A tied copy's training state is checkpointed under the parameter's first name in the whole model (a
        # whole module, on one process, names every parameter by its first name already).
        self._parameter_aliases = parameter_aliases(module)
        self.stage_layers = own
        # Tied weights are found on the whole model, before other stages' layers are dropped.
        ties = find_ties(layers, ranges)
        groups, sources = new_tie_groups(
            ties, self.rank_of, self.data_parallel_size, self.replica, self.stage, self.process_group_backend
        )
        recomputed = select_layers(layers, self.activation_checkpointing)
        keep_only_layers(module, layers, own, owner)
        shared = parameter_slots([layers[i] for i in own])
        for index in own:
            if any(t.is_meta for t in (*layers[index].parameters(), *layers[index].buffers())):
                materialize(module, index, layers[index], self.root_device)
        retie(shared)
        self._stage_params = stage_params = dict(nn.Sequential(*(layers[i] for i in own)).named_parameters())
        broadcast_ties(ties, self.stage, stage_params, groups, sources)
        self._ties = TiedGradients(ties, self.stage, groups) if any(t.requires_grad for t in ties) else None
        self._tie_groups = (ties, groups) if ties else None
        checkpoint_layers(layers, [i for i in recomputed if i in own])
        self._localize_metrics(module)
        names = ", ".join(f"{i}:{type(layers[i]).__name__}" for i in own)
        count = sum(count_parameters(layers[i]) for i in own)
        replica = f", replica {self.replica}/{self.data_parallel_size}" if self.data_parallel_size > 1 else ""
        log.info(
            f"[rank {self.global_rank}] pipeline stage {self.stage}/{self.num_stages}{replica}: layers {names} "
            f"({count:,} parameters)"
        )
        self._stage_modules = [layers[i] for i in own]
        leftover = [name for name, t in (*module.named_parameters(), *module.named_buffers()) if t.is_meta]
        if leftover:
            raise MisconfigurationException(
                f"{type(module).__name__} has parameters or buffers outside of `pipeline_layers()` that are still on "
                f"the meta device: {leftover[:5]}. Every parameter must belong to exactly one pipeline layer; a "
                "buffer outside the layers must be created by the LightningModule's own code (then it is not put "
                "on the meta device), not by a submodule."
            )

    def _check_tied_updates(self) -> None:
        if self._tie_groups is None or len(self.optimizers) != 1:
            return  # no ties; or a wrong optimizer count, which the runtime refuses with its own message
        ties, groups = self._tie_groups
        params = self._stage_params
        module_names = {id(p): n for n, p in self.lightning_module.named_parameters()}
        try:
            check_tied_updates(
                ties,
                self.stage,
                params,
                self.optimizers[0].param_groups,
                groups,
                display=lambda name: module_names.get(id(params[name]), name),
            )
        except ValueError as error:
            raise MisconfigurationException(str(error)) from None

    def _localize_metrics(self, module: LightningModule) -> None:
        """Metrics are updated on the last stages only: they sync across the replicas of the last stage,
        never across all ranks (the other stages would never join)."""
        from torchmetrics import Metric

        replicated = self.data_parallel_size > 1
        for metric in module.modules():
            if isinstance(metric, Metric):
                if replicated:
                    metric.process_group = self._groups["data"]
                else:
                    metric.distributed_available_fn = lambda: False

    def _build_runtime(self, trainer: Trainer) -> StageRuntime:
        if trainer.gradient_clip_algorithm not in (None, "norm"):
            raise MisconfigurationException(
                f"AsyncPipelineStrategy clips by the global gradient norm only; got gradient_clip_algorithm="
                f"{trainer.gradient_clip_algorithm!r}. Set it to 'norm'."
            )
        if len(self.optimizers) != 1:
            raise MisconfigurationException(
                f"AsyncPipelineStrategy needs exactly one optimizer, got {len(self.optimizers)}. Return one "
                "optimizer from `configure_optimizers` (Muon and DelayCorrected are single optimizers)."
            )
        module = self.lightning_module
        stage, last = self.stage, self.num_stages - 1
        runtime = StageRuntime(
            kind=self.schedule,
            stage=stage,
            num_stages=self.num_stages,
            num_microbatches=self.num_microbatches,
            layers=self._stage_modules,
            optimizer=self.optimizers[0],
            inputs_fn=lambda mb: module.pipeline_inputs(mb),
            loss_fn=lambda out, mb: module.pipeline_loss(out, mb),
            device=self.root_device,
            prev_rank=self.rank_of(stage - 1) if stage > 0 else None,
            next_rank=self.rank_of(stage + 1) if stage < last else None,
            check_finite=True,
            clip_grad_norm=trainer.gradient_clip_val or None,
            norm_group=self._groups["norm"],
            p2p_group=self._groups["p2p"],
            data_group=self._groups["data"] if self.data_parallel_size > 1 else None,
            forward_context=self.precision_plugin.forward_context,
            trace=self.trace_dir is not None,
            before_update=before_optimizer_step(trainer, self.optimizers[0]),
            ties=self._ties,
        )
        self._runtime = runtime
        return runtime

    def _runtime_to_module_names(self) -> dict[str, str]:
        """Runtime parameter names (``"0.attn.qkv.weight"``) to the LightningModule's (``"layers.1.attn..."``)."""
        assert self._runtime is not None
        module_names = {id(p): n for n, p in self.lightning_module.named_parameters()}
        return {n: module_names[id(p)] for n, p in self._runtime.params.items()}

    # --- the training step ---------------------------------------------------------------------------

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        batch = kwargs["batch"] if "batch" in kwargs else args[0]
        if self.auto_microbatches:
            self._choose_num_microbatches(batch)
        if self._runtime is not None:
            loss, stats = self._runtime.run_step(self.lightning_module.trainer.global_step, batch)
            self._steps_run += 1
            if loss is not None:
                if self.data_parallel_size > 1:  # the loss of the global batch: mean over the replicas
                    dist.all_reduce(loss, group=self._groups["data"])
                    loss /= self.data_parallel_size
                # A device tensor: loggers read it every `log_every_n_steps`. The progress bar would read it
                # every step, a host-device synchronization per step, so it shows the loss on CPU only.
                on_cpu = loss.device.type == "cpu"
                module.log("train/loss", loss, prog_bar=on_cpu, on_step=True, on_epoch=False)
            if self._stage_stats is not None:
                self._stage_stats.report(stats, module.trainer)
            # The gradients are already in place; `backward` skips this detached value. Only the last
            # stage (rank 0) knows the loss.
            if loss is None:
                if self._no_loss is None:
                    self._no_loss = torch.full((), float("nan"), device=self.root_device)
                loss = self._no_loss
            return loss
        if not is_pipeline_module(module):
            return super().training_step(*args, **kwargs)
        with self.precision_plugin.train_step_context():
            self._microbatch_losses = self._microbatch_forward(module, batch)
        losses = torch.stack([loss.detach() for loss in self._microbatch_losses])
        check_finite_losses(losses, module.trainer.global_step, stage=0)
        loss = torch.stack(self._microbatch_losses).mean()
        module.log("train/loss", loss.detach(), prog_bar=True, on_step=True, on_epoch=False)
        return loss

    def _choose_num_microbatches(self, batch: Any) -> None:
        """``num_microbatches="auto"``: the smallest valid number for this batch size, once, on every rank alike."""
        size = batch_size_of(batch)
        count = auto_num_microbatches(size, self.num_stages)
        self.auto_microbatches = False
        self.num_microbatches = count
        if self._runtime is not None:
            self._runtime.num_microbatches = count
        if self.is_global_zero:
            log.info(
                f"num_microbatches='auto': {count} micro-batches of {size // count} samples, the smallest number that "
                f"is at least the {self.num_stages} pipeline stage(s) and divides the batch size {size}"
            )

    def _microbatch_forward(self, module: LightningModule, batch: Any) -> list[Tensor]:
        layers = module.pipeline_layers()
        microbatches = split_microbatches(batch, self.num_microbatches)
        return [module.pipeline_loss(run_layers(layers, module.pipeline_inputs(mb), mb), mb) for mb in microbatches]

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        if self._runtime is not None:
            return closure_loss
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
        if self._runtime is not None:
            # The stage runtime applies its updates itself, on its own clock, inside the step.
            return closure()
        if self.schedule == "2bw":
            closure = self._delayed_weights().wrap_closure(closure)
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    def _delayed_weights(self) -> DelayedWeights:
        if self._delayed is None:
            assert self.lightning_module is not None
            self._delayed = DelayedWeights(self.lightning_module)
        return self._delayed

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not trainer.training or isinstance(dataloader, ResumableLoader):
            return dataloader
        dataloader = same_order_loader(dataloader, self._data_seed, self.data_parallel_size, self.replica)
        # A resumed run continues mid-epoch exactly where the checkpoint was taken.
        progress = trainer.fit_loop.epoch_loop.batch_progress
        return ResumableLoader(dataloader, lambda: progress.current.completed)

    # --- flushes: validation, checkpoints, the end of training ---------------------------------------

    def flush(self) -> None:
        """Finish all in-flight micro-batches and apply pending updates (no-op on one device)."""
        if self._runtime is not None:
            self._runtime.drain()

    @override
    def on_validation_start(self) -> None:
        self.flush()
        super().on_validation_start()

    @override
    def on_train_end(self) -> None:
        self.flush()
        if self._stage_stats is not None:
            remaining = self._runtime.take_stats() if self._runtime is not None else []
            self._stage_stats.finish(remaining, self.lightning_module.trainer)
        self._write_trace()
        super().on_train_end()

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self.multi_process:
            return super().validation_step(*args, **kwargs)
        return self._stage_evaluation_step("validation", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self.multi_process:
            return super().test_step(*args, **kwargs)
        return self._stage_evaluation_step("test", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self.multi_process:
            return super().predict_step(*args, **kwargs)
        return self._stage_evaluation_step("predict", args, kwargs)

    def _stage_evaluation_step(self, kind: str, args: tuple, kwargs: dict) -> Any:
        # The batch goes through the stages; the last stage hands the output to the module's
        # `pipeline_{kind}_step` and returns what it returns, the other stages return None.
        batch = kwargs["batch"] if "batch" in kwargs else args[0]
        batch_idx = kwargs.get("batch_idx", args[1] if len(args) > 1 else 0)
        runtime = self._runtime or self._evaluation_runtime()
        output = runtime.evaluate(batch)
        if output is None:
            return None
        return pipeline_evaluation_step(self.lightning_module, kind, output, batch, batch_idx)

    def _evaluation_runtime(self) -> StageRuntime:
        # Validation or testing outside of fit: a runtime without optimizer, used only for forwards.
        stage, last = self.stage, self.num_stages - 1
        module = self.lightning_module
        self._runtime = StageRuntime(
            kind="1f1b",
            stage=stage,
            num_stages=self.num_stages,
            num_microbatches=1,
            layers=self._stage_modules,
            optimizer=torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0),
            inputs_fn=lambda mb: module.pipeline_inputs(mb),
            loss_fn=lambda out, mb: module.pipeline_loss(out, mb),
            device=self.root_device,
            prev_rank=self.rank_of(stage - 1) if stage > 0 else None,
            next_rank=self.rank_of(stage + 1) if stage < last else None,
            p2p_group=self._groups["p2p"],
            forward_context=self.precision_plugin.forward_context,
        )
        return self._runtime

    def _write_trace(self) -> None:
        """Gather every stage's action timings on rank 0 into one Chrome trace (one row per stage)."""
        if self.trace_dir is None or self._runtime is None:
            return
        gathered = self.gather_stages((self.stage, self._runtime.events))
        if gathered is None:
            return
        path = write_chrome_trace(gathered, self.trace_dir)
        log.info(f"Pipeline trace written to {path} (open it in chrome://tracing or ui.perfetto.dev)")

    # --- checkpoints ---------------------------------------------------------------------------------

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        # A checkpoint holds settled weights: every started micro-batch finished, every update applied.
        self.flush()
        return super().lightning_module_state_dict()

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Each stage reads its own layers' tensors into the placed (materialised) stage, its optimizer and
        # runtime already built.
        return True

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        io = self._checkpoint_io
        if isinstance(io, _WrappingCheckpointIO):
            if not isinstance(io.checkpoint_io, ShardedCheckpointIO):
                io._checkpoint_io = ShardedCheckpointIO(metadata_io=io.checkpoint_io)
                io._base_checkpoint_io_configured = True
        elif not isinstance(io, ShardedCheckpointIO):
            self._checkpoint_io = io = ShardedCheckpointIO(metadata_io=io)
        return io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        self._checkpoint_io = io

    def _sharded_io(self) -> ShardedCheckpointIO:
        io = self.checkpoint_io
        return io.checkpoint_io if isinstance(io, _WrappingCheckpointIO) else io

    def _previous_weights(self) -> dict[str, Tensor] | None:
        """``w[t-1]`` of this stage's trainable parameters, keyed like the module's parameters (2BW only)."""
        if self._runtime is not None and self._runtime.num_buffers == 2:
            names = self._runtime_to_module_names()
            return {names[n]: t for n, t in self._runtime.previous_weights().items()}
        if self._runtime is None and self.schedule == "2bw" and self.optimizers:
            delayed = self._delayed_weights()  # before the first step: w[-1] = w[0]
            return dict(zip(delayed.names, delayed.previous))
        return None

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write a checkpoint directory: each stage its own shard (replica 0 of each stage), rank 0 the metadata.

        Every rank calls this (Lightning's ``trainer.save_checkpoint`` and ``ModelCheckpoint`` do).
        """
        training_state = "optimizer_states" in checkpoint and bool(self.optimizers)
        shard: dict[str, Any] = {}
        if self.replica == 0:
            shard = stage_shard(
                checkpoint["state_dict"],
                self.optimizers[0] if training_state else None,
                self.lightning_module,
                self._previous_weights() if training_state else None,
                self.stage if self.multi_process else 0,
                aliases=self._parameter_aliases,
            )
        meta = None
        if self.is_global_zero:
            meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
            version = self._runtime.newest_version if self._runtime is not None else checkpoint.get("global_step", 0)
            partition = self._partition
            if partition is None and is_pipeline_module(self.lightning_module):
                partition = [range(len(list(self.lightning_module.pipeline_layers())))]
            meta[CHECKPOINT_KEY] = {
                "format": FORMAT_VERSION,
                "schedule": self.schedule,
                "num_stages": self.num_stages,
                "data_parallel_size": self.data_parallel_size,
                "num_microbatches": self.num_microbatches,
                "partition": [[r.start, r.stop] for r in partition] if partition is not None else None,
                "version": version,
                "has_training_state": training_state,
            }
        payload = {SHARD_KEY: True, "shard": shard, "meta": meta}
        self.checkpoint_io.save_checkpoint(payload, filepath, storage_options=storage_options)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if not self.is_global_zero:
            return
        io = self.checkpoint_io
        executor = getattr(io, "_executor", None)  # Lightning's AsyncCheckpointIO
        if isinstance(io, _WrappingCheckpointIO) and executor is not None:
            # Queued behind the saves already submitted, one of which may be writing this very checkpoint.
            executor.submit(io.checkpoint_io.remove_checkpoint, filepath)
        else:
            io.remove_checkpoint(filepath)

    @override
    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Read Lightning's metadata and, in place, this stage's tensors, from any stage count it was saved with."""
        self._restored_sharded = False
        if not is_sharded_checkpoint(checkpoint_path):
            return self.checkpoint_io.load_checkpoint(checkpoint_path)  # a single-file (consolidated) checkpoint
        path = checkpoint_path
        meta = self.checkpoint_io.load_checkpoint(path)
        info = meta.get(CHECKPOINT_KEY, {})
        index = read_index(path)
        module = self.lightning_module
        shapes = (
            self._model_shapes if self.multi_process else {n: tuple(t.shape) for n, t in module.state_dict().items()}
        )
        check_compatible(path, info, index, self.schedule, shapes)
        trainer = module.trainer
        fitting = trainer.state.fn == TrainerFn.FITTING and bool(self.optimizers) and info.get("has_training_state")
        if fitting and self._runtime is not None:
            self._runtime.restore_version(info["version"])
        load_stage(
            path,
            index,
            state_dict=module.state_dict(),
            module=module,
            optimizer=self.optimizers[0] if fitting else None,
            previous=self._previous_weights() if fitting else None,
            stage=self.stage if self.multi_process else 0,
            process_group=self._groups.get("checkpoint") if self.multi_process else None,
            aliases=self._parameter_aliases,
        )
        if fitting:
            align_lr_schedulers(meta.get("lr_schedulers", []), self.optimizers)
        if info.get("has_training_state"):
            meta["optimizer_states"] = []  # restored above; Lightning only checks that they exist
        self._restored_sharded = True
        return meta

    @override
    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        if not self._restored_sharded:
            super().load_model_state_dict(checkpoint, strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        if not self._restored_sharded:
            super().load_optimizer_state_dict(checkpoint)

    def gather_stages(self, obj: Any) -> list[Any] | None:
        """Collect ``obj`` from every stage of replica 0 on global rank 0, in stage order (a collective: every
        rank calls it). Replicas hold identical stages. Returns ``None`` on the other ranks."""
        gathered = [None] * self.num_workers if self.is_global_zero else None
        dist.gather_object(obj, gathered, dst=0)
        if not self.is_global_zero:
            return None
        return [gathered[self.rank_of(stage, 0)] for stage in range(self.num_stages)]

    def full_state_dict(self) -> dict[str, Any] | None:
        """The whole model's state dict on global rank 0 (a collective), ``None`` elsewhere."""
        if not self.multi_process:
            return self.lightning_module.state_dict()
        parts = self.gather_stages(self.lightning_module.state_dict())
        return None if parts is None else {k: v for part in parts for k, v in part.items()}

    # --- collectives ---------------------------------------------------------------------------------

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        """Reduce over ``group``; by default over the replicas of this process's stage.

        ``self.log(..., sync_dist=True)`` calls this on the ranks that log, which in a pipeline are the last
        stages only: a reduction over all ranks would wait forever for the other stages.
        """
        if not isinstance(tensor, Tensor) or not _distributed_is_initialized():
            return tensor
        if group is None and self.multi_process:
            if self.data_parallel_size == 1:
                return tensor
            group = getattr(self, "_groups", {}).get("data")
        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """``all``/``any`` of ``decision`` over the last stages, which hold the metrics callbacks decide on; the
        other stages (holding relayed copies) join the collective without a vote."""
        if not self.multi_process or not _distributed_is_initialized():
            return decision
        return reduce_decision(decision, all, votes=self.stage == self.num_stages - 1, device=self.root_device)

    @override
    def barrier(self, name: str | None = None) -> None:
        if _distributed_is_initialized():
            distributed_barrier(self.root_device)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src)
        return holder[0]

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        if not _distributed_is_initialized():
            return tensor
        from lightning.fabric.utilities.distributed import _all_gather_ddp_if_available

        return _all_gather_ddp_if_available(tensor, group=group, sync_grads=sync_grads)

    @override
    def teardown(self) -> None:
        # The (drained) runtime and the delayed weights stay, so that `trainer.save_checkpoint` after `fit`
        # still records both weight versions.
        self.flush()
        super().teardown()


class _SpawnLauncher(_MultiProcessingLauncher):
    """Spawn launcher that hands the *whole* trained model back to the main process, not only rank 0's stage."""

    @override
    def _collect_rank_zero_results(self, trainer: Trainer, results: Any) -> Any:
        full = self._strategy.full_state_dict()  # every rank takes part
        output = super()._collect_rank_zero_results(trainer, results)
        if output is not None and output.weights_path is not None:
            self._strategy.checkpoint_io.save_checkpoint(full, output.weights_path)
        return output
