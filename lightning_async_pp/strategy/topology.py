"""The processes of a job: ``P`` stages times ``D`` replicas, their ranks and process groups, and how the
default process group is initialised.

:class:`PipelineDims` maps ranks to (stage, replica): the last stages, which compute the loss, take the
lowest global ranks, replica 0's on rank 0, so Lightning logs the loss where it lives.
:class:`ProcessGroups` creates every group a stage uses, on every rank in the same order.

Initialising the default group (NCCL-ready, with a rendezvous kept on loopback):

* ``device_id`` is passed to :func:`torch.distributed.init_process_group` on NCCL, which binds the
  process to its GPU and creates communicators eagerly (no lazy creation inside the first transfer,
  where ranks that reach it at different times could hang).
* NCCL's error handling stays torch's default (``TORCH_NCCL_ASYNC_ERROR_HANDLING`` is not set here): an
  operation that runs past the strategy's ``timeout`` ends the process. A rank that fails or dies is noticed
  sooner, through the control traffic (:mod:`~lightning_async_pp.strategy.watchdog`), which aborts the
  process groups itself.
* On one node (``num_nodes == 1``) nothing listens beyond the machine: the rendezvous store (a ``TCPStore``
  on ``MASTER_PORT``) is created here on a socket bound to the loopback address, whatever ``MASTER_ADDR``
  says (a host name under SLURM, say), and every rank reaches it there; ``init_process_group`` would listen
  on every interface. gloo and NCCL open their own sockets on the interface ``GLOO_SOCKET_IFNAME`` /
  ``NCCL_SOCKET_IFNAME`` names, which are set to the loopback interface unless the user set them
  (:func:`socket_interfaces`). Under torchrun the launcher's agent already hosts the store on
  ``MASTER_PORT`` (``TORCHELASTIC_USE_AGENT_STORE``) and its workers join it as clients, so nothing is
  created here: that store listens on every interface. Across nodes the store listens on every interface
  (unless ``MASTER_ADDR`` is a loopback address), as torch's does. Peers exchange pickled objects through
  the store and the process groups, so a multi-node job assumes a trusted network.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_async_pp.strategy.metrics import MetricsRelay

__all__ = [
    "PipelineDims",
    "ProcessGroups",
    "barrier",
    "init_process_group",
    "is_loopback",
    "launcher_hosts_store",
    "loopback_interface",
    "loopback_store",
    "rendezvous_host",
    "socket_interfaces",
]

SOCKET_INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
"""Where gloo and NCCL open their sockets (an interface name)."""
_SYSFS_NET = "/sys/class/net"
_IFF_LOOPBACK = 0x8  # Linux's flag of a loopback interface (/sys/class/net/<name>/flags)


@dataclass(frozen=True)
class PipelineDims:
    """``num_stages`` stages times ``data_parallel_size`` replicas, and which global rank runs which.

    Args:
        num_stages: Pipeline depth ``P``.
        data_parallel_size: Number of pipeline replicas ``D``.
    """

    num_stages: int
    data_parallel_size: int

    @classmethod
    def for_workers(cls, num_workers: int, pipeline_parallel_size: int | None) -> PipelineDims:
        """``pipeline_parallel_size`` stages (default: one per process) and as many replicas as fit."""
        num_stages = pipeline_parallel_size or num_workers
        return cls(num_stages, max(1, num_workers // num_stages))

    @property
    def world_size(self) -> int:
        return self.num_stages * self.data_parallel_size

    def stage_of(self, rank: int) -> int:
        """The one stage global rank ``rank`` runs (:data:`~lightning_async_pp.schedule.STAGES_PER_PROCESS`)."""
        return self.num_stages - 1 - rank // self.data_parallel_size

    def replica_of(self, rank: int) -> int:
        """The replica (data-parallel rank) global rank ``rank`` belongs to."""
        return rank % self.data_parallel_size

    def rank_of(self, stage: int, replica: int) -> int:
        """The global rank of ``stage`` in ``replica``."""
        return (self.num_stages - 1 - stage) * self.data_parallel_size + replica

    def pipeline(self, replica: int) -> list[int]:
        """The global ranks of one replica's stages, first stage first."""
        return [self.rank_of(stage, replica) for stage in range(self.num_stages)]

    def replicas(self, stage: int) -> list[int]:
        """The global ranks holding ``stage``, replica 0 first."""
        return [self.rank_of(stage, replica) for replica in range(self.data_parallel_size)]


def check_process_count(num_processes: int, num_nodes: int, num_stages: int) -> None:
    """Refuse a process count that is not a whole number of pipelines."""
    num_workers = max(1, num_processes * num_nodes)
    if num_workers % num_stages != 0:
        raise MisconfigurationException(
            f"devices x num_nodes = {num_processes} x {num_nodes} = {num_workers} processes cannot "
            f"hold whole pipelines of pipeline_parallel_size={num_stages}. Use a number of processes that "
            f"is a multiple of {num_stages}, or change `pipeline_parallel_size`."
        )


class ProcessGroups:
    """The process groups of one rank. Every rank creates every group, in the same order, as torch.distributed
    requires.

    Args:
        dims: The job's stages and replicas.
        rank: This process's global rank.
        backend: Backend of the training groups (the others are gloo).
        device: This stage's device (where relayed metrics are placed).
        timeout: How long a collective or transfer on any of these groups, and the metrics relay, wait before they
            fail (the strategy's ``timeout``; a group made without one would get torch's default instead).

    Attributes:
        data: This stage's replicas, which average their gradients (and sync metrics).
        p2p: This replica's pipeline, for activations and gradients.
        norm: The same ranks as ``p2p``, for the clipping norm: gloo numbers a group's collectives with the
            tags point-to-point messages use.
        order: The same ranks as ``p2p``, for the data-order fingerprints (one message per step and link), so
            that they never queue behind activations (see :mod:`lightning_async_pp.runtime.data_order`).
        stats: Replica 0's stages (gloo), whose step statistics travel to rank 0.
        metrics: What the last stage logs, relayed to the other stages of its replica (gloo groups of their own).
        checkpoint: Every rank (gloo), so that an asynchronous save never meets training traffic.
        watchdog: Every rank (gloo), for the heartbeat of :class:`~lightning_async_pp.strategy.watchdog.PeerWatchdog`
            only (its thread's collectives never meet the main thread's).
    """

    def __init__(self, dims: PipelineDims, rank: int, backend: str | None, device: torch.device, timeout: Any) -> None:
        stage, replica = dims.stage_of(rank), dims.replica_of(rank)
        data = p2p = norm = order = None
        for s in range(dims.num_stages):
            group = dist.new_group(dims.replicas(s), backend=backend, timeout=timeout)
            if s == stage:
                data = group
        for d in range(dims.data_parallel_size):
            ranks = dims.pipeline(d)
            made = [dist.new_group(ranks, backend=backend, timeout=timeout) for _ in range(3)]
            if d == replica:
                p2p, norm, order = made
        self.data: dist.ProcessGroup = data
        self.p2p: dist.ProcessGroup = p2p
        self.norm: dist.ProcessGroup = norm
        self.order: dist.ProcessGroup = order
        self.stats: dist.ProcessGroup = dist.new_group(dims.pipeline(0), backend="gloo", timeout=timeout)
        pipelines = [dims.pipeline(d) for d in range(dims.data_parallel_size)]
        self.metrics: MetricsRelay = MetricsRelay.for_pipelines(pipelines, rank, device, timeout)
        self.checkpoint: dist.ProcessGroup = dist.new_group(backend="gloo", timeout=timeout)
        self.watchdog: dist.ProcessGroup = dist.new_group(backend="gloo", timeout=timeout)


def is_loopback(address: str) -> bool:
    """Whether ``address`` (a host name or IP) names this machine's loopback interface."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def launcher_hosts_store() -> bool:
    """Whether the launcher (torchrun's elastic agent) already serves the rendezvous store on ``MASTER_PORT``."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() in ("1", "true")


def rendezvous_host(address: str, num_nodes: int) -> str | None:
    """The loopback address rank 0's rendezvous store listens on (and the other ranks reach it at), or ``None``
    where the store must be reachable from other machines (torch then listens on every interface).

    Args:
        address: ``MASTER_ADDR``.
        num_nodes: Machines of the job (``Trainer(num_nodes=...)``).
    """
    if is_loopback(address):
        return "127.0.0.1" if address == "localhost" else address
    return "127.0.0.1" if num_nodes == 1 else None


def loopback_interface() -> str | None:
    """The name of this machine's loopback interface (``lo`` on Linux, ``lo0`` on macOS), ``None`` if none is
    found."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    if os.path.isdir(_SYSFS_NET):  # Linux: the interface flagged loopback, whatever its name
        for name in names:
            try:
                if int(Path(_SYSFS_NET, name, "flags").read_text(), 16) & _IFF_LOOPBACK:
                    return name
            except (OSError, ValueError):
                continue
        return None
    return next((name for name in names if name in ("lo0", "lo")), None)


def socket_interfaces(num_nodes: int, environ: Mapping[str, str]) -> dict[str, str]:
    """The socket interfaces to set for gloo and NCCL: the loopback interface on one node, for each variable the
    user left unset (:data:`SOCKET_INTERFACE_VARIABLES`); nothing across nodes.

    Args:
        num_nodes: Machines of the job.
        environ: The process's environment.
    """
    if num_nodes != 1:
        return {}
    name = loopback_interface()
    if name is None:
        return {}
    return {variable: name for variable in SOCKET_INTERFACE_VARIABLES if not environ.get(variable)}


def init_process_group(
    backend: str,
    rank: int,
    world_size: int,
    address: str,
    port: int,
    timeout: timedelta,
    device: torch.device,
    num_nodes: int,
) -> None:
    """Initialise the default process group (see the module docstring for what differs from a plain call).

    Args:
        backend: ``"nccl"``, ``"gloo"``, ...
        rank: Global rank of this process.
        world_size: Number of processes.
        address: ``MASTER_ADDR``: where rank 0 listens for the rendezvous.
        port: ``MASTER_PORT``.
        timeout: How long collectives and transfers may take before the job is brought down.
        device: This process's device (``device_id`` on NCCL).
        num_nodes: Machines of the job: with one, nothing listens beyond the loopback interface.
    """
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = address, str(port)
    # Read by gloo when it creates a group's device and by NCCL at its first communicator: set before either.
    os.environ.update(socket_interfaces(num_nodes, os.environ))
    kwargs: dict = {"backend": backend, "rank": rank, "world_size": world_size, "timeout": timeout}
    if "nccl" in backend and device.type == "cuda":
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    host = rendezvous_host(address, num_nodes)
    if host is not None and not launcher_hosts_store():
        kwargs["store"] = loopback_store(host, port, rank, world_size, timeout)
    dist.init_process_group(**kwargs)


def loopback_store(host: str, port: int, rank: int, world_size: int, timeout: timedelta) -> dist.TCPStore:
    """The rendezvous store at ``host:port``: on rank 0 its server, on a socket bound to ``host`` only (port 0:
    any free port), elsewhere a client.

    Args:
        host: A loopback address (:func:`rendezvous_host`).
        port: ``MASTER_PORT``.
        rank: Global rank of this process.
        world_size: Number of processes.
        timeout: How long a client waits for the server, and a request for its answer.
    """
    if rank != 0:
        return dist.TCPStore(host, port, world_size, False, timeout=timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen()
    port = listener.getsockname()[1]
    # `detach`: the store's server owns the socket from now on (Python must not close it).
    return dist.TCPStore(
        host, port, world_size, True, timeout=timeout, wait_for_workers=False, master_listen_fd=listener.detach()
    )


def barrier(device: torch.device) -> None:
    """A barrier on the default group; on NCCL it names this process's GPU (``device_ids``), as NCCL needs."""
    if dist.get_backend() == "nccl" and device.type == "cuda":
        dist.barrier(device_ids=[device.index if device.index is not None else torch.cuda.current_device()])
    else:
        dist.barrier()
