"""The Lightning layer: ``AsyncPipelineStrategy`` and the modules it delegates to (the only layer that imports
``lightning.pytorch``)."""

from lightning_async_pp.strategy.strategy import AsyncPipelineStrategy

__all__ = ["AsyncPipelineStrategy"]
