"""A ``save_pretrained`` folder's tensors, read under the model's names as ``transformers`` reads them.

A folder does not always store a tensor under the name it has in the model ``transformers`` builds: GPT-NeoX
stores its head as ``embed_out.weight`` (the model's ``lm_head.weight``), Mixtral its MLPs as
``block_sparse_moe`` with one matrix per expert (the model stacks them into ``experts.gate_up_proj``), EXAONE
under the older ``transformer.h.*`` names, and a folder written from a base model has no ``base_model_prefix``.
``from_pretrained`` converts each family's keys with the conversions ``transformers`` registers for it
(``transformers.conversion_mapping``: renamings, and converters that merge, split or concatenate tensors), and
``save_pretrained`` writes them back through the reverse conversions.

:class:`StoredTensors` applies the same conversions, with ``transformers``' own functions and tables, to the
folder's key list: it knows, for each model tensor, which stored tensors make it and how, and reads only those a
pipeline stage asks for. Writing back needs nothing of ours: :func:`lightning_async_pp.models.hf.save_pretrained`
writes through ``transformers``' ``save_pretrained``, which applies the reverse conversions.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from torch import Tensor, nn

if TYPE_CHECKING:
    from transformers.core_model_loading import WeightConverter


class TensorFiles(Protocol):
    """What :class:`StoredTensors` reads from: the folder's keys, and the tensors stored under some of them."""

    folder: Path

    def tensors(self, keys: Iterable[str]) -> dict[str, Tensor]: ...


class StoredTensors:
    """The model tensors a folder holds, each with the stored tensors that make it and ``transformers``'
    conversion between them.

    Args:
        model: The ``transformers`` model (on the meta device) whose names the tensors are read under.
        stored: The keys the folder stores.
        files: Where the stored tensors are read from.
    """

    def __init__(self, model: nn.Module, stored: Iterable[str], files: TensorFiles) -> None:
        # transformers is imported where it is used: only models/hf.py imports it when its module is imported
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

        self.model = model
        self.files = files
        conversions = get_model_conversion_mapping(model)  # what from_pretrained applies, legacy renamings included
        renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
        converters = [c for c in conversions if isinstance(c, WeightConverter)]
        by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
        names = model.state_dict()
        prefix = getattr(model, "base_model_prefix", None)
        self.renamed: dict[str, str] = {}  # model name -> stored key, stored as it is (perhaps under another name)
        self.converted: dict[str, Converted] = {}  # model name -> the conversion that makes it
        for key in sorted(stored, key=dot_natural_key):  # in transformers' order: experts 0, 1, ..., 10
            name, pattern = rename_source_key(key, renamings, converters, prefix, names)
            if name not in names and key in names:
                name, pattern = rename_source_key(key, [], [], prefix, names)
            if name not in names:
                continue  # a tensor the model does not have (transformers reports it as unexpected)
            if pattern is None:
                self.renamed[name] = key
                continue
            if name not in self.converted:
                converter = by_pattern[pattern]
                conversion = Converted(name, copy.deepcopy(converter))
                for target in conversion.targets:
                    self.converted[target] = conversion
            self.converted[name].sources.setdefault(pattern, []).append(key)

    def __contains__(self, name: str) -> bool:
        return name in self.renamed or name in self.converted

    def stored_keys(self, name: str) -> list[str]:
        """The stored keys that make the model tensor ``name``."""
        if name in self.renamed:
            return [self.renamed[name]]
        return [key for keys in self.converted[name].sources.values() for key in keys]

    def load(self, targets: Mapping[str, Tensor]) -> None:
        """Fill each (materialised) model tensor, given by its ``transformers`` name, from the folder."""
        direct = {self.renamed[name]: target for name, target in targets.items() if name in self.renamed}
        for key, value in self.files.tensors(direct).items():
            _copy(direct[key], value, f"{key} in {self.files.folder}")
        conversions = {id(self.converted[name]): self.converted[name] for name in targets if name not in self.renamed}
        for conversion in conversions.values():
            for name, value in conversion.run(self.model, self.files).items():
                if name in targets:
                    what = f"{name} (from {', '.join(conversion.keys())}) in {self.files.folder}"
                    _copy(targets[name], value, what)


class Converted:
    """One ``transformers`` converter applied to the stored tensors of one target (e.g. a layer's experts)."""

    def __init__(self, name: str, converter: WeightConverter) -> None:
        self.name = name
        self.converter = converter
        first = converter.target_patterns[0]
        # A one-to-many converter (a fused matrix split in two) names its first target; the others follow.
        self.targets = [name.replace(first, target) for target in converter.target_patterns]
        self.sources: dict[str, list[str]] = {}

    def keys(self) -> list[str]:
        return [key for keys in self.sources.values() for key in keys]

    def run(self, model: nn.Module, files: TensorFiles) -> dict[str, Tensor]:
        """Read the stored tensors and convert them as ``from_pretrained`` does: the model tensors they make."""
        values = files.tensors(self.keys())
        converter = copy.deepcopy(self.converter)
        for pattern, keys in self.sources.items():
            for key in keys:
                converter.add_tensor(self.name, key, pattern, values[key])
        made = converter.convert(self.name, model=model, config=getattr(model, "config", None))
        return {name: value[0] if isinstance(value, list) else value for name, value in made.items()}


def _copy(target: Tensor, value: Tensor, what: str) -> None:
    if tuple(value.shape) != tuple(target.shape):
        raise ValueError(
            f"{what} has shape {tuple(value.shape)}, the model expects {tuple(target.shape)}: the "
            "folder's config.json does not match its weights."
        )
    target.copy_(value)


__all__ = ["StoredTensors"]
