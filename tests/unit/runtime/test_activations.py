"""Several tensors between stages: packing into one message, and a model whose layers pass dicts and tuples."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from lightning_async_pp.runtime import activations
from lightning_async_pp.runtime.activations import Spec
from lightning_async_pp.runtime.comm import layout_of
from tests.fixtures.helpers import run_script

RUNNER = "tests.fixtures.tuple_model"


def test_a_dict_travels_as_its_tensors_and_a_spec():
    h = torch.randn(2, 3, requires_grad=True) * 2  # non-leaf, requires grad
    value = {"h": h, "ids": torch.arange(6).view(2, 3), "mask": torch.ones(2, 3), "ünï": torch.zeros(1)}
    tensors, spec = activations.message(value)
    assert len(tensors) == 5 and tensors[0] is h
    assert spec == Spec("dict", ("h", "ids", "mask", "ünï"), (True, False, False, False))
    rebuilt, decoded = activations.read_message([t.detach() for t in tensors], known=None)
    assert decoded == spec and list(rebuilt) == list(value)
    assert all(torch.equal(rebuilt[k], value[k].detach()) for k in value)


def test_a_tuple_and_a_plain_tensor():
    a, b = torch.randn(2, requires_grad=True), torch.randn(2)
    tensors, spec = activations.message((a, b))
    assert spec == Spec("tuple", (), (True, False)) and len(tensors) == 3
    rebuilt, _ = activations.read_message(tensors, known=None)
    assert isinstance(rebuilt, tuple) and rebuilt[0] is a
    # The single-tensor contract is unchanged: one tensor, no spec.
    tensors, spec = activations.message(a)
    assert tensors == [a] and spec.kind == "tensor"


def test_a_known_spec_is_not_read_again():
    tensors, spec = activations.message([torch.ones(1), torch.ones(2)])
    tensors[-1] = torch.full_like(tensors[-1], -1)  # garbage: must not be decoded
    rebuilt, same = activations.read_message(tensors, known=spec)
    assert same is spec and isinstance(rebuilt, list) and len(rebuilt) == 2


def test_int16_travels_widened_and_arrives_exactly_as_sent():
    ids = torch.tensor([[-32768, -1, 0, 1, 32767]], dtype=torch.int16)
    for value, wire in ((ids, [torch.int32]), ({"h": torch.randn(1, 5), "ids": ids}, [torch.float32, torch.int32])):
        tensors, spec = activations.message(value)
        # What the link carries: no int16 (NCCL has none), and a spec even for a plain tensor.
        assert [t.dtype for t in tensors[:-1]] == wire and tensors[-1].dtype == torch.int64
        layout_of(tensors)
        for known in (None, spec):
            rebuilt, decoded = activations.read_message(tensors, known=known)
            got = rebuilt if isinstance(rebuilt, torch.Tensor) else rebuilt["ids"]
            assert decoded == spec and got.dtype == torch.int16 and torch.equal(got, ids)


def test_a_link_refuses_int16_itself():
    with pytest.raises(ValueError, match="Cannot send a torch.int16 tensor"):
        layout_of([torch.zeros(2, dtype=torch.int16)])


@pytest.mark.parametrize(
    "value", [None, 3, (torch.ones(1), None), {"a": torch.ones(1), "b": 2}, {1: torch.ones(1)}, ()]
)
def test_other_values_are_refused_with_what_to_do(value):
    with pytest.raises(TypeError, match="tensor, or a tuple, list or dict|string keys"):
        activations.message(value)


def test_gradients_come_back_only_for_tensors_that_require_grad():
    spec = Spec("tuple", (), (True, False, True))
    received = (torch.ones(2), torch.ones(2), torch.ones(2))
    activations.with_grad_inputs(received, spec)
    assert [t.requires_grad for t in received] == [True, False, True]
    (received[0] * 3).sum().backward()
    grads = activations.input_grads(received, spec)
    assert len(grads) == 2 and torch.equal(grads[0], torch.full((2,), 3.0)) and torch.equal(grads[1], torch.zeros(2))


def _run(tmp_path, devices, schedule, split):
    out = tmp_path / f"{devices}-{schedule}"
    command = [
        sys.executable,
        "-m",
        RUNNER,
        "--devices",
        str(devices),
        "--schedule",
        schedule,
        "--microbatches",
        "4",
        "--steps",
        "8",
        "--split-points",
        split,
        "--out",
        str(out),
    ]
    returncode, output = run_script(command, 420)
    assert returncode == 0, output[-6000:]
    weights = {}
    for rank in range(devices):
        weights.update(torch.load(out / f"weights_rank{rank}.pt"))
    return json.loads((out / "losses.json").read_text()), weights


@pytest.mark.parametrize(
    ("devices", "schedule", "split"),
    [(2, "1f1b", "3"), pytest.param(3, "2bw", "2,4", marks=pytest.mark.slow)],
    ids=["P2-1f1b-tuple", "P3-2bw-dict-and-tuple"],
)
@pytest.mark.multiprocess
def test_layers_passing_dicts_and_tuples_train_exactly_as_on_one_device(tmp_path, devices, schedule, split):
    from tests.fixtures.tuple_model import train

    losses, weights = _run(tmp_path, devices, schedule, split)
    _, model, expected = train(1, schedule, 4, 8)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    reference = model.state_dict()
    assert sorted(weights) == sorted(reference)
    for name, value in reference.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    gate = reference["layers.0.gate.weight"]
    assert not torch.equal(gate, type(model)().state_dict()["layers.0.gate.weight"])  # the gate's gradient arrived
