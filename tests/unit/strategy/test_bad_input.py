import pytest
import torch
from lightning.pytorch import LightningModule

from lightning_async_pp import AsyncPipelineStrategy
from tests.fixtures.helpers import fit, random_batches, tiny_gpt


@pytest.mark.parametrize("value", [0, -2, 1.5, True])
def test_num_microbatches_must_be_positive_int(value):
    with pytest.raises(ValueError, match="num_microbatches"):
        AsyncPipelineStrategy(num_microbatches=value)


def test_unknown_schedule_names_the_setting_and_choices():
    with pytest.raises(ValueError, match=r"schedule.*'2bw', '1f1b'"):
        AsyncPipelineStrategy(schedule="gpipe")


def test_batch_not_divisible_by_microbatches():
    batches = random_batches(2, batch_size=6)
    with pytest.raises(ValueError, match=r"6 samples.*num_microbatches=4"):
        fit(tiny_gpt(), batches, strategy=AsyncPipelineStrategy(num_microbatches=4))


class PlainModule(LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        return self.net(batch[0].float()).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_microbatches_need_the_pipeline_contract():
    with pytest.raises(TypeError, match="pipeline_layers"):
        fit(PlainModule(), random_batches(2), strategy=AsyncPipelineStrategy(num_microbatches=2))


def _sgd_trajectory(model, batches, delay):
    """Plain SGD by hand: each step's gradient is taken on the weights of ``delay`` steps before."""
    weights = [[p.detach().clone() for p in model.parameters()]]
    losses = []
    for t, batch in enumerate(batches):
        weight, bias = stale = [w.clone().requires_grad_() for w in weights[max(t - delay, 0)]]
        loss = torch.nn.functional.linear(batch[0].float(), weight, bias).pow(2).mean()
        losses.append(loss.item())
        grads = torch.autograd.grad(loss, stale)
        weights.append([w - 0.1 * g for w, g in zip(weights[-1], grads)])
    return losses, weights[-1]


def test_plain_module_trains_delayed_with_one_microbatch():
    """A module without the pipeline contract follows the one-step delayed trajectory, not the plain one."""
    batches = random_batches(4)
    delayed_losses, delayed = _sgd_trajectory(PlainModule(), batches, delay=1)
    _, plain = _sgd_trajectory(PlainModule(), batches, delay=0)
    model = PlainModule()
    losses = fit(model, batches, strategy=AsyncPipelineStrategy(schedule="2bw"))
    assert losses == pytest.approx(delayed_losses, rel=1e-6)
    for param, want, undelayed in zip(model.parameters(), delayed, plain):
        torch.testing.assert_close(param.detach(), want, rtol=1e-6, atol=1e-7)
        assert not torch.allclose(want, undelayed, rtol=1e-4, atol=1e-6)


def test_a_file_that_is_not_a_checkpoint_is_refused_on_one_device(tmp_path):
    notes = tmp_path / "notes.ckpt"
    notes.write_bytes(b"PK not really a zip")
    with pytest.raises(ValueError, match=r"not a checkpoint of this strategy.*\.distcp"):
        fit(tiny_gpt(), random_batches(2), strategy=AsyncPipelineStrategy(), ckpt_path=str(notes))
