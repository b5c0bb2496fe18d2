"""The strategy's single-device trajectories against independent plain-PyTorch loops."""

import pytest
import torch

from lightning_async_pp import AsyncPipelineStrategy
from lightning_async_pp.strategy.single_device import microbatch_losses
from tests.fixtures.helpers import fit, flat_weights, random_batches, tiny_gpt

STEPS = 6


def sgd(params):
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def reference_loop(model, batches, make_optimizer, delayed, num_microbatches=1):
    """w[t+1] = w[t] - u(grad f(w[t-1]), batch t) with w[-1] = w[0] (or w[t] if not delayed), by hand.

    Each micro-batch is backpropagated on its own with its loss divided by the count, as in the strategy,
    so that both sum the same floating-point numbers (Adam amplifies rounding differences of near-zero
    gradients).
    """
    params = list(model.parameters())
    optimizer = make_optimizer(model.named_parameters())
    previous = [p.detach().clone() for p in params]
    losses = []
    for batch in batches:
        current = [p.detach().clone() for p in params]
        if delayed:
            with torch.no_grad():
                for p, old in zip(params, previous):
                    p.copy_(old)
        optimizer.zero_grad()
        x, y = batch
        parts = zip(x.chunk(num_microbatches), y.chunk(num_microbatches))
        microbatch_losses = [model.pipeline_loss(model(xm), (xm, ym)) for xm, ym in parts]
        for part in microbatch_losses:
            (part / num_microbatches).backward()
        loss = torch.stack(microbatch_losses).mean()
        losses.append(loss.item())
        with torch.no_grad():
            for p, now in zip(params, current):
                p.copy_(now)
        previous = current
        optimizer.step()
    return losses


@pytest.mark.parametrize("make_optimizer", [sgd, adamw], ids=["sgd", "adamw"])
@pytest.mark.parametrize("num_microbatches", [1, 2])
def test_2bw_equals_hand_written_delayed_loop(make_optimizer, num_microbatches):
    batches = random_batches(STEPS)
    reference = tiny_gpt()
    expected_losses = reference_loop(
        reference, batches, make_optimizer, delayed=True, num_microbatches=num_microbatches
    )

    model = tiny_gpt(optimizer=make_optimizer)
    strategy = AsyncPipelineStrategy(schedule="2bw", num_microbatches=num_microbatches)
    losses = fit(model, batches, strategy=strategy)

    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(flat_weights(model), flat_weights(reference), rtol=1e-6, atol=1e-6)


def test_2bw_differs_from_synchronous():
    """Guards the test above against a delay that silently does nothing."""
    batches = random_batches(STEPS)
    delayed, sync = tiny_gpt(optimizer=sgd), tiny_gpt(optimizer=sgd)
    fit(delayed, batches, strategy=AsyncPipelineStrategy(schedule="2bw"))
    fit(sync, batches, strategy=AsyncPipelineStrategy(schedule="1f1b"))
    assert (flat_weights(delayed) - flat_weights(sync)).abs().max() > 1e-4


# Micro-batching with Adam would compare rounding noise amplified by Adam, not the schedule.
@pytest.mark.parametrize(("make_optimizer", "num_microbatches"), [(sgd, 2), (adamw, 1)], ids=["sgd", "adamw"])
def test_1f1b_equals_plain_lightning(make_optimizer, num_microbatches):
    batches = random_batches(STEPS)
    plain, piped = tiny_gpt(optimizer=make_optimizer), tiny_gpt(optimizer=make_optimizer)
    plain_losses = fit(plain, batches)
    piped_losses = fit(
        piped, batches, strategy=AsyncPipelineStrategy(schedule="1f1b", num_microbatches=num_microbatches)
    )
    torch.testing.assert_close(torch.tensor(piped_losses), torch.tensor(plain_losses), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(flat_weights(piped), flat_weights(plain), rtol=1e-6, atol=1e-6)


def test_1f1b_equals_hand_written_synchronous_loop():
    batches = random_batches(STEPS)
    reference = tiny_gpt()
    expected = reference_loop(reference, batches, adamw, delayed=False)
    model = tiny_gpt(optimizer=adamw)
    losses = fit(model, batches, strategy=AsyncPipelineStrategy(schedule="1f1b"))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(flat_weights(model), flat_weights(reference), rtol=1e-6, atol=1e-6)


def test_microbatch_gradient_equals_full_batch_gradient():
    model = tiny_gpt()
    batch = random_batches(1)[0]
    strategy = AsyncPipelineStrategy(num_microbatches=4)
    for loss in microbatch_losses(model, batch, strategy.num_microbatches):
        (loss / 4).backward()
    split = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.pipeline_loss(model(batch[0]), batch).backward()
    for g_split, p in zip(split, model.parameters()):
        torch.testing.assert_close(g_split, p.grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("schedule", ["2bw", "1f1b"])
def test_four_microbatches_give_the_same_update_as_one(schedule):
    batches = random_batches(STEPS)
    one, four = tiny_gpt(optimizer=sgd), tiny_gpt(optimizer=sgd)
    losses_one = fit(one, batches, strategy=AsyncPipelineStrategy(schedule=schedule, num_microbatches=1))
    losses_four = fit(four, batches, strategy=AsyncPipelineStrategy(schedule=schedule, num_microbatches=4))
    torch.testing.assert_close(torch.tensor(losses_four), torch.tensor(losses_one), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(flat_weights(four), flat_weights(one), rtol=1e-6, atol=1e-6)


def test_last_gradient_is_applied_when_fit_ends():
    """After T steps the weights are w[T]: the gradient of batch T-1 has been applied."""
    batches = random_batches(3)
    model = tiny_gpt(optimizer=sgd)
    fit(model, batches[:2], strategy=AsyncPipelineStrategy(schedule="2bw"))
    after_two = flat_weights(model).clone()
    reference = tiny_gpt()
    reference_loop(reference, batches[:1], sgd, delayed=True)
    # One step fewer in the reference must not match, the full count must.
    assert not torch.allclose(after_two, flat_weights(reference))
    reference = tiny_gpt()
    reference_loop(reference, batches[:2], sgd, delayed=True)
    torch.testing.assert_close(after_two, flat_weights(reference), rtol=1e-6, atol=1e-6)
