import importlib

import pytest
import yaml
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.strategies import StrategyRegistry

import lightning_async_pp
from lightning_async_pp import AsyncPipelineStrategy
from lightning_async_pp.cli import AsyncPipelineCLI


def test_registered_on_import_and_idempotent():
    assert "async_pp" in StrategyRegistry
    importlib.reload(lightning_async_pp)
    assert "async_pp" in StrategyRegistry
    assert StrategyRegistry["async_pp"]["strategy"].__name__ == "AsyncPipelineStrategy"


def test_trainer_resolves_name():
    trainer = Trainer(strategy="async_pp", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, lightning_async_pp.AsyncPipelineStrategy)
    assert trainer.strategy.schedule == "2bw"
    assert trainer.strategy.num_microbatches == 1


def test_yaml_class_path_sets_arguments(tmp_path):
    config = {
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "logger": False,
            "strategy": {
                "class_path": "lightning_async_pp.AsyncPipelineStrategy",
                "init_args": {"schedule": "1f1b", "num_microbatches": 4},
            },
        },
        "model": {"class_path": "lightning_async_pp.demos.GPT", "init_args": {"n_layer": 1, "n_embd": 16}},
        "data": {"class_path": "lightning_async_pp.demos.TextDataModule"},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = AsyncPipelineCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=["--config", str(path)],
        run=False,
    )
    strategy = cli.trainer.strategy
    assert isinstance(strategy, AsyncPipelineStrategy)
    assert (strategy.schedule, strategy.num_microbatches) == ("1f1b", 4)


def test_2bw_with_fewer_microbatches_than_stages_fails_before_launch():
    with pytest.raises(ValueError, match="num_microbatches >= 2"):
        Trainer(strategy=AsyncPipelineStrategy(num_microbatches=1), accelerator="cpu", devices=2, logger=False)
