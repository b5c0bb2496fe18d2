"""Process-group setup: the rendezvous store stays on loopback on one node; barriers and init are NCCL-ready."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from lightning_async_pp.strategy.topology import is_loopback
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
        init_process_group("gloo", 0, 1, "127.0.0.1", port, timeout, torch.device("cpu"))
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


TORCHRUN_PROBE = textwrap.dedent(
    """
    import datetime, os, torch, torch.distributed as dist
    from lightning_async_pp.strategy.topology import barrier, init_process_group
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    init_process_group("gloo", rank, world, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                       datetime.timedelta(seconds=60), torch.device("cpu"))
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
    init_process_group("gloo", 0, 1, "127.0.0.1", int(sys.argv[1]), datetime.timedelta(seconds=60), torch.device("cpu"))
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
