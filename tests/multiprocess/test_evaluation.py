"""Micro-batched evaluation on several stages against one device without the strategy: the outputs of the whole
batch, a layout negotiated only when the micro-batches' shapes change, and the switch between training and
evaluation on one runtime."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_async_pp.runtime import comm
from tests.fixtures import tuple_model
from tests.fixtures.helpers import run_script
from tests.fixtures.stages import linear_stage

pytestmark = pytest.mark.multiprocess

M = 4
# Micro-batches of 2 samples for the batches of 8 and 6 (3 micro-batches), of 5 for the batch of 5 (one): the
# layout is negotiated for the first batch, for the batch of 5, and for the batch of 8 after it.
EVAL_SIZES = [8, 8, 6, 5, 8]


def _eval_batches(sizes: list[int]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randn(size, 8, generator=generator) for size in sizes]


def _train_then_evaluate(rank: int, world: int, init_file: str, out: str) -> None:
    runtime = linear_stage(rank, world, init_file, "2bw", M)
    headers = []
    encode = comm.encode_layout

    def counted(layout):
        headers.append(len(layout))
        return encode(layout)

    comm.encode_layout = counted  # counts the layout headers this stage sends
    generator = torch.Generator().manual_seed(0)
    record = {"outputs": [], "headers": [], "held": []}
    step = 0
    for _ in range(2):  # a run, an evaluation, a new run and another evaluation on the same runtime
        for _ in range(3):
            runtime.run_step(step, torch.randn(16, 8, generator=generator))
            step += 1
        runtime.drain()
        headers.clear()
        outputs = []
        for batch in _eval_batches(EVAL_SIZES):
            outputs.append(runtime.evaluate(batch))
            record["held"].append(runtime.next.pending_sends if runtime.next is not None else 0)
        record["headers"].append(len(headers))
        # The weights the evaluation ran on, gathered on the last stage for the one-device reference.
        weights = [None] * world
        dist.all_gather_object(weights, {k: v.clone() for k, v in runtime.module.state_dict().items()})
        if runtime.is_last:
            batches = _eval_batches(EVAL_SIZES)
            record["outputs"].append([(y.tolist(), _reference(weights, x).tolist()) for y, x in zip(outputs, batches)])
    runtime.drain()
    Path(out, f"{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


def _reference(weights: list[dict], batch: torch.Tensor) -> torch.Tensor:
    """The whole batch through every stage's layer on one device, in one forward."""
    x = batch
    for state in weights:
        layer = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
        layer.load_state_dict({k.split(".", 1)[1]: v for k, v in state.items()})
        x = layer(x)
    return x.detach()


@pytest.mark.parametrize("world", [2, 3])
def test_micro_batched_evaluation_after_training_matches_one_device(world):
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _train_then_evaluate, args=(world, str(Path(tmp, "init")), tmp), nprocs=world, start_method="spawn"
        )
        records = [json.loads(Path(tmp, f"{rank}.json").read_text()) for rank in range(world)]
    last = records[-1]
    assert len(last["outputs"]) == 2
    for outputs in last["outputs"]:
        for (got, want), size in zip(outputs, EVAL_SIZES):
            assert len(got) == size
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-6, atol=1e-6)
    for rank, record in enumerate(records[:-1]):
        # Three negotiations per evaluation (each with a header on the stage's one sending link): at the switch
        # from training, at the batch of 5 and at the batch of 8 after it; none for the batches in between.
        assert record["headers"] == [3, 3], f"stage {rank}: {record['headers']}"
        # A sending stage holds at most the last batch's messages.
        assert max(record["held"]) <= M, f"stage {rank}: {record['held']}"


@pytest.mark.parametrize("devices", [2, 3])
def test_validate_and_predict_a_tuple_model_match_one_device(tmp_path, devices):
    """The tuple model (dicts and tuples between stages) validated and predicted through Lightning in micro-batches
    equals one device without the strategy, including a batch of 6 (3 micro-batches) and one of 5 (not split)."""
    command = [sys.executable, "-m", "tests.fixtures.tuple_model", "--evaluate", "--devices", str(devices)]
    status, output = run_script([*command, "--microbatches", str(M), "--out", str(tmp_path)], timeout=600)
    assert status == 0, output[-6000:]
    got = torch.load(tmp_path / "evaluation.pt")
    want = tuple_model.evaluate(1, M, strategy=False)
    assert set(got["validate"]) == {"val/loss"}
    torch.testing.assert_close(got["validate"], want["validate"], rtol=1e-6, atol=1e-6)
    assert [p.shape[0] for p in got["predictions"]] == [8, 8, 6, 5]
    torch.testing.assert_close(got["predictions"], want["predictions"], rtol=1e-5, atol=1e-6)
