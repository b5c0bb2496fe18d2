"""Measuring a model for ``python -m lightning_async_pp plan``: per-layer figures read on fake tensors.

Nothing is allocated or computed: the layers are copied onto fake tensors (shapes and dtypes only), and

- their optimizer state is what the model's own ``configure_optimizers`` creates when stepped once on meta
  parameters with meta gradients (so a new optimizer is counted as it is, Muon's routing and
  ``DelayCorrected``'s previous update included);
- their activations are the tensors each layer saves for backward (``torch.autograd.graph.saved_tensors_hooks``)
  on one micro-batch of the data module, under autocast when the precision is mixed; autocast's copies of the
  weights are told apart from the activations;
- their FLOPs are counted as the throughput monitor counts them (:func:`~.throughput.stage_flops`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.core.optimizer import _configure_optimizers
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_async_pp.optim.delay_corrected import STATE_KEY as CORRECTION_KEY
from lightning_async_pp.runtime.contract import run_layers
from lightning_async_pp.runtime.microbatch import map_tensors, tensors_of
from lightning_async_pp.runtime.ties import parameter_slots, retie
from lightning_async_pp.schedule.plan import LayerFigures, ParameterFigures
from lightning_async_pp.strategy.throughput import meta_layers, stage_flops

__all__ = ["ModelFigures", "measure_model", "optimizer_state_bytes"]


@dataclass
class ModelFigures:
    """What :func:`measure_model` reads of a model, at one micro-batch of ``microbatch_size`` samples."""

    layers: list[LayerFigures]
    names: list[str]
    loss_saved_bytes: int
    microbatch_size: int
    tokens_per_sample: int
    autocast: bool


def optimizer_state_bytes(module: LightningModule, max_steps: int) -> dict[str, tuple[int, int]]:
    """Bytes of optimizer state per parameter name, as the module's ``configure_optimizers`` creates it:
    ``(state, delay correction's previous update)``.

    The module's parameters must be on the meta device: the optimizers are stepped once on meta gradients, so
    nothing is allocated. A learning-rate schedule that reads the trainer sees a bare CPU trainer of
    ``max_steps`` steps.
    """
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max(1, max_steps),
        max_epochs=-1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module.trainer = trainer
    try:
        optimizers, _, _ = _configure_optimizers(module.configure_optimizers())
    finally:
        module.trainer = None
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    for optimizer in optimizers:
        optimizer.step()
    names = {id(p): name for name, p in module.named_parameters()}
    sizes: dict[str, tuple[int, int]] = {}
    for optimizer in optimizers:
        for param, state in optimizer.state.items():
            held = [0, 0]
            for key, value in state.items():
                for t in tensors_of(value):
                    held[key == CORRECTION_KEY] += t.numel() * t.element_size()
            before = sizes.get(names[id(param)], (0, 0))
            sizes[names[id(param)]] = (before[0] + held[0], before[1] + held[1])
    for p in params:
        p.grad = None
    return sizes


class _CastsOfWeights(TorchDispatchMode):
    """Records the storage of every copy of a weight made in another dtype (autocast's casts)."""

    def __init__(self, weights: dict[StorageWeakRef, str]) -> None:
        super().__init__()
        self.weights = weights
        self.casts: dict[StorageWeakRef, str] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and isinstance(args[0], Tensor):
            name = self.weights.get(StorageWeakRef(args[0].untyped_storage()))
            if name is not None:
                self.casts[StorageWeakRef(out.untyped_storage())] = name
        return out


def _storages(data: Any) -> dict[StorageWeakRef, int]:
    return {StorageWeakRef(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors_of(data)}


def _fake_layers(module: LightningModule, layers: Sequence[nn.Module], mode: FakeTensorMode) -> list[nn.Module]:
    """A copy of ``layers`` whose tensors are fake CPU tensors (so that CPU autocast applies), ties kept."""
    copies = meta_layers(module, layers)
    shared = parameter_slots(copies)
    with mode:
        for layer in copies:
            layer.to_empty(device="cpu")
    retie(shared)
    return copies


def _layer_figures(
    layer: nn.Module, names: dict[int, str], state: dict[str, tuple[int, int]], saved: dict, casts: dict, ends: tuple
) -> LayerFigures:
    inputs, outputs = ends
    weights = {StorageWeakRef(p.untyped_storage()) for p in layer.parameters()}
    cast_bytes = {casts[key]: size for key, size in saved.items() if key in casts}
    rest = sum(size for key, size in saved.items() if key not in weights | set(casts) | set(inputs) | set(outputs))
    parameters = {}
    for p in layer.parameters():
        name = names[id(p)]
        optimizer, correction = state.get(name, (0, 0))
        parameters[name] = ParameterFigures(
            p.numel(), p.numel() * p.element_size(), optimizer, cast_bytes.get(name, 0), correction
        )
    return LayerFigures(
        parameters=parameters,
        saved_bytes=rest,
        input_bytes=sum(inputs.values()),
        input_saved=any(key in saved for key in inputs),
        output_bytes=sum(outputs.values()),
        output_saved=any(key in saved for key in outputs),
        flops=0.0,
    )


def _layer_flops(module: LightningModule, layers: Sequence[nn.Module], microbatch: Any) -> list[float]:
    """Each layer's FLOPs for ``microbatch``, as the throughput monitor counts a stage's."""
    one_each = [range(i, i + 1) for i in range(len(layers))]
    meta = meta_layers(module, layers)
    return stage_flops(meta, one_each, module.pipeline_inputs, module.pipeline_loss, microbatch)


def measure_model(
    module: LightningModule,
    microbatch: Any,
    autocast_dtype: torch.dtype | None,
    optimizer_state: dict[str, tuple[int, int]],
) -> ModelFigures:
    """Every pipeline layer's figures for one ``microbatch`` (its tensors' shapes are what counts).

    Args:
        module: The model, built on the meta device.
        microbatch: One micro-batch of real (CPU) tensors.
        autocast_dtype: The dtype a mixed precision casts to, ``None`` without autocast.
        optimizer_state: Bytes of optimizer state and correction per parameter name (:func:`optimizer_state_bytes`).
    """
    layers = list(module.pipeline_layers())
    named = {id(p): n for n, p in module.named_parameters()}
    names = [type(layer).__name__ for layer in layers]
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = _fake_layers(module, layers, mode)
    fake_names = {id(c): named[id(o)] for f, g in zip(fakes, layers) for c, o in zip(f.parameters(), g.parameters())}
    weights = {StorageWeakRef(p.untyped_storage()): fake_names[id(p)] for f in fakes for p in f.parameters()}
    saved: dict[StorageWeakRef, int] = {}

    def pack(t: Tensor) -> Tensor:
        saved[StorageWeakRef(t.untyped_storage())] = t.untyped_storage().nbytes()
        return t

    figures = []
    autocast = torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast_dtype is not None)
    with torch.enable_grad(), mode, _CastsOfWeights(weights) as casts:
        batch = map_tensors(microbatch, mode.from_tensor)
        x = module.pipeline_inputs(batch)
        for layer in fakes:
            x = map_tensors(x, lambda t: t.detach().requires_grad_(t.is_floating_point()))
            saved.clear()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
                out = run_layers([layer], x, batch)
            ends = (_storages(x), _storages(out))
            figures.append(_layer_figures(layer, fake_names, optimizer_state, dict(saved), casts.casts, ends))
            x = out
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
            module.pipeline_loss(x, batch)
        loss_saved = sum(size for key, size in saved.items() if key not in _storages(x))
    flops = _layer_flops(module, layers, microbatch)
    figures = [LayerFigures(**{**vars(f), "flops": float(c)}) for f, c in zip(figures, flops, strict=True)]
    ids = [t for t in tensors_of(microbatch) if t.dim() >= 2 and not t.is_floating_point()]
    size = len(tensors_of(microbatch)[0])
    return ModelFigures(
        layers=figures,
        names=names,
        loss_saved_bytes=loss_saved,
        microbatch_size=size,
        tokens_per_sample=ids[0].shape[1] if ids else 1,
        autocast=autocast_dtype is not None,
    )
