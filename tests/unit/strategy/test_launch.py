"""Configuration errors surface before any worker process starts, with a message that says what to change."""

import pytest
import torch
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_async_pp import AsyncPipelineStrategy
from lightning_async_pp.strategy.launch import check_datamodule, check_train_loader
from tests.fixtures.helpers import loader, random_batches, tiny_gpt


def trainer(devices=2, trainer_kwargs=None, **strategy_kwargs):
    strategy_kwargs.setdefault("num_microbatches", 4)
    # "spawn": had a check been missed, workers would run the fit function, not re-run pytest.
    return Trainer(
        strategy=AsyncPipelineStrategy(start_method="spawn", **strategy_kwargs),
        accelerator="cpu",
        devices=devices,
        logger=False,
        enable_progress_bar=False,
        **{"max_steps": 1, **(trainer_kwargs or {})},
    )


class NoContract(LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 4)


def test_more_stages_than_layers():
    with pytest.raises(ValueError, match="only 3 layers"):
        trainer(devices=4).fit(tiny_gpt(n_layer=1), loader(random_batches(1)))


def test_model_without_contract():
    with pytest.raises(TypeError, match="pipeline_layers"):
        trainer().fit(NoContract(), loader(random_batches(1)))


def test_split_points_out_of_range():
    with pytest.raises(ValueError, match="split point"):
        trainer(split_points=[9]).fit(tiny_gpt(), loader(random_batches(1)))


def test_fp16_is_refused():
    # On CPU Lightning turns "16-mixed" into bf16 itself; "16-true" stays fp16.
    t = Trainer(
        strategy=AsyncPipelineStrategy(start_method="spawn", num_microbatches=4),
        accelerator="cpu",
        devices=2,
        logger=False,
        precision="16-true",
        max_steps=1,
    )
    with pytest.raises(Exception, match="bf16-mixed"):
        t.fit(tiny_gpt(), loader(random_batches(1)))


def test_microbatches_fewer_than_stages():
    with pytest.raises(ValueError, match="num_microbatches >= 4"):
        Trainer(strategy=AsyncPipelineStrategy(num_microbatches=2), accelerator="cpu", devices=4, logger=False)


def test_a_file_that_is_not_a_checkpoint_is_refused_before_any_process_starts(tmp_path):
    notes = tmp_path / "notes.ckpt"
    notes.write_text("not a checkpoint\n")
    with pytest.raises(ValueError, match=r"not a checkpoint of this strategy.*a directory.*\.metadata.*meta\.pt"):
        trainer().fit(tiny_gpt(), loader(random_batches(1)), ckpt_path=str(notes))


@pytest.fixture
def no_launch(monkeypatch):
    """Starting a worker process fails the test: these refusals must come before any process starts."""

    def start_processes(*args, **kwargs):
        raise AssertionError("a worker process was started before the refusal")

    monkeypatch.setattr(torch.multiprocessing, "start_processes", start_processes)


@pytest.mark.parametrize(
    ("trainer_kwargs", "match"),
    [
        ({"gradient_clip_val": 1.0, "gradient_clip_algorithm": "value"}, "global gradient norm only.*'value'.*'norm'"),
    ],
    ids=["clip-by-value"],
)
def test_trainer_settings_are_refused_before_any_process_starts(no_launch, trainer_kwargs, match):
    with pytest.raises(Exception, match=match):
        trainer(trainer_kwargs=trainer_kwargs).fit(tiny_gpt(), loader(random_batches(1)))


def test_time_balance_without_an_example_input_is_refused_before_any_process_starts(no_launch):
    model = tiny_gpt()
    assert getattr(model, "example_input_array", None) is None
    with pytest.raises(Exception, match="example_input_array"):
        trainer(balance="time").fit(model, loader(random_batches(1)))


def _loader(samples: int, batch_size: int, drop_last: bool = False) -> DataLoader:
    return DataLoader(TensorDataset(torch.zeros(samples, 4)), batch_size=batch_size, drop_last=drop_last)


@pytest.mark.parametrize(
    ("loader", "microbatches", "replicas", "match"),
    [
        (_loader(64, 6), 4, 1, "batch_size=6 cannot be split into num_microbatches=4"),
        (_loader(66, 8), 4, 1, r"last batch of every epoch holds 2 samples \(66 samples in batches of 8\).*drop_last"),
        (_loader(70, 8), 4, 2, r"holds 3 samples \(35 samples per replica \(of 2\) in batches of 8\)"),
        (_loader(62, 8), None, 1, "holds 6 samples.*num_microbatches=4"),  # "auto" takes 4 for 4 stages and 8
    ],
)
def test_a_loader_whose_batches_cannot_be_split_is_refused(loader, microbatches, replicas, match):
    with pytest.raises(ValueError, match=match):
        check_train_loader(loader, microbatches, num_stages=4, replicas=replicas)


@pytest.mark.parametrize(
    ("loader", "limits"),
    [
        (_loader(64, 8), {}),
        (_loader(66, 8, drop_last=True), {}),
        (_loader(68, 8), {}),  # the last batch of 4 samples splits into 4
        (_loader(66, 8), {"max_steps": 8}),  # the run ends before the short batch
        (_loader(66, 8), {"limit_batches": 8}),
        (_loader(66, 8), {"limit_batches": 0.5}),
    ],
)
def test_a_loader_whose_batches_split_or_are_never_reached_passes(loader, limits):
    check_train_loader(loader, 4, num_stages=4, replicas=1, **limits)


def test_a_short_last_batch_is_refused_before_any_process_starts(no_launch):
    tokens, targets = random_batches(1, batch_size=10)[0]
    t = trainer(trainer_kwargs={"max_steps": -1, "max_epochs": 1})
    with pytest.raises(ValueError, match=r"holds 2 samples \(10 samples in batches of 4\).*drop_last=True"):
        t.fit(tiny_gpt(), DataLoader(TensorDataset(tokens, targets), batch_size=4))


class _HparamsData(LightningDataModule):
    def __init__(self, batch_size: int = 8):
        super().__init__()
        self.save_hyperparameters()


def test_a_data_modules_batch_size_is_read_from_its_attribute_or_hyperparameters():
    with pytest.raises(ValueError, match=r"_HparamsData's batch_size=6 cannot be split into num_microbatches=4"):
        check_datamodule(_HparamsData(batch_size=6), 4, num_stages=2)
    check_datamodule(_HparamsData(batch_size=8), 4, num_stages=2)
    check_datamodule(LightningDataModule(), 4, num_stages=2)  # no batch size to check: checked batch by batch
    with pytest.raises(ValueError, match="num_microbatches='auto' needs at least one sample per pipeline stage"):
        check_datamodule(_HparamsData(batch_size=2), None, num_stages=4)
