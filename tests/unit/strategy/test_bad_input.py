import pytest
import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.exceptions import MisconfigurationException

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


def test_accumulate_grad_batches_is_refused():
    with pytest.raises(MisconfigurationException, match="num_microbatches"):
        fit(tiny_gpt(), random_batches(2), strategy=AsyncPipelineStrategy(), accumulate_grad_batches=2)


class PlainModule(LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        return self.net(batch[0].float()).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_microbatches_need_the_pipeline_contract():
    with pytest.raises(TypeError, match="pipeline_layers"):
        fit(PlainModule(), random_batches(2), strategy=AsyncPipelineStrategy(num_microbatches=2))


def test_plain_module_trains_delayed_with_one_microbatch():
    model = PlainModule()
    before = model.net.weight.detach().clone()
    losses = fit(model, random_batches(3), strategy=AsyncPipelineStrategy(schedule="2bw"))
    assert len(losses) == 3
    assert not torch.equal(before, model.net.weight)


def test_a_file_that_is_not_a_checkpoint_is_refused_on_one_device(tmp_path):
    notes = tmp_path / "notes.ckpt"
    notes.write_bytes(b"PK not really a zip")
    with pytest.raises(ValueError, match=r"not a checkpoint of this strategy.*\.distcp"):
        fit(tiny_gpt(), random_batches(2), strategy=AsyncPipelineStrategy(), ckpt_path=str(notes))
