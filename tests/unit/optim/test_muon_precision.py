"""Muon's Newton-Schulz precision: float32 on CPU by default, bfloat16 on CUDA, overridable, reported."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.optim._muon as torch_muon

from lightning_async_pp.optim import DelayCorrected, Muon
from lightning_async_pp.optim.newton_schulz import (
    auto_newton_schulz_dtype,
    newton_schulz_dtype,
    use_float32_newton_schulz,
    zeropower_via_newtonschulz_float32,
)

COEFFICIENTS = (3.4445, -4.775, 2.0315)


def gradient() -> torch.Tensor:
    return torch.randn(48, 16, generator=torch.Generator().manual_seed(0))


def one_step(**kwargs) -> torch.Tensor:
    """The update of one Muon step from zero weights (no decay), so it is -lr * scale * orthogonalized(g)."""
    param = torch.nn.Parameter(torch.zeros(48, 16))
    optimizer = Muon([("w", param)], lr=0.02, weight_decay=0.0, **kwargs)
    param.grad = gradient()
    optimizer.step()
    return param.detach().clone()


def direction(update: torch.Tensor) -> torch.Tensor:
    return update / update.norm()


TORCH_NEWTON_SCHULZ = torch_muon._zeropower_via_newtonschulz  # torch's bfloat16 iteration, before any patch


def orthogonalized(ns_dtype: str) -> torch.Tensor:
    """The first step's orthogonalized Nesterov update (momentum 0.95 from a zero buffer), in ``ns_dtype``."""
    g = gradient()
    update = g.lerp(torch.zeros_like(g).lerp_(g, 0.05), 0.95)
    if ns_dtype == "float32":
        return zeropower_via_newtonschulz_float32(update, COEFFICIENTS, 5, 1e-7)
    return TORCH_NEWTON_SCHULZ(update, COEFFICIENTS, 5, 1e-7).float()


def test_the_two_precisions_differ_by_bfloat16_rounding_only():
    f32, bf16 = orthogonalized("float32"), orthogonalized("bfloat16")
    assert 0 < (f32 - bf16).norm() / bf16.norm() < 0.05
    assert TORCH_NEWTON_SCHULZ(gradient(), COEFFICIENTS, 5, 1e-7).dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [({}, "float32"), ({"ns_dtype": "float32"}, "float32"), ({"ns_dtype": "bfloat16"}, "bfloat16")],
    ids=["auto-on-cpu", "float32", "bfloat16"],
)
def test_each_choice_orthogonalizes_in_its_precision(kwargs, expected):
    update = one_step(**kwargs)
    other = "bfloat16" if expected == "float32" else "float32"
    torch.testing.assert_close(direction(update), -direction(orthogonalized(expected)), rtol=1e-4, atol=1e-6)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(direction(update), -direction(orthogonalized(other)), rtol=1e-4, atol=1e-6)
    # The step puts torch's iteration back.
    assert torch_muon._zeropower_via_newtonschulz is not zeropower_via_newtonschulz_float32


def test_a_block_sets_auto_and_torch_muon_but_not_an_explicit_choice():
    with newton_schulz_dtype("bfloat16"):
        auto = one_step()
        explicit = one_step(ns_dtype="float32")
    torch.testing.assert_close(direction(auto), -direction(orthogonalized("bfloat16")), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(direction(explicit), -direction(orthogonalized("float32")), rtol=1e-4, atol=1e-6)

    original = torch_muon._zeropower_via_newtonschulz
    param = torch.nn.Parameter(torch.zeros(48, 16))
    reference = torch.optim.Muon([param], lr=0.02, weight_decay=0.0)
    param.grad = gradient()
    with use_float32_newton_schulz():
        reference.step()
    assert torch_muon._zeropower_via_newtonschulz is original
    torch.testing.assert_close(direction(param.detach()), -direction(orthogonalized("float32")), rtol=1e-4, atol=1e-6)


def test_auto_is_bfloat16_on_cuda_only():
    assert auto_newton_schulz_dtype(torch.device("cuda", 1)) == "bfloat16"
    assert auto_newton_schulz_dtype(torch.device("cpu")) == "float32"
    assert auto_newton_schulz_dtype(torch.device("meta")) == "float32"


def test_the_choice_is_reported_kept_through_pickling_and_wrappers():
    param = torch.nn.Parameter(torch.zeros(4, 4))
    optimizer = Muon([("w", param), ("b", torch.nn.Parameter(torch.zeros(4)))], ns_dtype="bfloat16")
    assert optimizer.routing()["ns_dtype"] == "bfloat16"
    assert "Newton-Schulz in bfloat16" in optimizer.describe_routing()
    assert pickle.loads(pickle.dumps(optimizer)).routing()["ns_dtype"] == "bfloat16"
    assert Muon([("w", param)]).routing()["ns_dtype"] == "float32"
    # No Muon part, no precision to report.
    adamw_only = Muon([("b", torch.nn.Parameter(torch.zeros(4)))])
    assert adamw_only.routing()["ns_dtype"] is None
    assert "Newton-Schulz" not in adamw_only.describe_routing()
    wrapped = DelayCorrected(Muon([("w", param)]))
    assert "Newton-Schulz in float32" in wrapped.base_optimizer.describe_routing()


def test_an_unknown_precision_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="'auto', 'float32', 'bfloat16'"):
        Muon([("w", torch.nn.Parameter(torch.zeros(4, 4)))], ns_dtype="float16")
    with pytest.raises(ValueError, match="'float32', 'bfloat16'"):
        with newton_schulz_dtype("auto"):
            pass
