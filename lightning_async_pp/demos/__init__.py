"""Demo model and data, importable by ``class_path`` from YAML configs."""

from lightning_async_pp.demos.data import TextDataModule
from lightning_async_pp.demos.gpt import GPT

__all__ = ["GPT", "TextDataModule"]
