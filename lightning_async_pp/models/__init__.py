"""Language models from other libraries as pipeline-ready ``LightningModule``s.

:class:`CausalLM` wraps a Hugging Face ``transformers`` decoder-only causal LM (Llama, Gemma, Phi-3, OLMo 2, ...:
those found by their structure whose cut passes its proof, :mod:`lightning_async_pp.models.hf_structure`) and
:class:`TokenizedTextDataModule` feeds it packed token sequences, :class:`TokenFileDataModule` random windows of a
pre-tokenized flat token file. ``transformers`` is an optional extra
(``pip install "lightning-async-pp[hf]"``): it is imported when one of these names is first used, never by
``import lightning_async_pp``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CausalLM", "TokenFileDataModule", "TokenizedTextDataModule"]


def __getattr__(name: str) -> Any:
    if name == "CausalLM":
        from lightning_async_pp.models.hf import CausalLM

        return CausalLM
    if name == "TokenizedTextDataModule":
        from lightning_async_pp.models.data import TokenizedTextDataModule

        return TokenizedTextDataModule
    if name == "TokenFileDataModule":
        from lightning_async_pp.models.tokens import TokenFileDataModule

        return TokenFileDataModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
