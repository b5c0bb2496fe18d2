"""ParameterSwap against torch's own re-parametrization (what ``torch.func.functional_call`` runs), the independent
reference it replaces: same outputs and gradients, tied aliases swapped at every name, frozen parameters and buffers
untouched, the module restored."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils.checkpoint import checkpoint

from lightning_async_pp.runtime.versions_swap import ParameterSwap


class Tied(nn.Module):
    """An embedding reused as the output head (one parameter under two names), a frozen scale, a buffer, and a
    block that recomputes its forward in backward."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.block = nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6))
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight
        self.scale = nn.Parameter(torch.tensor(2.0), requires_grad=False)
        self.register_buffer("shift", torch.ones(6))

    def forward(self, tokens):
        h = self.embed(tokens) + self.shift
        h = checkpoint(self.block, h, use_reentrant=False)
        return self.head(h) * self.scale


def version_of(params: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=generator).requires_grad_(True) for n, p in params.items()}


def test_outputs_and_gradients_equal_functional_call():
    torch.manual_seed(0)
    module = Tied()
    params = {n: p for n, p in module.named_parameters() if p.requires_grad}
    assert "head.weight" not in params  # named once, as embed.weight
    swap = ParameterSwap(module, params)
    tokens = torch.randint(0, 10, (3, 5))
    ours, reference = version_of(params, 1), version_of(params, 1)
    with swap(ours):
        out = module(tokens)
        out.pow(2).mean().backward()  # the checkpointed block recomputes under the same swap
    # The backward too runs re-parametrized: the checkpointed block recomputes with the version's weights.
    with _reparametrize_module(module, reference, tie_weights=True):
        expected = module(tokens)
        expected.pow(2).mean().backward()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    for name in params:
        torch.testing.assert_close(ours[name].grad, reference[name].grad, rtol=0, atol=0)
    # Outside the swap the module holds its own parameters again, the tie intact.
    assert module.embed.weight is module.head.weight and module.embed.weight is params["embed.weight"]
    assert all(p.grad is None for p in params.values())


def test_module_is_restored_when_the_forward_raises():
    module = nn.Linear(3, 3)
    params = dict(module.named_parameters())
    swap = ParameterSwap(module, params)
    with pytest.raises(ValueError), swap(version_of(params, 0)):
        raise ValueError("boom")
    assert module.weight is params["weight"] and module.bias is params["bias"]
    with swap(version_of(params, 2)):  # usable again
        assert module.weight is not params["weight"]


def test_unknown_names_are_refused():
    with pytest.raises(KeyError, match="no parameters named"):
        ParameterSwap(nn.Linear(2, 2), ["weight", "gain"])
