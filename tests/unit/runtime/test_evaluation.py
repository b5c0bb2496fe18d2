"""Micro-batched evaluation in one process: how many micro-batches, the layout signature, the joining of the
outputs, and a one-stage runtime against the whole batch's forward (the multi-stage runs are in
tests/multiprocess/test_evaluation.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_async_pp.runtime.evaluation import EvaluatedStage, JoinedOutput, evaluation_microbatches, signature_of
from lightning_async_pp.runtime.stage import StageRuntime
from tests.unit.runtime.test_stage import middle_stage


@pytest.mark.parametrize(
    "size,limit,expected",
    [(16, 4, 4), (8, 8, 8), (6, 4, 3), (5, 4, 1), (7, 8, 7), (2, 4, 2), (1, 4, 1), (12, 1, 1), (9, 4, 3)],
)
def test_evaluation_microbatches_is_the_largest_divisor_up_to_the_limit(size, limit, expected):
    assert evaluation_microbatches((torch.zeros(size, 3), torch.zeros(size)), limit) == expected


def test_evaluation_microbatches_of_batches_that_cannot_be_split():
    assert evaluation_microbatches({"n": 3, "scale": torch.tensor(2.0)}, 4) == 1  # no batch dimension
    assert evaluation_microbatches((torch.zeros(4), torch.zeros(6)), 4) == 1  # sizes differ


def test_signature_follows_dtypes_and_shapes_only():
    a = {"x": torch.zeros(2, 5), "y": torch.zeros(2, dtype=torch.long)}
    assert signature_of(a) == signature_of({"x": torch.ones(2, 5), "y": torch.ones(2, dtype=torch.long)})
    assert signature_of(a) != signature_of({"x": torch.zeros(3, 5), "y": torch.zeros(3, dtype=torch.long)})
    assert signature_of(a) != signature_of({"x": torch.zeros(2, 5), "y": torch.zeros(2, dtype=torch.int32)})


def join(outputs: list):
    joined = JoinedOutput(len(outputs))
    for index, output in enumerate(outputs):
        joined.add(index, output)
    return joined.result()


def test_joined_output_is_each_tensor_concatenated_along_the_batch_dimension():
    parts = [torch.randn(2, 3) for _ in range(3)]
    assert torch.equal(join(parts), torch.cat(parts))
    assert join(parts[:1]) is parts[0]  # one micro-batch: the output itself
    joined = join([{"h": p, "ids": p.argmax(-1)} for p in parts])
    assert list(joined) == ["h", "ids"] and torch.equal(joined["ids"], torch.cat(parts).argmax(-1))
    joined = join([(p, p.double() + 1) for p in parts])
    assert isinstance(joined, tuple) and joined[1].dtype == torch.float64 and torch.equal(joined[0], torch.cat(parts))
    assert isinstance(join([[p] for p in parts]), list)
    # Micro-batches may arrive in any order: each lands in its own rows.
    joined = JoinedOutput(3)
    for index in (2, 0, 1):
        joined.add(index, parts[index])
    assert torch.equal(joined.result(), torch.cat(parts))


def test_joined_output_refuses_what_has_no_batch_dimension_or_changes():
    with pytest.raises(TypeError, match="batch"):
        join([torch.tensor(1.0), torch.tensor(2.0)])
    with pytest.raises(TypeError, match="batch"):
        join([{"logits": torch.zeros(2, 3), "n": 2}] * 2)
    with pytest.raises(TypeError, match="Micro-batch 1 returned"):
        join([torch.zeros(2, 3), torch.zeros(2, 4)])
    with pytest.raises(TypeError, match="Micro-batch 1 returned"):
        join([(torch.zeros(2),), [torch.zeros(2)]])


class Head(nn.Module):
    """A last layer with a dict output: per-sample logits and a per-token argmax."""

    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(6, 4)

    def forward(self, x):
        logits = self.out(x)
        return {"logits": logits, "best": logits.argmax(-1)}


def test_one_stage_evaluates_in_micro_batches_like_the_whole_batch():
    torch.manual_seed(0)
    # BatchNorm in eval mode normalises each sample with the running statistics: per-sample, like the rest.
    layers = [nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.ReLU()), Head()]
    with torch.no_grad():
        layers[0][1].running_mean.uniform_(-1, 1)
        layers[0][1].running_var.uniform_(0.5, 2)
    for layer in layers:
        layer.eval()
    runtime = StageRuntime(
        kind="1f1b",
        stage=0,
        num_stages=1,
        num_microbatches=4,
        layers=layers,
        optimizer=None,
        inputs_fn=lambda batch: batch[0],
        loss_fn=lambda output, batch: output["logits"].sum(),
        device=torch.device("cpu"),
    )
    calls = []
    layers[1].register_forward_pre_hook(lambda module, args: calls.append(args[0].shape[0]))
    for size, parts in [(8, 4), (6, 3), (5, 1)]:
        calls.clear()
        batch = (torch.randn(size, 5), torch.arange(size))
        got = runtime.evaluate(batch)
        assert calls == [size // parts] * parts
        with torch.no_grad():
            want = layers[1](layers[0](batch[0]))
        torch.testing.assert_close(got["logits"], want["logits"], rtol=1e-6, atol=1e-6)
        assert torch.equal(got["best"], want["best"])


def test_evaluation_during_a_training_run_asks_for_a_drain():
    torch.manual_seed(0)
    layer = nn.Linear(4, 4)
    runtime = StageRuntime(
        kind="1f1b",
        stage=0,
        num_stages=1,
        num_microbatches=2,
        layers=[layer],
        optimizer=torch.optim.SGD(layer.parameters(), lr=0.1),
        inputs_fn=lambda batch: batch,
        loss_fn=lambda output, batch: output.pow(2).mean(),
        device=torch.device("cpu"),
    )
    runtime.run_step(0, torch.randn(4, 4))
    with pytest.raises(RuntimeError, match="drain"):
        runtime.evaluate(torch.randn(4, 4))
    runtime.drain()
    batch = torch.randn(6, 4)
    with torch.no_grad():
        torch.testing.assert_close(runtime.evaluate(batch), layer(batch), rtol=1e-6, atol=1e-6)  # the newest weights


def protocol_members(protocol: type) -> set[str]:
    """The attributes and methods a protocol declares."""
    methods = {name for name, value in vars(protocol).items() if callable(value) and not name.startswith("_")}
    return set(protocol.__annotations__) | methods


def test_a_stage_runtime_has_every_member_an_evaluation_reads():
    """A StageRuntime builds its evaluation with itself as the :class:`EvaluatedStage`: a member renamed on one side
    fails here, in one process, rather than in a multi-stage run."""
    members = protocol_members(EvaluatedStage)
    assert {"stage", "num_stages", "prev", "run_start", "receive_input", "forget_layouts"} <= members
    runtime = middle_stage()
    assert sorted(m for m in members if not hasattr(runtime, m)) == []
