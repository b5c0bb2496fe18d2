"""Configuration errors surface before any worker process starts, with a message that says what to change."""

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer

from lightning_async_pp import AsyncPipelineStrategy
from tests.fixtures.helpers import loader, random_batches, tiny_gpt


def trainer(devices=2, **strategy_kwargs):
    strategy_kwargs.setdefault("num_microbatches", 4)
    # "spawn": had a check been missed, workers would run the fit function, not re-run pytest.
    return Trainer(
        strategy=AsyncPipelineStrategy(start_method="spawn", **strategy_kwargs),
        accelerator="cpu",
        devices=devices,
        logger=False,
        enable_progress_bar=False,
        max_steps=1,
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
