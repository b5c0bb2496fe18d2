"""Command line: a ``LightningCLI`` that knows the ``async_pp`` strategy.

    python -m lightning_async_pp fit --config examples/configs/quickstart.yaml
    async-pp fit --config examples/configs/quickstart.yaml --trainer.max_steps 50
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger

import lightning_async_pp  # noqa: F401  (registers strategy="async_pp")


class AsyncPipelineCLI(LightningCLI):
    """``LightningCLI`` whose model and data are given by ``class_path`` in the config."""

    def after_fit(self) -> None:
        logger = self.trainer.logger
        if isinstance(logger, TensorBoardLogger) and self.trainer.is_global_zero:
            print(f"\nTensorBoard logs: {logger.log_dir}\nView them with: tensorboard --logdir {logger.save_dir}")


def main(args: Sequence[str] | None = None) -> AsyncPipelineCLI:
    return AsyncPipelineCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=list(args) if args is not None else None,
    )
