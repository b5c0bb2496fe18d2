"""No host-device synchronization in the steady state: a real 3-stage gloo pipeline counts the calls that
would make the host wait for a GPU (reading a tensor's value on the host) during each step."""

from __future__ import annotations

import contextlib
import json
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.fixtures.stages import linear_stage

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
    optimizer = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)  # noqa: E731
    runtime = linear_stage(rank, world, init_file, kind, 4, optimizer=optimizer, clip_grad_norm=1.0)
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
