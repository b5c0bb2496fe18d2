"""Per-stage delay profiles (lightning_async_pp.reference.profile) against hand-written loops."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call

from lightning_async_pp import AsyncPipelineStrategy
from lightning_async_pp.demos import GPT
from lightning_async_pp.reference.delayed import DelayedWeights
from lightning_async_pp.reference.profile import DelayProfile, pipedream_delays, split_into_stages
from tests.fixtures.helpers import fit, flat_weights, random_batches, tiny_gpt


@pytest.fixture(autouse=True)
def _one_thread():
    # Bitwise comparisons need the same reduction order in both computations.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def data(steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(5, 4, generator=g), torch.randn(5, 3, generator=g)) for _ in range(steps)]


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()


def reference_trajectory(model: nn.Module, group_names: list[list[str]], delays: list[int], batches, make_opt):
    """Hand-written loop: keep every weight version, build each step's mixed weights explicitly, no swapping."""
    names = [n for n, _ in model.named_parameters()]
    params = dict(model.named_parameters())
    versions = [{n: p.detach().clone() for n, p in params.items()}]  # versions[t] = w[t]
    delay_of = {n: d for group, d in zip(group_names, delays) for n in group}
    optimizer = make_opt(model.parameters())
    losses = []
    for t, (x, y) in enumerate(batches):
        mixed = {n: versions[max(t - delay_of[n], 0)][n].clone().requires_grad_(True) for n in names}
        loss = loss_fn(functional_call(model, mixed, (x,)), y)
        grads = torch.autograd.grad(loss, [mixed[n] for n in names])
        for n, g in zip(names, grads):
            params[n].grad = g
        optimizer.step()
        optimizer.zero_grad()
        versions.append({n: p.detach().clone() for n, p in params.items()})
        losses.append(loss.item())
    return losses, versions[-1]


def profiled_trajectory(model: nn.Module, profile: DelayProfile, batches, make_opt):
    optimizer = make_opt(model.parameters())
    losses = []
    for x, y in batches:

        def closure():
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            return loss

        losses.append(optimizer.step(profile.wrap_closure(closure)).item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


OPTIMIZERS = {
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("delays", [[2, 1, 0], [3, 0, 1], [0, 0, 0], [1, 1, 1]])
def test_matches_hand_written_loop(optimizer, delays):
    make_opt = OPTIMIZERS[optimizer]
    batches = data(8)
    layer_names = [["0.weight", "0.bias"], ["2.weight", "2.bias"], ["4.weight", "4.bias"]]

    reference_model = tiny_mlp()
    ref_losses, ref_weights = reference_trajectory(reference_model, layer_names, delays, batches, make_opt)

    model = tiny_mlp()
    groups = [[model[0].weight, model[0].bias], [model[2].weight, model[2].bias], [model[4].weight, model[4].bias]]
    losses, weights = profiled_trajectory(model, DelayProfile(groups, delays), batches, make_opt)

    assert losses == ref_losses
    for name in ref_weights:
        torch.testing.assert_close(weights[name], ref_weights[name], rtol=0, atol=0)


def test_pipedream_profile_differs_from_2bw_and_sync():
    batches = data(8)
    make_opt = OPTIMIZERS["sgd_momentum"]
    finals = {}
    for name, delays in {"sync": [0, 0, 0], "2bw": [1, 1, 1], "pipedream": [2, 1, 0]}.items():
        model = tiny_mlp()
        groups = [list(model[i].parameters()) for i in (0, 2, 4)]
        finals[name] = profiled_trajectory(model, DelayProfile(groups, delays), batches, make_opt)[1]
    for a, b in [("sync", "2bw"), ("sync", "pipedream"), ("2bw", "pipedream")]:
        assert not torch.equal(finals[a]["0.weight"], finals[b]["0.weight"])
    # The last stage has no delay under PipeDream, but its gradient still sees stale upstream stages.
    assert not torch.equal(finals["sync"]["4.weight"], finals["pipedream"]["4.weight"])


def test_delayed_weights_match_hand_written_one_step_delay():
    """DelayedWeights (every parameter one step stale: PipeDream-2BW) against the hand-written loop, exactly."""
    batches = data(8)
    make_opt = OPTIMIZERS["adamw"]
    layer_names = [["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]]
    ref_losses, ref_weights = reference_trajectory(tiny_mlp(), layer_names, [1], batches, make_opt)

    model = tiny_mlp()
    delayed = DelayedWeights(model)
    optimizer = make_opt(model.parameters())
    losses = []
    for x, y in batches:

        def closure():
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            return loss

        losses.append(optimizer.step(delayed.wrap_closure(closure)).item())
    assert losses == ref_losses
    for name, value in model.named_parameters():
        torch.testing.assert_close(value.detach(), ref_weights[name], rtol=0, atol=0)
    assert [n for n, _ in model.named_parameters()] == delayed.names
    # The stored previous weights are the last step's: w[t-1] for the next step.
    assert not torch.equal(delayed.previous[0], model[0].weight.detach())


def test_lightning_hook_uniform_profile_equals_2bw_strategy():
    """Through LightningModule.optimizer_step on the synchronous strategy, delay 1 everywhere == schedule='2bw'."""
    batches = random_batches(6)

    class ProfiledGPT(GPT):
        def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
            if not hasattr(self, "profile"):
                self.profile = DelayProfile.uniform(self.pipeline_layers(), 4, delay=1)
            optimizer.step(closure=self.profile.wrap_closure(optimizer_closure))

    profiled = ProfiledGPT(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32, lr_schedule="constant")
    losses = fit(profiled, batches, strategy=AsyncPipelineStrategy(schedule="1f1b", num_microbatches=2))

    reference = tiny_gpt()
    ref_losses = fit(reference, batches, strategy=AsyncPipelineStrategy(schedule="2bw", num_microbatches=2))
    assert losses == ref_losses
    assert torch.equal(flat_weights(profiled), flat_weights(reference))

    # Both sides above use DelayedWeights' machinery; a loop written out by hand checks the trajectory itself.
    hand_losses, hand_weights = _delayed_by_hand(tiny_gpt(), batches, num_microbatches=2)
    assert losses == pytest.approx(hand_losses, rel=1e-5)
    torch.testing.assert_close(flat_weights(profiled), hand_weights, rtol=1e-5, atol=1e-6)
    _, undelayed = _delayed_by_hand(tiny_gpt(), batches, num_microbatches=2, delay=0)
    assert not torch.allclose(hand_weights, undelayed, rtol=1e-4, atol=1e-5)


def _delayed_by_hand(model, batches, num_microbatches, delay=1):
    """The delayed trajectory as a plain loop: the step-t gradient of each micro-batch's mean loss, taken at
    w[t - delay] (w[-1] = w[0]), averaged over the micro-batches, stepped by the module's optimizer on w[t]."""
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    optimizer = model.configure_optimizers()
    history = [[p.detach().clone() for p in params]]
    losses = []
    for t, batch in enumerate(batches):
        stale = [w.clone().requires_grad_() for w in history[max(t - delay, 0)]]
        total = 0.0
        for micro in zip(*(x.chunk(num_microbatches) for x in batch)):
            output = functional_call(model, dict(zip(names, stale)), (model.pipeline_inputs(micro),))
            total = total + model.pipeline_loss(output, micro) / num_microbatches
        losses.append(total.item())
        for p, g in zip(params, torch.autograd.grad(total, stale)):
            p.grad = g
        optimizer.step()
        history.append([p.detach().clone() for p in params])
    return losses, flat_weights(model)


def test_history_holds_exactly_the_delayed_versions():
    model = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    profile = DelayProfile([[model.weight]], [2])  # w[0] = 0
    seen = []
    for step in range(4):
        with torch.no_grad():
            model.weight.fill_(float(step))  # w[t] = t

        def closure():
            seen.append(model.weight.detach().clone())
            return None

        profile.wrap_closure(closure)()
        assert torch.equal(model.weight, torch.full((2, 2), float(step)))
    # w[t-2] with w[-2] = w[-1] = w[0]
    assert [s[0, 0].item() for s in seen] == [0.0, 0.0, 0.0, 1.0]
    assert profile.steps == 4
    assert profile.extra_copies_numel() == 2 * 4


def test_restores_current_weights_when_the_closure_raises():
    model = tiny_mlp()
    profile = DelayProfile.pipedream(model, 3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    before = [p.detach().clone() for p in model.parameters()]

    def closure():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        profile.wrap_closure(closure)()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_pipedream_delays():
    assert pipedream_delays(1) == [0]
    assert pipedream_delays(4) == [3, 2, 1, 0]
    with pytest.raises(ValueError, match="positive integer"):
        pipedream_delays(0)


def test_split_into_stages_layers_and_parameters():
    model = tiny_mlp()  # parameter layers at 0, 2, 4 (Tanh has none)
    layers = list(model)
    stages = split_into_stages(layers, 3)
    assert [len(s) for s in stages] == [2, 2, 2]
    flat = [p for s in stages for p in s]
    assert [id(p) for p in flat] == [id(p) for p in model.parameters()]  # contiguous, in order, each once

    fine = split_into_stages(model, 6, granularity="parameter")
    assert [len(s) for s in fine] == [1] * 6
    assert [id(p) for s in fine for p in s] == [id(p) for p in model.parameters()]

    with pytest.raises(ValueError, match="only 5 layers"):
        split_into_stages(layers, 6)
    with pytest.raises(ValueError, match="granularity"):
        split_into_stages(layers, 2, granularity="block")


def test_pipedream_on_gpt_layers():
    gpt = tiny_gpt(n_layer=2)  # 4 pipeline layers: embedding, 2 blocks, head
    profile = DelayProfile.pipedream(gpt.pipeline_layers(), 4)
    assert profile.delays == [3, 2, 1, 0]
    assert [sum(p.numel() for p in g) for g in profile.groups] == [
        sum(p.numel() for p in layer.parameters()) for layer in gpt.pipeline_layers()
    ]
    assert profile.max_delay == 3
    deep = DelayProfile.pipedream(gpt.pipeline_layers(), 16, granularity="parameter")
    assert deep.delays == list(range(15, -1, -1))
    assert sum(len(g) for g in deep.groups) == len(list(gpt.parameters()))


def test_bad_arguments():
    model = tiny_mlp()
    w = model[0].weight
    with pytest.raises(ValueError, match="one delay per group"):
        DelayProfile([[w]], [1, 2])
    with pytest.raises(ValueError, match="non-negative"):
        DelayProfile([[w]], [-1])
    with pytest.raises(ValueError, match="more than one group"):
        DelayProfile([[w], [w]], [1, 0])
