"""Asynchronous (PipeDream-2BW) pipeline-parallel training for PyTorch Lightning.

Importing the package registers the strategy, so ``Trainer(strategy="async_pp")`` works.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_async_pp.module import PipelineModule
from lightning_async_pp.strategy import AsyncPipelineStrategy

__version__ = "0.1.0"
__all__ = ["AsyncPipelineStrategy", "PipelineModule", "__version__"]

# `override=True` keeps registration idempotent, also across `importlib.reload`.
StrategyRegistry.register(
    AsyncPipelineStrategy.strategy_name,
    AsyncPipelineStrategy,
    description="Pipeline parallelism with the asynchronous PipeDream-2BW schedule (one-step delay) or 1F1B",
    override=True,
)
