"""Muon's batched step (the default) against its per-matrix step (``batched=False``, torch's own loops)."""

from __future__ import annotations

import copy
import importlib.util
import pickle
from pathlib import Path

import pytest
import torch

from lightning_async_pp.optim import DelayCorrected, Muon
from lightning_async_pp.optim.newton_schulz import (
    zeropower_via_newtonschulz_batched,
    zeropower_via_newtonschulz_float32,
)
from lightning_async_pp.runtime.sharding import keep_owned

FIXTURE = Path(__file__).parents[2] / "fixtures" / "checkpoints"
COEFFICIENTS = (3.4445, -4.775, 2.0315)
# Per update, |batched - per-matrix| / |per-matrix|: float32 rounding, and bfloat16 rounding of the
# iteration. bfloat16 weights are compared elementwise at one bfloat16 step (2**-8 relative).
FLOAT32_TOLERANCE, BFLOAT16_TOLERANCE = 1e-6, 1e-2


# Matrices of at least 16 rows (as iterated): smaller ones take another kernel of the CPU's BLAS, in which a
# transposed operand rounds differently, for the per-matrix path too (~1.5e-6 after the iteration).
SHAPES = {
    "embed.weight": (11, 16),
    "a.weight": (16, 32),
    "b.weight": (32, 16),
    "b.bias": (32,),
    "c.weight": (16, 32),
    "d.weight": (32, 16),
    "alone.weight": (40, 20),
    "square.weight": (24, 24),
    "conv.weight": (24, 4, 2, 2),
    "matrix.weight": (16, 24),
    "e.weight": (16, 32),
    "ln.weight": (16,),
}
# The first two groups share their iteration settings, the third does not (another momentum; no Nesterov,
# except on bfloat16 weights; Moonshot's learning rate). Batches: (16, 32) from the first two groups (a, b,
# c, d); (20, 40); (24, 24); the kernel, seen as (24, 16), with its transpose (16, 24); and (16, 32) of the
# third group (e).
GROUPS = (["embed.weight", "a.weight", "b.weight", "b.bias", "c.weight"], list(SHAPES)[5:8], list(SHAPES)[8:])
BATCHES = 5


def parameters(dtype=torch.float32, seed: int = 0) -> dict[str, torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: torch.nn.Parameter((torch.randn(shape, generator=generator) * 0.3).to(dtype))
        for name, shape in SHAPES.items()
    }


def set_grads(params: dict[str, torch.nn.Parameter], step: int) -> None:
    generator = torch.Generator().manual_seed(1000 + step)
    for param in params.values():
        noise = torch.randn(param.shape, generator=generator)
        param.grad = (param.detach().float() * 0.5 + noise).to(param.dtype)


def groups(params: dict[str, torch.nn.Parameter]) -> list[dict]:
    first, second, third = ([(n, params[n]) for n in names] for names in GROUPS)
    # torch.optim.Muon without Nesterov, on bfloat16 momentum and with its bfloat16 iteration, divides the
    # momentum buffer itself by its norm (`grad.bfloat16()` is the buffer): not a reference there.
    nesterov = next(iter(params.values())).dtype == torch.bfloat16
    return [
        {"params": first},
        {"params": second, "lr": 0.01},
        {"params": third, "nesterov": nesterov, "momentum": 0.8, "adjust_lr_fn": "match_rms_adamw"},
    ]


def build(params, **kwargs) -> Muon:
    return Muon(groups(params), lr=0.02, weight_decay=0.05, momentum=0.9, adamw_lr=3e-3, **kwargs)


def schedule(optimizer: torch.optim.Optimizer, step: int) -> None:
    """A scheduler's edits: learning rate and momentum change at every step."""
    for group in optimizer.param_groups:
        group["lr"] = group.setdefault("initial_lr", group["lr"]) * (1 - 0.1 * step)
        if group["use_muon"]:
            group["momentum"] = group.setdefault("initial_momentum", group["momentum"]) - 0.02 * step


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("ns_batch_bytes", [None, 1], ids=["default-chunks", "one-matrix-per-chunk"])
@pytest.mark.parametrize(
    ("ns_dtype", "dtype"),
    [
        ("float32", torch.float32),
        ("bfloat16", torch.float32),
        ("float32", torch.bfloat16),
        ("bfloat16", torch.bfloat16),
    ],
    ids=["ns-float32", "ns-bfloat16", "ns-float32-bf16-weights", "ns-bfloat16-bf16-weights"],
)
def test_each_update_is_the_per_matrix_one(ns_dtype, dtype, ns_batch_bytes):
    chunks = {} if ns_batch_bytes is None else {"ns_batch_bytes": ns_batch_bytes}
    batched_params, reference_params = parameters(dtype), parameters(dtype)
    batched = build(batched_params, ns_dtype=ns_dtype, **chunks)
    reference = build(reference_params, ns_dtype=ns_dtype, batched=False)
    routing = batched.routing()
    assert routing["ns_groups"] == BATCHES
    assert routing["ns_batches"] == (BATCHES if ns_batch_bytes is None else routing["muon_tensors"])
    tolerance = FLOAT32_TOLERANCE if ns_dtype == "float32" else BFLOAT16_TOLERANCE
    for step in range(3):
        schedule(batched, step)
        schedule(reference, step)
        set_grads(batched_params, step)
        set_grads(reference_params, step)
        before = {n: p.detach().float().clone() for n, p in reference_params.items()}
        batched.step()
        reference.step()
        for name, param in batched_params.items():
            ours, theirs = param.detach(), reference_params[name].detach()
            assert not torch.equal(theirs.float(), before[name]), name  # every tensor is updated
            if dtype == torch.bfloat16:
                torch.testing.assert_close(ours, theirs, rtol=2**-8, atol=0, msg=name)
            else:
                assert relative(ours - before[name], theirs - before[name]) <= tolerance, (name, step)
                batched_params[name].data.copy_(theirs)  # compare each update from the same weights


@pytest.mark.parametrize("batched", [True, False])
def test_weight_decay_of_bfloat16_weights_is_the_float32_product_rounded_once(batched):
    """With zero gradients the step is the decay alone, on both parts. (Multi-tensor multiplication on CPU
    rounds the factor to bfloat16 first: 1 - 0.02 * 0.5 = 0.99 becomes 0.98828125.)"""
    params = {
        name: p
        for name, p in parameters(torch.bfloat16).items()
        if name in ("embed.weight", "a.weight", "c.weight", "b.bias")
    }
    before = {name: p.detach().clone() for name, p in params.items()}
    optimizer = Muon(params.items(), lr=0.02, weight_decay=0.5, adamw_lr=0.02, adamw_weight_decay=0.5, batched=batched)
    assert optimizer.routing()["muon_tensors"] == 2
    for p in params.values():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for name, param in params.items():
        expected = (before[name].float() * (1 - 0.02 * 0.5)).bfloat16()
        assert not torch.equal(expected, before[name]), name
        assert torch.equal(param.detach(), expected), name


def test_the_batched_iteration_is_the_per_matrix_one_for_wide_and_transposed_tall_matrices():
    generator = torch.Generator().manual_seed(0)
    wide = [torch.randn(16, 40, generator=generator) for _ in range(3)]
    tall = [torch.randn(40, 16, generator=generator) for _ in range(2)]
    stacked = zeropower_via_newtonschulz_batched(torch.stack(wide), COEFFICIENTS, 5, 1e-7)
    transposed = zeropower_via_newtonschulz_batched(torch.stack(tall).mT, COEFFICIENTS, 5, 1e-7).mT
    for matrix, result in zip(wide + tall, [*stacked, *transposed]):
        reference = zeropower_via_newtonschulz_float32(matrix, COEFFICIENTS, 5, 1e-7)
        assert result.shape == matrix.shape
        assert relative(result, reference) <= FLOAT32_TOLERANCE


def test_a_part_that_keeps_its_own_tensors_steps_them_with_the_same_bits():
    """Sharded state: each replica's optimizer holds part of every group, so its stacks are smaller."""
    whole_params = parameters()
    parts_params = [parameters(), parameters()]
    whole = build(whole_params, ns_dtype="float32")
    parts = [build(p, ns_dtype="float32") for p in parts_params]
    names = list(SHAPES)
    owners = {name: index % 2 for index, name in enumerate(names)}  # splits each group of several matrices
    for replica, (params, optimizer) in enumerate(zip(parts_params, parts)):
        keep_owned(optimizer, [params[n] for n in names if owners[n] == replica])
        assert optimizer.routing()["muon_tensors"] < whole.routing()["muon_tensors"]
    for step in range(3):
        for params in (whole_params, *parts_params):
            set_grads(params, step)
        whole.step()
        for optimizer in parts:
            optimizer.step()
    for name, param in whole_params.items():
        assert torch.equal(parts_params[owners[name]][name], param), name
        assert not torch.equal(parts_params[1 - owners[name]][name], param), name


def test_delay_corrected_muon_follows_the_per_matrix_one():
    batched_params, reference_params = parameters(), parameters()
    batched = DelayCorrected(build(batched_params, ns_dtype="float32"))
    reference = DelayCorrected(build(reference_params, ns_dtype="float32", batched=False))
    for step in range(4):
        set_grads(batched_params, step)
        set_grads(reference_params, step)
        before = {n: p.detach().clone() for n, p in reference_params.items()}
        batched.step()
        reference.step()
        for name, param in batched_params.items():
            theirs = reference_params[name].detach()
            assert relative(param.detach() - before[name], theirs - before[name]) <= FLOAT32_TOLERANCE, name


def _writer():
    spec = importlib.util.spec_from_file_location("write_muon_state", FIXTURE / "write_muon_state.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_state_dict_of_the_per_matrix_code_resumes_on_its_trajectory():
    """``muon_state.pt`` was written by the code before the batched step (see its writer)."""
    writer = _writer()
    saved = torch.load(FIXTURE / "muon_state.pt")
    # The state dict of the current code has the same layout and values.
    params = writer.parameters()
    current = writer.optimizer(params)
    writer.run(params, current, range(writer.SAVED_AT))
    state_dict = current.state_dict()
    assert state_dict["param_groups"] == saved["state_dict"]["param_groups"]
    assert state_dict["state"].keys() == saved["state_dict"]["state"].keys()
    for index, state in state_dict["state"].items():
        old = saved["state_dict"]["state"][index]
        assert state.keys() == old.keys()
        for key, value in state.items():
            assert value.dtype == old[key].dtype and value.shape == old[key].shape
            torch.testing.assert_close(value, old[key], rtol=FLOAT32_TOLERANCE, atol=1e-7)
    # The old state resumes: two more steps land where the old code's did.
    params = writer.parameters()
    for name, param in params.items():
        param.data.copy_(saved["weights"][name])
    resumed = writer.optimizer(params)
    resumed.load_state_dict(saved["state_dict"])
    writer.run(params, resumed, range(writer.SAVED_AT, writer.FINAL))
    for name, param in params.items():
        update, expected = param.detach() - saved["weights"][name], saved["final"][name] - saved["weights"][name]
        assert relative(update, expected) <= FLOAT32_TOLERANCE, name


@pytest.mark.parametrize("clone", [copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o))])
def test_copies_keep_the_options(clone):
    optimizer = Muon([("w", torch.nn.Parameter(torch.zeros(4, 4)))], batched=False, ns_batch_bytes=1000)
    copied = clone(optimizer)
    assert not copied._muon.batched and not copied._adamw.batched and copied._muon.ns_batch_bytes == 1000
    assert copied.routing()["ns_groups"] is None


def test_the_routing_line_says_how_the_matrices_are_batched():
    params = parameters()
    assert f"Newton-Schulz in float32, batched in {BATCHES} groups)" in build(params).describe_routing()
    line = build(params, ns_batch_bytes=1).describe_routing()
    assert f"batched in {BATCHES} groups, {build(params).routing()['muon_tensors']} batches)" in line
    assert "Newton-Schulz in float32, matrix by matrix)" in build(params, batched=False).describe_routing()


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_a_bad_batch_size_is_refused(value):
    with pytest.raises(ValueError, match="`ns_batch_bytes` must be a positive number of bytes"):
        Muon([("w", torch.nn.Parameter(torch.zeros(4, 4)))], ns_batch_bytes=value)
