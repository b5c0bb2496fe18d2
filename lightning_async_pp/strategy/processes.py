"""``PipelineProcesses``: a ``ParallelStrategy`` whose processes form ``P`` stages times ``D`` replicas.

It maps ranks to stages and replicas (:class:`~lightning_async_pp.strategy.topology.PipelineDims`), joins the
default process group, and implements Lightning's collectives so that each involves only the ranks it
concerns: a metric reduced on the last stages never waits for the other stages.
:class:`~lightning_async_pp.strategy.strategy.AsyncPipelineStrategy` builds on it.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.fabric.utilities.distributed import (
    ReduceOp,
    _all_gather_ddp_if_available,
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor
from typing_extensions import override

from lightning_async_pp.strategy.device_sync import warn_unsafe_device_settings
from lightning_async_pp.strategy.metrics import reduce_decision
from lightning_async_pp.strategy.rendezvous import join_job, waiting_message
from lightning_async_pp.strategy.topology import PipelineDims, ProcessGroups, init_process_group
from lightning_async_pp.strategy.topology import barrier as distributed_barrier

__all__ = ["PipelineProcesses"]


class PipelineProcesses(ParallelStrategy):
    """The processes of a pipeline-parallel job: ``devices * num_nodes`` ranks as ``P`` stages times ``D`` replicas.

    The last stages (which have the loss) take the lowest global ranks, replica 0's on rank 0.

    Args:
        accelerator: Set by the ``Trainer``.
        parallel_devices: Set by the ``Trainer``.
        cluster_environment: Set by the ``Trainer``.
        checkpoint_io: Checkpoint plugin.
        precision_plugin: Set by the ``Trainer``.
        pipeline_parallel_size: Stages per pipeline ``P``; ``None``: one stage per process.
        process_group_backend: ``torch.distributed`` backend (default: NCCL on GPUs, gloo on CPUs).
        timeout: How long a process waits for a transfer or collective before it gives up.
    """

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        pipeline_parallel_size: int | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta = timedelta(minutes=5),
    ) -> None:
        super().__init__(accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin)
        self.pipeline_parallel_size = pipeline_parallel_size
        self.process_group_backend = process_group_backend
        self.timeout = timeout
        self._num_nodes = 1
        self._groups: ProcessGroups | None = None

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
    def dims(self) -> PipelineDims:
        """The job's ``P`` stages times ``D`` replicas, and which rank runs which."""
        return PipelineDims.for_workers(self.num_workers, self.pipeline_parallel_size)

    @property
    def num_stages(self) -> int:
        """Pipeline depth ``P``: ``pipeline_parallel_size``, or one stage per process."""
        return self.dims.num_stages

    @property
    def data_parallel_size(self) -> int:
        """Number of pipeline replicas ``D``, each reading its own shard of the data."""
        return self.dims.data_parallel_size

    @property
    def multi_process(self) -> bool:
        return self.num_workers > 1

    @property
    def replica(self) -> int:
        """This process's pipeline replica (data-parallel rank)."""
        return self.dims.replica_of(self.global_rank)

    @property
    def stage(self) -> int:
        """This process's stage. Last stages (which have the loss) take the lowest global ranks, replica 0's
        on rank 0, so Lightning logs the loss where it lives."""
        return self.dims.stage_of(self.global_rank)

    def rank_of(self, stage: int, replica: int | None = None) -> int:
        """Global rank of ``stage`` in ``replica`` (default: this process's replica)."""
        return self.dims.rank_of(stage, self.replica if replica is None else replica)

    @property
    def is_distributed(self) -> bool:
        # The stages of one pipeline read the same batches; only replicas need a DistributedSampler.
        return self.data_parallel_size > 1

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self.multi_process:
            self._connect()

    def _connect(self) -> None:
        # Each process sets its global rank and the world size, then joins the default process group.
        reset_seed()
        env = self.cluster_environment
        assert env is not None
        env.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
        env.set_world_size(self.num_workers)
        rank_zero_only.rank = self.global_rank
        backend = self.process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self.process_group_backend = backend
        warn_unsafe_device_settings(backend, self.multi_process)
        if not _distributed_is_initialized():
            join_job(
                lambda: init_process_group(
                    backend,
                    env.global_rank(),
                    env.world_size(),
                    env.main_address,
                    env.main_port,
                    self.timeout,
                    self.root_device,
                    self.num_nodes,
                ),
                waiting_message(
                    env.world_size(),
                    self.num_nodes,
                    self.num_processes,
                    self.node_rank,
                    env.main_address,
                    env.main_port,
                ),
                self.timeout,
                announce=self.local_rank == 0,
            )

    @property
    def process_groups(self) -> ProcessGroups | None:
        """This rank's process groups, once :meth:`create_process_groups` made them (several processes only)."""
        return self._groups

    def create_process_groups(self) -> ProcessGroups:
        """Create this rank's process groups (a collective: every rank, in ``setup``) and keep them."""
        self._groups = ProcessGroups(
            self.dims, self.global_rank, self.process_group_backend, self.root_device, self.timeout
        )
        return self._groups

    def gather_stages(self, obj: Any) -> list[Any] | None:
        """Collect ``obj`` from every stage of replica 0 on global rank 0, in stage order (a collective: every
        rank calls it), its tensors moved to the CPU. Replicas hold identical stages. Returns ``None`` on the
        other ranks."""
        gathered = [None] * self.num_workers if self.is_global_zero else None
        # A pickled CUDA tensor is rebuilt on the sender's device index: on rank 0 that would allocate on
        # every other stage's GPU (and open a CUDA context there). Tensors travel as CPU tensors.
        dist.gather_object(move_data_to_device(obj, "cpu"), gathered, dst=0)
        if not self.is_global_zero:
            return None
        return [gathered[self.rank_of(stage, 0)] for stage in range(self.num_stages)]

    def full_state_dict(self) -> dict[str, Any] | None:
        """The whole model's state dict on global rank 0 (a collective), ``None`` elsewhere."""
        if not self.multi_process:
            return self.lightning_module.state_dict()
        parts = self.gather_stages(self.lightning_module.state_dict())
        return None if parts is None else {k: v for part in parts for k, v in part.items()}

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
            group = self._groups.data if self._groups is not None else None
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
        # Through the host: a pickled CUDA tensor would arrive on the sender's device index.
        holder = [move_data_to_device(obj, "cpu")]
        dist.broadcast_object_list(holder, src)
        return move_data_to_device(holder[0], self.root_device)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        if not _distributed_is_initialized():
            return tensor
        return _all_gather_ddp_if_available(tensor, group=group, sync_grads=sync_grads)
