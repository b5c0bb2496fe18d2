"""MetricsRelay between two processes: one step late, the first step at once, messages that outgrow the buffer."""

from __future__ import annotations

import os
import socket
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_async_pp.strategy.metrics import INITIAL_CAPACITY, MetricsRelay, reduce_decision

# What the last stage logs at each step; step 1 and 2 carry more than the first buffer holds.
STEPS = [
    {"train/loss": 5.0},
    {"train/loss": 4.0, **{f"many/{i:04d}": float(i) for i in range(400)}},
    {"train/loss": 3.0, **{f"many/{i:04d}": float(-i) for i in range(400)}},
    {"train/loss": 2.0},
]


class Results:
    def __init__(self) -> None:
        self.step: dict = {}

    def metrics(self, on_step: bool) -> dict:
        return {"callback": {k: torch.tensor(v) for k, v in self.step.items()}}


def _worker(rank: int, port: int, seen) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        relay = MetricsRelay.for_pipelines([[1, 0]], rank, torch.device("cpu"))  # rank 0 is the last stage
        trainer = SimpleNamespace(callback_metrics={}, _results=Results())
        for step, metrics in enumerate(STEPS):
            trainer._results.step = metrics
            relay.step(trainer)
            if rank == 1:
                seen.append((step, {k: float(v) for k, v in trainer.callback_metrics.items()}))
        relay.finish(trainer)
        if rank == 1:
            seen.append(("end", {k: float(v) for k, v in trainer.callback_metrics.items()}))
        # Only the last stage votes: rank 1's opposite vote changes nothing, for `all` and for `any`.
        decisions = [
            reduce_decision(rank == 0, all=True, votes=rank == 0, device=torch.device("cpu")),
            reduce_decision(rank == 1, all=False, votes=rank == 0, device=torch.device("cpu")),
        ]
        if rank == 1:
            seen.append(("decisions", decisions))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_relay_delivers_each_step_one_step_late():
    assert len(encoded(STEPS[1])) > INITIAL_CAPACITY
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    seen = mp.Manager().list()
    mp.spawn(_worker, args=(port, seen), nprocs=2, join=True)
    by_step = dict(seen[:-1])
    assert by_step[0] == STEPS[0]  # the first step waits for its own message
    assert by_step[1] == STEPS[0]  # later steps read the previous step's message
    # Step 1's message did not fit: it is skipped once and announces a larger buffer, so step 2's arrives whole.
    assert by_step[2] == STEPS[0]
    assert by_step[3] == STEPS[2]
    assert by_step["end"] == {**STEPS[2], **STEPS[3]}  # what is not logged again keeps its last value
    assert seen[-1] == ("decisions", [True, False])


def encoded(metrics: dict) -> bytes:
    from lightning_async_pp.strategy.metrics import encode

    return encode({k: torch.tensor(v) for k, v in metrics.items()})


def test_relay_reads_values_from_host_memory_only():
    """What a step of the relay does on the last stage (stage the logged values, post the message, read the
    previous one) and on another stage (decode the values) reads no tensor's value on the host: each such read of
    a CUDA tensor would wait for the device. One process, a group of one, stands for the pipeline."""
    from lightning_async_pp.strategy.metrics import decode, encode
    from tests.multiprocess.test_no_sync import count_syncs

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        relay = MetricsRelay.for_pipelines([[0]], 0, torch.device("cpu"))
        trainer = SimpleNamespace(callback_metrics={}, _results=Results())
        counter: dict = {}
        for metrics in (STEPS[0], STEPS[3], STEPS[0]):
            trainer._results.step = metrics
            with count_syncs(counter):
                relay.step(trainer)
                decoded = decode(encode(trainer._results.metrics(True)["callback"]), torch.device("cpu"))
            assert counter == {}, counter
            assert {k: float(v) for k, v in decoded.items()} == metrics
        relay.finish(trainer)
    finally:
        dist.destroy_process_group()
