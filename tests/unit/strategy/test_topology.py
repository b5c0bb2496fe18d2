"""Process-group setup: the rendezvous store stays on loopback on one node; barriers and init are NCCL-ready."""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import textwrap
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_async_pp.strategy import topology
from lightning_async_pp.strategy.topology import (
    is_loopback,
    loopback_interface,
    loopback_store,
    rendezvous_host,
    socket_interfaces,
)
from tests.fixtures.helpers import run_group

PROBE = textwrap.dedent(
    """
    import datetime, sys, torch, torch.distributed as dist
    from lightning_async_pp.strategy.topology import barrier, init_process_group
    port, plain = int(sys.argv[1]), sys.argv[2] == "plain"
    timeout = datetime.timedelta(seconds=60)
    if plain:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=timeout)
    else:
        init_process_group("gloo", 0, 1, "127.0.0.1", port, timeout, torch.device("cpu"), 1)
    barrier(torch.device("cpu"))
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:
                listening.append(address)
    print("LISTENING", listening)
    dist.destroy_process_group()
    """
)
LOOPBACK = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1 as /proc/net/tcp writes them


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening_addresses(mode: str) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, str(free_port()), mode], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(x for x in result.stdout.splitlines() if x.startswith("LISTENING"))
    return eval(line.removeprefix("LISTENING "))


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/net/tcp")
def test_rendezvous_store_listens_on_loopback_only():
    addresses = listening_addresses("ours")
    assert addresses and set(addresses) <= LOOPBACK, addresses
    # What torch does on its own with the same MASTER_ADDR: it listens on every interface.
    assert not set(listening_addresses("plain")) <= LOOPBACK


def test_is_loopback():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1") and is_loopback("127.0.1.1")
    assert not is_loopback("10.0.0.1") and not is_loopback("node-17")


@pytest.mark.parametrize(
    ("address", "num_nodes", "host"),
    [
        ("127.0.0.1", 1, "127.0.0.1"),
        ("localhost", 1, "127.0.0.1"),
        ("::1", 1, "::1"),
        ("node-17", 1, "127.0.0.1"),  # SLURM's MASTER_ADDR is the first node's host name
        ("10.0.0.1", 1, "127.0.0.1"),
        ("node-17", 2, None),  # other machines must reach it
        ("10.0.0.1", 4, None),
        ("127.0.0.1", 2, "127.0.0.1"),
    ],
)
def test_a_one_node_store_listens_on_loopback_whatever_master_addr_says(address, num_nodes, host):
    assert rendezvous_host(address, num_nodes) == host


def ipv4_address(interface: str) -> str:
    """The IPv4 address ``interface`` holds, as the kernel says (Linux's SIOCGIFADDR)."""
    import fcntl  # POSIX only

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", interface.encode()[:15]))
    return socket.inet_ntoa(packed[20:24])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="asks the kernel with a Linux ioctl")
def test_the_loopback_interface_is_the_one_holding_127_0_0_1():
    name = loopback_interface()
    assert name is not None and ipv4_address(name) == "127.0.0.1"


def test_socket_interfaces_are_set_on_one_node_only_and_never_over_the_user(monkeypatch):
    monkeypatch.setattr(topology, "loopback_interface", lambda: "lo9")
    both = {"GLOO_SOCKET_IFNAME": "lo9", "NCCL_SOCKET_IFNAME": "lo9"}
    assert socket_interfaces(1, {}) == both
    assert socket_interfaces(1, {"GLOO_SOCKET_IFNAME": ""}) == both
    assert socket_interfaces(1, {"NCCL_SOCKET_IFNAME": "ib0"}) == {"GLOO_SOCKET_IFNAME": "lo9"}
    assert socket_interfaces(1, {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "ib0"}) == {}
    assert socket_interfaces(2, {}) == {}
    monkeypatch.setattr(topology, "loopback_interface", lambda: None)
    assert socket_interfaces(1, {}) == {}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/net/tcp")
def test_the_store_of_a_one_node_job_listens_on_loopback_only():
    """The store rank 0 creates for a one-node job whose MASTER_ADDR is a host name (as under SLURM)."""
    host = rendezvous_host(socket.gethostname(), 1)
    store = loopback_store(host, 0, 0, 1, timedelta(seconds=10))
    store.set("k", "v")
    assert listeners(store.port) == ["0100007F"]
    # What torch does with the same address: every interface.
    plain = dist.TCPStore(host, 0, 1, True, wait_for_workers=False)
    assert listeners(plain.port) and not set(listeners(plain.port)) <= LOOPBACK


def listeners(port: int) -> list[str]:
    """The local addresses listening on ``port``, as /proc/net/tcp writes them."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].rsplit(":", 1)
            if fields[3] == "0A" and int(hex_port, 16) == port:
                found.append(address)
    return found


TORCHRUN_PROBE = textwrap.dedent(
    """
    import datetime, os, torch, torch.distributed as dist
    from lightning_async_pp.strategy.topology import barrier, init_process_group
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    init_process_group("gloo", rank, world, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                       datetime.timedelta(seconds=60), torch.device("cpu"), 1)
    total = torch.tensor([rank + 1])
    dist.all_reduce(total)
    barrier(torch.device("cpu"))
    open(os.environ["PROBE_OUT"] + str(rank), "w").write(str(int(total)))
    dist.destroy_process_group()
    """
)


@pytest.mark.multiprocess
def test_torchrun_workers_join_the_agents_store(tmp_path):
    """torchrun's agent already serves MASTER_PORT: the workers must join its store, not bind their own."""
    script = tmp_path / "probe.py"
    script.write_text(TORCHRUN_PROBE)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc-per-node=2",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        str(script),
    ]
    env = dict(os.environ, PROBE_OUT=str(tmp_path / "sum"))
    result = run_group(command, 120, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [(tmp_path / f"sum{rank}").read_text() for rank in (0, 1)] == ["3", "3"]


GROUP_TIMEOUT_PROBE = textwrap.dedent(
    """
    import datetime, json, sys, torch, torch.distributed as dist
    from lightning_async_pp.runtime.ties import Tie, new_tie_groups
    from lightning_async_pp.strategy.topology import PipelineDims, ProcessGroups, init_process_group
    init_process_group("gloo", 0, 1, "127.0.0.1", int(sys.argv[1]), datetime.timedelta(seconds=60), torch.device("cpu"),
                       1)
    calls, new_group = [], dist.new_group

    def recording(*args, **kwargs):
        calls.append(kwargs.get("timeout"))
        return new_group(*args, **kwargs)

    dist.new_group = recording
    timeout = datetime.timedelta(seconds=7)
    ProcessGroups(PipelineDims(1, 1), 0, "gloo", torch.device("cpu"), timeout)
    tie = Tie(names={0: "w"}, layers=(0,), shape=(1,), dtype=torch.float32, requires_grad=True)
    new_tie_groups([tie], lambda stage, replica: 0, 1, 0, 0, "gloo", timeout)
    print("TIMEOUTS", json.dumps([None if t is None else t.total_seconds() for t in calls]))
    dist.destroy_process_group()
    """
)


def test_every_process_group_gets_the_strategys_timeout():
    """A group made without `timeout=` waits torch's default (10 min on NCCL, 30 on gloo), not the strategy's."""
    result = subprocess.run(
        [sys.executable, "-c", GROUP_TIMEOUT_PROBE, str(free_port())], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(x for x in result.stdout.splitlines() if x.startswith("TIMEOUTS"))
    timeouts = json.loads(line.removeprefix("TIMEOUTS "))
    # data, p2p, norm, stats, the metrics relay's pipeline group, checkpoint; one tie group
    assert len(timeouts) >= 6, timeouts
    assert timeouts == [7.0] * len(timeouts), timeouts
