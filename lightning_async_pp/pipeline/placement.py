"""Keeping only a stage's layers on a rank, and materialising them from the meta device."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn


class RemoteLayer(nn.Module):
    """Stands in for a layer that lives on another stage; it owns no parameters and cannot run."""

    def __init__(self, index: int, stage: int) -> None:
        super().__init__()
        self.index = index
        self.stage = stage

    def forward(self, x: Tensor) -> Tensor:
        raise RuntimeError(
            f"Layer {self.index} lives on pipeline stage {self.stage}, not in this process. Under "
            "AsyncPipelineStrategy with several devices, call the model only through the strategy."
        )

    def extra_repr(self) -> str:
        return f"layer={self.index}, stage={self.stage}"


def _replace(root: nn.Module, target: nn.Module, replacement: nn.Module) -> None:
    for name, module in root.named_modules(remove_duplicate=False):
        if module is target and name:
            parent_name, _, attribute = name.rpartition(".")
            setattr(root.get_submodule(parent_name), attribute, replacement)
            return
    raise ValueError(
        f"A pipeline layer of type {type(target).__name__} is not a submodule of {type(root).__name__}. "
        "`pipeline_layers()` must return modules registered on the LightningModule (e.g. in an nn.ModuleList)."
    )


def keep_only_layers(root: nn.Module, layers: Sequence[nn.Module], keep: range, owner_of: Sequence[int]) -> None:
    """Replace every layer outside ``keep`` by a :class:`RemoteLayer`, freeing its parameters here."""
    for index, layer in enumerate(layers):
        if index not in keep:
            _replace(root, layer, RemoteLayer(index, owner_of[index]))


def is_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


@torch.no_grad()
def materialize(root: nn.Module, index: int, layer: nn.Module, device: torch.device) -> None:
    """Allocate a meta-device layer on ``device`` and initialise it.

    Uses ``root.reset_pipeline_layer(index, layer)`` when the model defines it (so every stage initialises
    its layers exactly as the whole model would), otherwise each submodule's ``reset_parameters()``.
    """
    layer.to_empty(device=device)
    reset = getattr(root, "reset_pipeline_layer", None)
    if callable(reset):
        reset(index, layer)
        return
    for module in layer.modules():
        if callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()
