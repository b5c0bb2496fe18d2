"""Throughput and model FLOPs utilization (MFU) of a whole pipeline, logged on global rank 0.

Lightning's ``ThroughputMonitor`` takes one process's throughput and multiplies it by the number of processes.
In a pipeline the ``P`` stages of a replica work on the same samples, so that overcounts by ``P``; and each
process holds one stage, so no single process can count the model's FLOPs. Here a job of ``D`` replicas of
``P`` stages (``P x D`` devices) is counted as such:

- ``tokens/s of the job = D x tokens of one replica's batch x steps / seconds`` (``samples`` when the batch has
  no token dimension), the seconds being rank 0's wall time between the ends of the logged steps, without
  validation;
- ``FLOPs per token = sum over the stages of the FLOPs of one micro-batch, forward and backward, through that
  stage's layers / the micro-batch's tokens``, counted once by ``torch.utils.flop_counter.FlopCounterMode``
  (Lightning's :func:`~lightning.fabric.utilities.throughput.measure_flops`) on a copy of the model's layers on
  the meta device, so nothing runs and no weight or gradient is touched;
- ``MFU = FLOPs per token x tokens/s of the job / (peak FLOP/s of one device x P x D)``.

These are *model* FLOPs: activation checkpointing's recomputation, which the strategy adds, is not counted
(torch.utils.checkpoint inside a layer's own ``forward`` is). The peak is the one the user gives
(``PipelineThroughputMonitor(peak_flops=...)``), else the bfloat16 dense tensor-core figure of the device's
data sheet (:data:`PEAK_BF16_FLOPS`; Lightning's ``get_available_flops`` for other GPUs); none on CPU, where
MFU is not logged unless a peak is given. MFU against the bfloat16 peak is the usual convention (PaLM,
torchtitan), whatever the training precision.

With several processes the strategy adds a :class:`PipelineThroughputMonitor` to the trainer when the user has
not and the trainer has a logger (:func:`install_throughput_monitor`), and says so;
``AsyncPipelineStrategy(throughput_monitor=False)`` leaves it out, ``True`` adds it on one device too (where
Lightning's own ``ThroughputMonitor`` counts right). Give one in ``trainer.callbacks`` (or the CLI's
``trainer.callbacks`` in YAML) to set its arguments. Its values are logged through Lightning
(``LightningModule.log``), so they reach the loggers in the same calls as the module's own metrics, at the steps
``log_every_n_steps`` chooses.
"""

from __future__ import annotations

import copy
import logging
import re
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from lightning.fabric.utilities.throughput import get_available_flops, measure_flops
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from typing_extensions import override

from lightning_async_pp.runtime.contract import is_pipeline_module, run_layers
from lightning_async_pp.runtime.microbatch import batch_size_of, map_tensors, split_microbatches, tensors_of
from lightning_async_pp.runtime.recompute import _MARK as _RECOMPUTED
from lightning_async_pp.strategy.placement import RemoteLayer

__all__ = [
    "PEAK_BF16_FLOPS",
    "PipelineThroughputMonitor",
    "count_items",
    "install_throughput_monitor",
    "meta_layers",
    "peak_flops_by_name",
    "peak_flops_of",
    "stage_flops",
    "throughput_metrics",
]

log = logging.getLogger("lightning.pytorch.strategies.async_pp")

Unit = Literal["auto", "tokens", "samples"]

# Dense (no sparsity) bfloat16 tensor-core FLOP/s of one device, from the vendors' data sheets, which print
# twice these figures "with sparsity". Matched against the words of `torch.cuda.get_device_name`: (chip,
# variant or None, FLOP/s), the first match wins, so a variant comes before its chip's default.
PEAK_BF16_FLOPS: list[tuple[str, str | None, float]] = [
    ("h100", "nvl", 835e12),  # H100 NVL
    ("h100", "pcie", 756e12),  # H100 PCIe
    ("h100", None, 989.4e12),  # H100 SXM ("NVIDIA H100 80GB HBM3")
    ("h200", "nvl", 835e12),  # H200 NVL
    ("h200", None, 989.4e12),  # H200 SXM ("NVIDIA H200"); GH200 too
    ("gh200", None, 989.4e12),
    ("b200", None, 2250e12),  # HGX B200
    ("a100", None, 312e12),  # SXM and PCIe alike
    ("l40s", None, 362e12),
    ("l40", None, 181e12),
    ("l4", None, 121e12),
    ("mi300x", None, 1307.4e12),  # AMD Instinct MI300X
]


def peak_flops_by_name(name: str) -> float | None:
    """The :data:`PEAK_BF16_FLOPS` entry for a device named ``name`` (as ``torch.cuda.get_device_name`` spells
    it), ``None`` when the table has none."""
    words = set(re.split(r"[^a-z0-9]+", name.lower()))
    for chip, variant, flops in PEAK_BF16_FLOPS:
        if chip in words and (variant is None or variant in words):
            return flops
    return None


def peak_flops_of(device: torch.device, given: float | None = None) -> tuple[float | None, str]:
    """The peak FLOP/s of one ``device`` and where it comes from: ``given``, the table, Lightning's, or none.

    Args:
        device: The device of global rank 0; every device of the job is assumed to be of its kind.
        given: The user's figure, which wins.
    """
    if given is not None:
        return float(given), "given"
    device = torch.device(device)
    if device.type != "cuda":
        return None, f"none known for {device.type}"
    name = torch.cuda.get_device_name(device)
    flops = peak_flops_by_name(name)
    if flops is not None:
        return flops, f"{name}, bf16 dense, data sheet"
    flops = get_available_flops(device, torch.bfloat16)
    return (float(flops), f"{name}, bf16, Lightning's table") if flops else (None, f"none known for {name}")


def count_items(batch: Any, unit: Unit = "auto") -> tuple[int, str]:
    """How many tokens (or samples) ``batch`` holds, and which of the two it counted.

    Tokens are the elements of the batch's first integer tensor of two or more dimensions (token ids
    ``(B, T)``, padding included); a batch without one counts its samples.

    Args:
        batch: One replica's batch (or a micro-batch).
        unit: ``"auto"`` (tokens when there is such a tensor), ``"tokens"`` or ``"samples"``.

    Raises:
        ValueError: ``unit="tokens"`` and the batch holds no token ids.
    """
    if unit == "samples":
        return batch_size_of(batch), "samples"
    ids = [t for t in tensors_of(batch) if t.dim() >= 2 and not t.is_floating_point() and not t.is_complex()]
    ids = [t for t in ids if t.dtype != torch.bool]
    if ids:
        return ids[0].numel(), "tokens"
    if unit == "tokens":
        raise ValueError(
            "PipelineThroughputMonitor(unit='tokens') found no integer tensor of shape (batch, sequence) in the "
            "batch to count tokens in; use unit='samples' (or 'auto')."
        )
    return batch_size_of(batch), "samples"


def meta_layers(module: nn.Module, layers: Sequence[nn.Module]) -> list[nn.Module]:
    """A copy of ``layers`` on the meta device: shapes, dtypes and ties kept, no memory, nothing to compute.

    Compilation and the strategy's activation checkpointing are left out of the copy: they change how the
    layers run, not their model FLOPs.

    Args:
        module: The ``LightningModule`` holding ``layers``; a layer's reference to it is not copied.
        layers: The whole model's pipeline layers (before the stages are cut).
    """
    memo: dict[int, Any] = {id(module): module}
    for owner in (module, *layers):
        for param in owner.parameters():
            if id(param) not in memo:
                meta = torch.empty_like(param, device="meta")
                memo[id(param)] = nn.Parameter(meta, requires_grad=param.requires_grad)
        for buffer in owner.buffers():
            memo.setdefault(id(buffer), torch.empty_like(buffer, device="meta"))
    copies = copy.deepcopy(list(layers), memo)
    for layer in copies:
        for sub in layer.modules():
            if getattr(sub, "_compiled_call_impl", None) is not None:
                sub._compiled_call_impl = None
            if vars(sub).get(_RECOMPUTED):
                del sub.forward
                delattr(sub, _RECOMPUTED)
    return copies


def _to_meta(data: Any) -> Any:
    return map_tensors(data, lambda t: torch.empty_like(t, device="meta"))


def _sum_of_outputs(out: Any) -> Tensor:
    """A scalar whose backward sends a gradient into every output that has one (the next stage's role)."""
    grads = [t.sum() for t in tensors_of(out) if t.requires_grad]
    return torch.stack(grads).sum() if grads else torch.zeros((), requires_grad=True)


def stage_flops(
    layers: Sequence[nn.Module],
    partition: Sequence[range],
    inputs_fn: Callable[[Any], Any],
    loss_fn: Callable[[Any, Any], Tensor],
    microbatch: Any,
) -> list[int]:
    """The FLOPs of one micro-batch's forward and backward through each stage's layers, as a stage runs them.

    Stage ``s > 0`` starts from the previous stage's output, detached, its floating-point tensors requiring
    gradients (a stage computes its input's gradient for the previous stage); the last stage adds the loss.
    The stages' sum equals the FLOPs of the unsplit model's forward and backward.

    Args:
        layers: The model's pipeline layers (e.g. :func:`meta_layers`, then on the meta device).
        partition: Every stage's layer indices.
        inputs_fn: ``pipeline_inputs`` of the model.
        loss_fn: ``pipeline_loss`` of the model.
        microbatch: One micro-batch (its tensors are replaced by meta ones of their shapes).
    """
    microbatch = _to_meta(microbatch)
    counts = []
    # Fake tensors (over the meta device) rather than plain meta ones: libraries skip data-dependent checks on
    # them (transformers' masks call `.all()`), and the meta device runs attention as counted matmuls.
    with torch.enable_grad(), FakeTensorMode(allow_non_fake_inputs=True):
        x = inputs_fn(microbatch)
        for stage, indices in enumerate(partition):
            if stage > 0:
                x = map_tensors(x, lambda t: t.detach().requires_grad_(t.is_floating_point()))
            own, result = [layers[i] for i in indices], {}

            def forward(own=own, x=x, result=result) -> Any:
                result["out"] = run_layers(own, x, microbatch)
                return result["out"]

            last = stage == len(partition) - 1
            backward_from = (lambda out: loss_fn(out, microbatch)) if last else _sum_of_outputs
            counts.append(int(measure_flops(own[0], forward, backward_from)))
            x = result["out"]
    return counts


def throughput_metrics(
    items: int,
    samples: int,
    steps: int,
    seconds: float,
    unit: str,
    replicas: int,
    devices: int,
    flops_per_item: float | None = None,
    peak_flops: float | None = None,
) -> dict[str, float]:
    """The logged throughput of an interval of training, from one replica's counts.

    Args:
        items: Tokens (or samples) of one replica's batches in the interval.
        samples: Samples of one replica's batches in the interval.
        steps: Training steps in the interval.
        seconds: Its duration.
        unit: ``"tokens"`` or ``"samples"``, what ``items`` counts.
        replicas: Data-parallel replicas ``D``, each training on batches like the counted one.
        devices: Devices of the job, ``P x D``.
        flops_per_item: Model FLOPs per token (or sample), forward and backward, summed over the stages.
        peak_flops: Peak FLOP/s of one device.
    """
    per_replica = items / seconds
    job = per_replica * replicas
    metrics = {
        f"throughput/{unit}_per_sec": job,
        f"throughput/{unit}_per_sec_per_replica": per_replica,
        "throughput/sec_per_step": seconds / steps,
    }
    if unit == "tokens":
        metrics["throughput/samples_per_sec"] = samples * replicas / seconds
    if flops_per_item is not None:
        metrics["throughput/flops_per_sec"] = flops_per_item * job
        if peak_flops:
            metrics["throughput/mfu"] = flops_per_item * job / (peak_flops * devices)
    return metrics


class PipelineThroughputMonitor(Callback):
    """Logs the pipeline's throughput and MFU on global rank 0 every ``log_every_n_steps`` steps.

    Logged (see docs/metrics.md): ``throughput/tokens_per_sec`` and ``throughput/tokens_per_sec_per_replica``
    (``samples_per_sec...`` when the batch has no token dimension), ``throughput/samples_per_sec``,
    ``throughput/sec_per_step``, and with the FLOPs known ``throughput/flops_per_sec`` and, with a peak,
    ``throughput/mfu``. Each value covers the steps since the previous logged one (since the start of training
    for the first, which includes filling the pipeline). On CUDA, rank 0 waits for its device at logged steps
    only, so that the time is the device's.

    Under ``strategy="async_pp"`` with several processes the strategy adds one with the defaults when the trainer
    has a logger and ``trainer.callbacks`` holds no monitor already (``AsyncPipelineStrategy(throughput_monitor=)``:
    ``False`` never, ``True`` on one device too).
    The values are logged with ``LightningModule.log`` on global rank 0, so Lightning writes them with the step's
    other metrics; they are in ``trainer.logged_metrics`` and ``trainer.callback_metrics`` too.

    Args:
        peak_flops: Peak FLOP/s of one device (e.g. ``989e12``); ``None`` looks the device up in
            :data:`PEAK_BF16_FLOPS` (none on CPU: then MFU is not logged).
        flops_per_token: Model FLOPs per token (per sample with ``unit="samples"``), forward and backward;
            ``None`` counts them once, on the meta device, at the first step.
        unit: What to count: ``"auto"`` (tokens when the batch holds token ids, else samples), ``"tokens"``
            or ``"samples"``.
    """

    def __init__(self, peak_flops: float | None = None, flops_per_token: float | None = None, unit: Unit = "auto"):
        if unit not in ("auto", "tokens", "samples"):
            raise ValueError(
                f"PipelineThroughputMonitor(unit=...) must be 'auto', 'tokens' or 'samples', got {unit!r}."
            )
        for name, value in (("peak_flops", peak_flops), ("flops_per_token", flops_per_token)):
            if value is not None and not value > 0:
                raise ValueError(f"PipelineThroughputMonitor({name}=...) must be positive (or None), got {value!r}.")
        self.peak_flops = peak_flops
        self.flops_per_token = flops_per_token
        self.unit = unit
        self.stage_flops: list[int] | None = None
        """FLOPs of one micro-batch through each stage, forward and backward, once counted (rank 0)."""
        self.flops_per_item: float | None = flops_per_token
        """Model FLOPs per token (or sample) of the whole pipeline, given or counted."""
        self.metrics: dict[str, float] = {}
        """The values logged last (rank 0)."""
        self._layers: list[nn.Module] | None = None
        self._partition: list[range] | None = None
        self._peak: float | None = None
        self._start: float | None = None
        self._pause_start = 0.0
        self._paused = 0.0
        self._counts = [0, 0, 0]  # items, samples, steps since the last logged step
        self._stepped_at = 0  # the global step at the last batch's end

    def snapshot(self, module: LightningModule) -> None:
        """Keep a meta-device copy of the whole model's layers, before the stages are cut (rank 0 only)."""
        if self.flops_per_item is not None or not is_pipeline_module(module):
            return
        layers = list(module.pipeline_layers())
        if not any(isinstance(layer, RemoteLayer) for layer in layers):  # cut by an earlier fit
            self._layers = meta_layers(module, layers)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        strategy = trainer.strategy
        stage = getattr(strategy, "pipeline_stage", None)  # AsyncPipelineStrategy's, once the stages are placed
        if self._layers is not None:
            self._partition = stage.placement.partition if stage is not None else [range(len(self._layers))]
        self._peak, source = peak_flops_of(strategy.root_device, self.peak_flops)
        if self._peak is None:
            log.info(
                f"throughput/mfu is not logged: no peak FLOP/s ({source}); "
                "give PipelineThroughputMonitor(peak_flops=...)"
            )
        else:
            log.info(f"MFU against {self._peak / 1e12:g} TFLOP/s per device ({source}) x {strategy.world_size} devices")
        self._start, self._paused, self._counts = time.perf_counter(), 0.0, [0, 0, 0]
        self._stepped_at = trainer.global_step

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._pause_start = time.perf_counter()

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._start is not None:  # validation inside fit, not the sanity check before it
            self._paused += time.perf_counter() - self._pause_start

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ):
        if not trainer.is_global_zero or self._start is None:
            return
        strategy = trainer.strategy
        if self._layers is not None:
            began = time.perf_counter()
            self._count_flops(pl_module, batch, strategy.num_microbatches)
            self._paused += time.perf_counter() - began
        items, unit = count_items(batch, self.unit)
        counts = self._counts
        counts[0] += items
        counts[1] += batch_size_of(batch)
        stepped, self._stepped_at = trainer.global_step != self._stepped_at, trainer.global_step
        counts[2] += stepped  # an optimizer step: with accumulate_grad_batches, the last batch of a window
        step, every = trainer.global_step - 1, trainer.log_every_n_steps
        if not stepped or every == 0 or (step + 1) % every != 0:
            return
        if strategy.root_device.type == "cuda":
            torch.cuda.synchronize(strategy.root_device)  # the host may run ahead of the device
        now = time.perf_counter()
        seconds = now - self._start - self._paused
        self._start, self._paused, self._counts = now, 0.0, [0, 0, 0]
        if seconds <= 0:
            return
        self.metrics = throughput_metrics(
            *counts, seconds, unit, strategy.data_parallel_size, strategy.world_size, self.flops_per_item, self._peak
        )
        # Through Lightning: written with the step's other metrics, at the step `log_every_n_steps` chooses.
        pl_module.log_dict(self.metrics, on_step=True, on_epoch=False, rank_zero_only=True, batch_size=1)

    def _count_flops(self, module: LightningModule, batch: Any, num_microbatches: int) -> None:
        """Count the FLOPs per token once, at the first step (when the number of micro-batches is known)."""
        layers, self._layers = self._layers, None
        microbatch = split_microbatches(batch, num_microbatches)[0]
        try:
            with torch.compiler.set_stance("force_eager"):
                self.stage_flops = stage_flops(
                    layers, self._partition, module.pipeline_inputs, module.pipeline_loss, microbatch
                )
        except Exception as error:  # a layer that cannot run on the meta device
            log.warning(
                f"throughput/mfu is not logged: counting the model's FLOPs on the meta device failed ({error!r}). "
                "Give PipelineThroughputMonitor(flops_per_token=...) instead."
            )
            return
        items, unit = count_items(microbatch, self.unit)
        self.flops_per_item = sum(self.stage_flops) / items
        per_stage = ", ".join(f"{f / items:.4g}" for f in self.stage_flops)
        log.info(
            f"Model FLOPs per {unit[:-1]}: {self.flops_per_item:.4g} (per stage: {per_stage}), forward and backward"
        )


def install_throughput_monitor(
    trainer: Trainer, module: LightningModule, is_global_zero: bool, add_default: bool | None = None
) -> None:
    """Add a :class:`PipelineThroughputMonitor` when ``add_default`` (``None``: when the job has several
    processes) and the trainer has a logger but no monitor (saying so on rank 0); let rank 0's copy the model's
    layers before the strategy cuts them. Call in the strategy's ``setup``, before the stage is placed."""
    if trainer.state.fn != TrainerFn.FITTING:
        return
    monitors = [c for c in trainer.callbacks if isinstance(c, PipelineThroughputMonitor)]
    if len(monitors) > 1:
        raise MisconfigurationException(
            f"trainer.callbacks holds {len(monitors)} PipelineThroughputMonitor callbacks; keep one."
        )
    if not monitors:
        if add_default is None:
            add_default = trainer.world_size > 1
        if not add_default or not trainer.loggers:  # nothing would be logged: spare the FLOP count
            return
        monitors = [PipelineThroughputMonitor()]
        trainer.callbacks.append(monitors[0])
        if is_global_zero:
            log.info(
                "AsyncPipelineStrategy logs throughput/* with a PipelineThroughputMonitor added to the callbacks; "
                "AsyncPipelineStrategy(throughput_monitor=False) leaves it out"
            )
    if is_global_zero:
        monitors[0].snapshot(module)
