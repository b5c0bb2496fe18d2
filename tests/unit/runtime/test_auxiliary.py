"""An auxiliary loss attached to a layer's output trains as if it were added to the micro-batch's loss."""

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_async_pp.runtime.auxiliary import AuxiliaryLosses, attach_auxiliary_loss
from lightning_async_pp.runtime.stage import StageRuntime

WEIGHT = 0.3


def aux_of(h: torch.Tensor) -> torch.Tensor:
    return (h.tanh() ** 2).mean()


class WithAux(nn.Module):
    """A linear layer whose output carries ``WEIGHT * aux_of(output)``."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width, dtype=torch.float64)

    def forward(self, x: torch.Tensor, batch=None) -> torch.Tensor:
        h = self.linear(x)
        return attach_auxiliary_loss(h, aux_of(h), WEIGHT)


def grads(module: nn.Module) -> list[torch.Tensor]:
    out = [p.grad.clone() for p in module.parameters()]
    module.zero_grad(set_to_none=True)
    return out


def test_the_gradient_is_that_of_the_loss_plus_the_weighted_auxiliary_loss():
    torch.manual_seed(0)
    layer, x = WithAux(), torch.randn(3, 4, dtype=torch.float64)
    layer(x).sin().sum().backward()
    attached = grads(layer)
    h = layer.linear(x)
    (h.sin().sum() + WEIGHT * aux_of(h)).backward()
    for a, b in zip(attached, grads(layer)):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("recompute", [False, True])
def test_a_collector_scales_the_gradient_and_records_the_loss(recompute):
    torch.manual_seed(0)
    layer, x = WithAux(), torch.randn(3, 4, dtype=torch.float64)
    with AuxiliaryLosses(scale=0.25) as collector:
        y = checkpoint(layer, x, use_reentrant=False) if recompute else layer(x)
    (y.sin().sum() * 0.25).backward()  # the recomputation, if any, runs here: outside the collector
    attached = grads(layer)
    h = layer.linear(x)
    ((h.sin().sum() + WEIGHT * aux_of(h)) * 0.25).backward()
    for a, b in zip(attached, grads(layer)):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)
    assert len(collector.losses) == 1
    torch.testing.assert_close(collector.total(), aux_of(h).detach().float())


def test_without_grad_it_only_records_and_a_tensor_loss_is_refused():
    layer, x = WithAux(), torch.randn(3, 4, dtype=torch.float64)
    with torch.no_grad(), AuxiliaryLosses() as collector:
        y = layer(x)
    assert y.grad_fn is None and collector.total() is not None
    assert AuxiliaryLosses().total() is None
    with pytest.raises(ValueError, match="scalar loss"):
        attach_auxiliary_loss(y, torch.ones(2))


def test_a_stage_runtime_trains_on_the_mean_of_loss_plus_auxiliary_loss():
    """One stage, 4 micro-batches: the gradient the update sees is that of the mean over micro-batches of
    (loss + WEIGHT * aux), computed here with plain autograd; the step's record holds the mean aux loss."""
    torch.manual_seed(1)
    layers = [nn.Linear(4, 4, dtype=torch.float64), WithAux(), nn.Linear(4, 2, dtype=torch.float64)]
    reference = [nn.Linear(4, 4, dtype=torch.float64), nn.Linear(4, 4, dtype=torch.float64)]
    reference.append(nn.Linear(4, 2, dtype=torch.float64))
    for ref, layer in zip(reference, layers):
        ref.load_state_dict({k.removeprefix("linear."): v for k, v in layer.state_dict().items()})
    seen: list[list[torch.Tensor]] = []
    runtime = StageRuntime(
        kind="1f1b",
        stage=0,
        num_stages=1,
        num_microbatches=4,
        layers=layers,
        optimizer=torch.optim.SGD(nn.ModuleList(layers).parameters(), lr=0.0),
        inputs_fn=lambda mb: mb,
        loss_fn=lambda out, mb: (out**2).mean(),
        device=torch.device("cpu"),
        check_data_order=False,
        before_update=lambda: seen.append([p.grad.clone() for p in nn.ModuleList(layers).parameters()]),
    )
    batch = torch.randn(8, 4, dtype=torch.float64)
    _, stats = runtime.run_step(0, batch)
    runtime.drain()

    total, auxes = 0.0, []
    for mb in batch.chunk(4):
        h = reference[1](reference[0](mb))
        auxes.append(aux_of(h))
        total = total + ((reference[2](h) ** 2).mean() + WEIGHT * auxes[-1]) / 4
    total.backward()
    expected = [p.grad for p in nn.ModuleList(reference).parameters()]
    assert len(seen) == 1
    for got, want in zip(seen[0], expected):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert stats.aux_loss == pytest.approx(float(torch.stack(auxes).detach().mean()), rel=1e-6)


def test_the_one_device_path_scales_and_records_like_a_stage():
    from lightning.pytorch import LightningModule

    from lightning_async_pp.strategy.single_device import microbatch_losses

    class Model(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([WithAux(), nn.Linear(4, 1, dtype=torch.float64)])

        def pipeline_layers(self):
            return self.layers

        def pipeline_inputs(self, mb):
            return mb

        def pipeline_loss(self, out, mb):
            return out.square().mean()

    torch.manual_seed(2)
    model, batch = Model(), torch.randn(6, 4, dtype=torch.float64)
    recorded: list[torch.Tensor] = []
    for loss in microbatch_losses(model, batch, 3, aux_losses=recorded):
        (loss / 3).backward()
    got = grads(model)
    total, auxes = 0.0, []
    for mb in batch.chunk(3):
        h = model.layers[0].linear(mb)
        auxes.append(aux_of(h).detach())
        total = total + (model.layers[1](h).square().mean() + WEIGHT * aux_of(h)) / 3
    total.backward()
    for a, b in zip(got, grads(model)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.stack(recorded), torch.stack(auxes).float())
