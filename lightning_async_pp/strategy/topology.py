"""Process-group setup for the strategy: NCCL-ready initialisation and a rendezvous kept on loopback.

* ``device_id`` is passed to :func:`torch.distributed.init_process_group` on NCCL, which binds the
  process to its GPU and creates communicators eagerly (no lazy creation inside the first transfer,
  where ranks that reach it at different times could hang).
* ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` is set to ``1`` unless the user set it: a NCCL operation that fails
  or runs past the strategy's ``timeout`` aborts the communicators and ends the process, so a dead or
  hung stage brings the job down within ``timeout`` instead of leaving its neighbours waiting.
* The rendezvous store (a ``TCPStore`` on ``MASTER_PORT``) listens only on the loopback interface when
  ``MASTER_ADDR`` is a loopback address (one node): the store is created here on a socket bound to that
  address. ``init_process_group`` would listen on every interface. Under torchrun the launcher's agent
  already hosts the store on ``MASTER_PORT`` (``TORCHELASTIC_USE_AGENT_STORE``) and its workers join it
  as clients, so nothing is created here. Peers exchange pickled objects through the store and the
  process groups, so a multi-node job assumes a trusted network.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["barrier", "init_process_group", "is_loopback", "launcher_hosts_store"]


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


def init_process_group(
    backend: str, rank: int, world_size: int, address: str, port: int, timeout: timedelta, device: torch.device
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
    """
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = address, str(port)
    kwargs: dict = {"backend": backend, "rank": rank, "world_size": world_size, "timeout": timeout}
    if "nccl" in backend and device.type == "cuda":
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    if is_loopback(address) and not launcher_hosts_store():
        kwargs["store"] = _loopback_store(address, port, rank, world_size, timeout)
    dist.init_process_group(**kwargs)


def _loopback_store(address: str, port: int, rank: int, world_size: int, timeout: timedelta) -> dist.TCPStore:
    host = "127.0.0.1" if address == "localhost" else address
    if rank != 0:
        return dist.TCPStore(host, port, world_size, False, timeout=timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen()
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
