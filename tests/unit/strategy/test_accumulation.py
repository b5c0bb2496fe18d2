"""Gradient accumulation on one device: k batches of M micro-batches are one optimizer step of k x M micro-batches,
the delay counting optimizer steps; optimizers that re-evaluate their closure."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_async_pp import AsyncPipelineStrategy
from lightning_async_pp.reference import DelayedWeights
from lightning_async_pp.strategy.launch import check_train_loader
from lightning_async_pp.strategy.optimizer_steps import needs_closure
from tests.fixtures.helpers import fit, random_batches, tiny_gpt
from tests.unit.strategy.test_launch import _loader


def sgd(params):
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


class StepLosses(Callback):
    """``train/loss`` as the loggers see it: at each optimizer step."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self._step = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self._step:
            self._step = trainer.global_step
            self.losses.append(float(trainer.callback_metrics["train/loss"]))


def joined(batches, k):
    """Every ``k`` consecutive batches as one batch."""
    return [tuple(torch.cat(parts) for parts in zip(*batches[i : i + k])) for i in range(0, len(batches), k)]


def weights(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def assert_same(a, b):
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize(
    ("schedule", "microbatches", "optimizer"),
    [("2bw", 2, adamw), ("1f1b", 2, sgd)],
    ids=["2bw-M2-adamw", "1f1b-M2-sgd"],
)
def test_k_batches_of_m_microbatches_are_one_step_of_k_times_m(schedule, microbatches, optimizer):
    k, steps = 2, 3
    batches = random_batches(k * steps)
    accumulated, recorder = tiny_gpt(optimizer=optimizer), StepLosses()
    strategy = AsyncPipelineStrategy(schedule=schedule, num_microbatches=microbatches)
    fit(accumulated, batches, strategy=strategy, max_steps=steps, accumulate_grad_batches=k, callbacks=[recorder])

    reference, expected = tiny_gpt(optimizer=optimizer), StepLosses()
    strategy = AsyncPipelineStrategy(schedule=schedule, num_microbatches=k * microbatches)
    fit(reference, joined(batches, k), strategy=strategy, callbacks=[expected])

    assert_same(weights(accumulated), weights(reference))
    assert recorder.losses == expected.losses and len(expected.losses) == steps


def delayed_loop(model, steps, make_optimizer, divisors):
    """``w[t+1] = w[t] - u(grad f(w[t-1]), step t)`` by hand, through the reference's ``DelayedWeights``: each step
    a list of micro-batches, each one's loss divided by the step's divisor."""
    optimizer = make_optimizer(model.named_parameters())
    delayed = DelayedWeights(model)
    for microbatches, divisor in zip(steps, divisors):

        def closure(microbatches=microbatches, divisor=divisor):
            optimizer.zero_grad()
            for mb in microbatches:
                (model.pipeline_loss(model(model.pipeline_inputs(mb)), mb) / divisor).backward()

        optimizer.step(delayed.wrap_closure(closure))


def test_the_accumulation_scheduler_and_a_short_last_window_follow_lightning():
    """k = 1 in the first epoch and 3 in the second, whose 4 batches leave a last window of 1 that Lightning steps
    with its loss divided by 3, as it does every window's: the delayed trajectory of those steps, by hand."""
    batches = random_batches(4)
    model = tiny_gpt(optimizer=sgd)
    scheduler = GradientAccumulationScheduler({1: 3})
    strategy = AsyncPipelineStrategy(schedule="2bw", num_microbatches=2)
    fit(model, batches, strategy=strategy, max_steps=-1, max_epochs=2, callbacks=[scheduler])

    def micro(indices):
        return [tuple(t.chunk(2)[i] for t in batches[b]) for b in indices for i in range(2)]

    windows = [[0], [1], [2], [3], [0, 1, 2], [3]]
    reference = tiny_gpt()
    delayed_loop(reference, [micro(w) for w in windows], sgd, [2, 2, 2, 2, 6, 6])
    assert_same(weights(model), weights(reference))


def test_resuming_inside_an_accumulation_window_is_refused(tmp_path):
    batches = random_batches(4)

    class SaveInsideWindow(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if batch_idx == 2:  # the first batch of the second window
                trainer.save_checkpoint(tmp_path / "inside.ckpt")

    strategy = AsyncPipelineStrategy(schedule="2bw", num_microbatches=1)
    fit(tiny_gpt(), batches, strategy=strategy, max_steps=2, accumulate_grad_batches=2, callbacks=[SaveInsideWindow()])
    with pytest.raises(MisconfigurationException, match=r"resumed at batch 3 .*accumulate_grad_batches=2.*first 1"):
        fit(
            tiny_gpt(),
            batches,
            strategy=AsyncPipelineStrategy(schedule="2bw", num_microbatches=1),
            max_steps=2,
            accumulate_grad_batches=2,
            ckpt_path=str(tmp_path / "inside.ckpt"),
        )


def test_max_steps_counts_optimizer_steps_when_checking_the_last_batch():
    """66 samples in batches of 8: 9 batches, the last of 2 samples, which 4 micro-batches cannot split."""
    check_train_loader(_loader(66, 8), 4, num_stages=4, replicas=1, max_steps=4, accumulate=2)  # 8 batches
    with pytest.raises(ValueError, match="last batch of every epoch holds 2 samples"):
        check_train_loader(_loader(66, 8), 4, num_stages=4, replicas=1, max_steps=5, accumulate=2)


def lbfgs(params):
    return torch.optim.LBFGS([p for _, p in params], lr=0.1, max_iter=3)


def test_an_optimizer_that_needs_its_closure_is_refused_under_2bw():
    assert needs_closure(lbfgs(tiny_gpt().named_parameters()))
    assert not needs_closure(sgd(tiny_gpt().named_parameters()))
    with pytest.raises(MisconfigurationException, match=r"`LBFGS.step` needs a closure.*one-step delay.*'1f1b'"):
        fit(tiny_gpt(optimizer=lbfgs), random_batches(2), strategy=AsyncPipelineStrategy(schedule="2bw"))


def test_a_second_closure_evaluation_in_one_delayed_step_is_refused():
    """An optimizer whose closure is optional but that evaluates it twice (a line search) stops at once."""

    class TwoEvaluations(torch.optim.SGD):
        def step(self, closure=None):
            closure()
            return super().step(closure)

    with pytest.raises(RuntimeError, match="evaluated its closure a second time"):
        fit(
            tiny_gpt(optimizer=lambda params: TwoEvaluations(params, lr=0.1)),
            random_batches(2),
            strategy=AsyncPipelineStrategy(schedule="2bw"),
        )


def test_lbfgs_on_one_device_without_a_delay_is_plain_lightning():
    batches = random_batches(2)
    pipeline, plain = tiny_gpt(optimizer=lbfgs), tiny_gpt(optimizer=lbfgs)
    pipeline_losses = fit(pipeline, batches, strategy=AsyncPipelineStrategy(schedule="1f1b", num_microbatches=1))
    plain_losses = fit(plain, batches)
    assert_same(weights(pipeline), weights(plain))
    assert pipeline_losses == plain_losses
    assert (
        torch.cat([p.reshape(-1) for p in weights(plain).values()])
        - torch.cat([p.reshape(-1) for p in weights(tiny_gpt()).values()])
    ).abs().max() > 1e-3  # it trained
