"""Asynchronous checkpoints: the save thread writes the state of the moment the save was called, one save is in
flight at a time, and the thread writes from the stage's CUDA device.

Both asynchronous paths are covered: ``ShardedCheckpointIO(async_save=True)`` and Lightning's ``AsyncCheckpointIO``
around it, fed by the strategy's ``PipelineCheckpoint.save``. The writer is held in the save thread (patched
``FileSystemWriter.write_data``) so that training "continues" (the test changes the tensors in place) before
anything is written.
"""

from __future__ import annotations

import threading

import pytest
import torch
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter

import lightning_async_pp.checkpoint.io as sharded_io
from lightning_async_pp.checkpoint import ShardedCheckpointIO, read_tensors
from lightning_async_pp.strategy import checkpointing
from lightning_async_pp.strategy.checkpointing import PipelineCheckpoint
from lightning_async_pp.strategy.topology import PipelineDims

KINDS = ["async_save", "lightning-AsyncCheckpointIO"]


def _io(kind: str):
    if kind == "async_save":
        return ShardedCheckpointIO(async_save=True)
    return AsyncCheckpointIO(ShardedCheckpointIO())


def _save(io, module: nn.Module, path, device: torch.device | None = None) -> None:
    checkpoint = {"state_dict": module.state_dict()}
    # A weights-only checkpoint of the stage on global rank 1 (which writes no metadata), as one process sees it.
    dims = PipelineDims.for_workers(2, 2)
    writer = PipelineCheckpoint(module, [], "1f1b", dims, 1, 1, device or torch.device("cpu"))
    writer.save(io, checkpoint, path, None)


def _finish(io) -> None:
    io.teardown()  # waits for the save thread


def _hold_writes(monkeypatch, before=None, after=None) -> None:
    """Run ``before(n)`` and ``after(n)`` around the ``n``-th shard write (1-based), in the thread that writes."""
    original = FileSystemWriter.write_data
    count = [0]

    def write_data(self, plan, planner):
        count[0] += 1
        n = count[0]
        if before is not None:
            before(n)
        result = original(self, plan, planner)
        if after is not None:
            result.add_done_callback(lambda _: after(n))
        return result

    monkeypatch.setattr(FileSystemWriter, "write_data", write_data)


@pytest.mark.parametrize("kind", KINDS)
def test_async_save_writes_the_state_at_the_call(tmp_path, monkeypatch, kind):
    """The tensors change in place right after the save returns (the next optimizer step) and before the thread
    writes: the checkpoint holds the values of the call. Without a copy in the training thread it would hold the
    changed ones."""
    module = nn.Linear(4, 3)
    saved = {k: v.detach().clone() for k, v in module.state_dict().items()}
    training_went_on = threading.Event()
    _hold_writes(monkeypatch, before=lambda n: training_went_on.wait(timeout=30))
    io = _io(kind)
    _save(io, module, tmp_path / "step=1.ckpt")
    with torch.no_grad():
        for p in module.parameters():
            p.add_(1.0)  # the next step, while the save is pending
    training_went_on.set()
    _finish(io)
    written = read_tensors(tmp_path / "step=1.ckpt")
    for name, value in saved.items():
        assert torch.equal(written[f"state_dict.{name}"], value), name


@pytest.mark.parametrize("kind", KINDS)
def test_a_second_save_waits_for_the_first(tmp_path, monkeypatch, kind):
    """One save in flight: the second save copies its state only once the first is written. The first write waits
    (up to 1 s) for the second copy; with no bound the second copy comes at once and sees the first unfinished."""
    finished: list[int] = []
    seen_at_copy: list[list[int]] = []
    second_copy = threading.Event()
    _hold_writes(
        monkeypatch,
        before=lambda n: second_copy.wait(timeout=1) if n == 1 else None,
        after=lambda n: finished.append(n),
    )
    target = sharded_io if kind == "async_save" else checkpointing  # where the copy is taken
    original = target.snapshot_to_cpu

    def recording_copy(payload):
        seen_at_copy.append(list(finished))
        if len(seen_at_copy) == 2:
            second_copy.set()
        return original(payload)

    monkeypatch.setattr(target, "snapshot_to_cpu", recording_copy)
    module, io = nn.Linear(4, 3), _io(kind)
    _save(io, module, tmp_path / "step=1.ckpt")
    _save(io, module, tmp_path / "step=2.ckpt")
    _finish(io)
    assert seen_at_copy == [[], [1]]
    assert (tmp_path / "step=1.ckpt" / "meta.pt").is_file() and (tmp_path / "step=2.ckpt" / "meta.pt").is_file()


@pytest.mark.parametrize("kind", KINDS)
def test_the_save_thread_writes_from_the_stage_device(tmp_path, monkeypatch, kind):
    """A stage on ``cuda:1``: the thread that writes its shard has ``cuda:1`` as its current device (a new thread
    is on device 0, where DCP would synchronize the wrong stream). CUDA's per-thread current device is faked."""
    current = threading.local()
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: setattr(current, "index", torch.device(device).index))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: getattr(current, "index", 0))
    writers: list[tuple[str, int]] = []
    _hold_writes(
        monkeypatch, before=lambda n: writers.append((threading.current_thread().name, torch.cuda.current_device()))
    )
    io = _io(kind)
    _save(io, nn.Linear(4, 3), tmp_path / "step=1.ckpt", device=torch.device("cuda", 1))
    _finish(io)
    assert len(writers) == 1
    thread, device = writers[0]
    assert thread != threading.main_thread().name and device == 1, writers
