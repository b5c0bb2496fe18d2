"""Layers that recompute their forward in backward (activation checkpointing) use the micro-batch's weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_async_pp import AsyncPipelineStrategy
from lightning_async_pp.runtime.recompute import checkpoint_layers, select_layers
from tests.multiprocess.scripts.toy_run import Block, Embed, Head, reference_toy, run_toy
from tests.multiprocess.test_ties import print_differences

TOL = dict(rtol=1e-5, atol=1e-6)
BASE = ("--schedule", "2bw", "--microbatches", "2", "--split-points", "2")


def assert_same_run(losses, weights, ref_losses, ref_weights):
    print_differences(losses, weights, ref_losses, ref_weights)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)
    assert sorted(weights) == sorted(ref_weights)
    for name, value in ref_weights.items():
        torch.testing.assert_close(weights[name], value, **TOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize(
    "recompute",
    [
        pytest.param(("--recompute",), id="user-checkpoint"),
        pytest.param(("--activation-checkpointing", "true"), id="option-all"),
        pytest.param(("--activation-checkpointing", '["Block"]'), id="option-by-type"),
    ],
)
@pytest.mark.multiprocess
def test_recomputed_blocks_on_two_stages_follow_the_delayed_trajectory(tmp_path, recompute):
    """2BW with recomputation on 2 stages == one device without recomputation (the delayed trajectory)."""
    ref_losses, ref_weights, _ = reference_toy(*BASE)
    result, weights, _ = run_toy(tmp_path, 2, *BASE, *recompute)
    assert_same_run(result["losses"], weights, ref_losses, ref_weights)


@pytest.mark.parametrize("recompute", [("--recompute",), ("--activation-checkpointing", "[1, 3]")])
def test_recomputed_blocks_on_one_device_change_nothing(recompute):
    ref_losses, ref_weights, _ = reference_toy(*BASE)
    losses, weights, _ = reference_toy(*BASE, *recompute)
    assert_same_run(losses, weights, ref_losses, ref_weights)


def test_activation_checkpointing_selects_layers():
    layers = [Embed(), Block(), Block(), Head()]
    assert select_layers(layers, True) == [0, 1, 2, 3]
    assert select_layers(layers, False) == []
    assert select_layers(layers, [1, 3]) == [1, 3]
    assert select_layers(layers, ["Block"]) == [1, 2]
    assert select_layers(layers, [Head, "Embed"]) == [0, 3]
    with pytest.raises(ValueError, match="layer index 4"):
        select_layers(layers, [4])
    with pytest.raises(ValueError, match="'Blocks' matches no layer.*Block, Embed, Head"):
        select_layers(layers, ["Blocks"])
    with pytest.raises(ValueError, match="activation_checkpointing"):
        AsyncPipelineStrategy(activation_checkpointing=3.5)
    checkpoint_layers(layers, [1])
    wrapped = layers[1].forward
    checkpoint_layers(layers, [1])  # fitting the same model again wraps nothing twice
    assert layers[1].forward == wrapped


def test_checkpointed_layer_keeps_its_names_and_eval_skips_the_recompute():
    layer = nn.Sequential(nn.Linear(4, 4))
    names = [n for n, _ in layer.named_parameters()]
    checkpoint_layers([layer], [0])
    assert [n for n, _ in layer.named_parameters()] == names
    with torch.no_grad():
        assert layer(torch.ones(1, 4)).shape == (1, 4)
