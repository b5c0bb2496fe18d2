"""No host-device synchronization in the steady state: a real 3-stage gloo pipeline counts the calls that
would make the host wait for a GPU (reading a tensor's value on the host) during each step."""

from __future__ import annotations

import contextlib
import datetime
import json
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lightning_async_pp.runtime.stage import StageRuntime

pytestmark = pytest.mark.multiprocess

# On a CUDA tensor each of these copies to the host and waits for the device. (`Tensor.numpy` is refused
# for device tensors, so the runtime may read host memory with it.)
SYNCING = ("item", "cpu", "tolist", "__bool__", "__float__", "__int__", "__index__")
STEPS, STEADY_FROM = 6, 2


@contextlib.contextmanager
def count_syncs(counter: dict):
    saved = {name: getattr(torch.Tensor, name) for name in SYNCING}

    def wrap(name, fn):
        def counted(self, *args, **kwargs):
            counter[name] = counter.get(name, 0) + 1
            return fn(self, *args, **kwargs)

        return counted

    for name, fn in saved.items():
        setattr(torch.Tensor, name, wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def _stage(rank: int, world: int, init_file: str, kind: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    p2p, norm = dist.new_group(backend="gloo"), dist.new_group(backend="gloo")
    torch.manual_seed(rank)
    layer = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    runtime = StageRuntime(
        kind=kind,
        stage=rank,
        num_stages=world,
        num_microbatches=4,
        layers=[layer],
        optimizer=torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9),
        inputs_fn=lambda mb: mb,
        loss_fn=lambda output, mb: (output - mb).pow(2).mean(),
        device=torch.device("cpu"),
        prev_rank=rank - 1 if rank > 0 else None,
        next_rank=rank + 1 if rank < world - 1 else None,
        clip_grad_norm=1.0,
        norm_group=norm,
        p2p_group=p2p,
    )
    generator = torch.Generator().manual_seed(0)
    counts = []
    for step in range(STEPS):
        batch = torch.randn(16, 8, generator=generator)
        counter: dict = {}
        with count_syncs(counter):
            loss, _ = runtime.run_step(step, batch)
            if loss is not None:
                loss.detach()  # what the strategy logs: a device tensor, read by the logger when it flushes
        counts.append(counter)
    runtime.drain()
    Path(out, f"{rank}.json").write_text(json.dumps(counts))
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["2bw", "1f1b"])
def test_no_host_sync_per_steady_state_step(kind):
    world = 3
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_stage, args=(world, str(Path(tmp, "init")), kind, tmp), nprocs=world, start_method="spawn")
        counts = {rank: json.loads(Path(tmp, f"{rank}.json").read_text()) for rank in range(world)}
    # The first step negotiates the layouts (one header read per link): the counter sees it.
    assert any(counts[rank][0] for rank in range(1, world)), counts
    for rank, per_step in counts.items():
        assert per_step[STEADY_FROM:] == [{}] * (STEPS - STEADY_FROM), f"stage {rank}: {per_step}"
