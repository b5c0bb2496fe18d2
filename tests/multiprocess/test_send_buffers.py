"""Sent tensors are let go while training, not held until the next drain: on gloo a send's work never reports
completion before ``wait()``, so a channel holds each sent message until the runtime tells it the peer has
received it. A 3-stage gloo pipeline (the middle stage has both links) counts the messages each link still
holds after every step: the count must stop growing once the pipeline is full."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.fixtures.stages import linear_stage

pytestmark = pytest.mark.multiprocess

STEPS, M = 12, 4


def _stage(rank: int, world: int, init_file: str, kind: str, out: str) -> None:
    runtime = linear_stage(rank, world, init_file, kind, M)
    generator = torch.Generator().manual_seed(0)
    held = []
    for step in range(STEPS):
        runtime.run_step(step, torch.randn(16, 8, generator=generator))
        held.append([channel.pending_sends if channel is not None else 0 for channel in (runtime.prev, runtime.next)])
    runtime.drain()
    held.append([channel.pending_sends if channel is not None else 0 for channel in (runtime.prev, runtime.next)])
    Path(out, f"{rank}.json").write_text(json.dumps(held))
    dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["2bw", "1f1b"])
def test_sent_messages_are_let_go_during_training(kind):
    world = 3
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_stage, args=(world, str(Path(tmp, "init")), kind, tmp), nprocs=world, start_method="spawn")
        held = {rank: json.loads(Path(tmp, f"{rank}.json").read_text()) for rank in range(world)}
    for rank, per_step in held.items():
        *training, drained = per_step
        assert drained == [0, 0], f"stage {rank}: {per_step}"
        for link in range(2):
            counts = [step[link] for step in training]
            # Before the fix the count grew by M every step (48 messages by the end); now the latest steps hold
            # no more than the pipeline keeps in flight, and no more than the steps before them.
            assert max(counts[4:]) <= 3 * M and counts[-1] <= max(counts[:6]), f"stage {rank} link {link}: {counts}"
    assert held[1][-2][0] > 0 or held[1][-2][1] > 0 or kind == "1f1b", held  # 2bw keeps messages in flight
