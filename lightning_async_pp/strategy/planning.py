"""Measuring a model for ``python -m lightning_async_pp plan``: per-layer figures read on the meta device.

Nothing is allocated or computed: the layers are copied onto fake tensors (shapes and dtypes only), and

- their optimizer state is what the model's own ``configure_optimizers`` creates when stepped once on meta
  parameters with meta gradients (so a new optimizer is counted as it is, Muon's routing and
  ``DelayCorrected``'s previous update included);
- their activations are the tensors each layer saves for backward (``torch.autograd.graph.saved_tensors_hooks``)
  on one micro-batch of the data module, under autocast when the precision is mixed; autocast's copies of the
  weights are told apart from the activations;
- their FLOPs are counted as the throughput monitor counts them (:func:`~.throughput.stage_flops`).

:mod:`lightning_async_pp.schedule.plan` adds the figures up for any number of stages, replicas and
micro-batches; :func:`plan_report` does so for the configuration and a range around it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.core.optimizer import _configure_optimizers
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_async_pp.optim.delay_corrected import STATE_KEY as CORRECTION_KEY
from lightning_async_pp.runtime.contract import require_pipeline_module, run_layers
from lightning_async_pp.runtime.microbatch import map_tensors, tensors_of
from lightning_async_pp.runtime.recompute import select_layers
from lightning_async_pp.runtime.sharding import plan_owners
from lightning_async_pp.runtime.ties import parameter_slots, retie
from lightning_async_pp.schedule.partition import balanced_partition, stage_ranges
from lightning_async_pp.schedule.plan import LayerFigures, ParameterFigures, predict_time, stage_memory
from lightning_async_pp.schedule.simulate import StageCosts
from lightning_async_pp.strategy.throughput import PEAK_BF16_FLOPS, meta_layers, peak_flops_by_name, stage_flops
from lightning_async_pp.strategy.topology import PipelineDims

__all__ = [
    "DEVICES",
    "ModelFigures",
    "Setting",
    "candidate_settings",
    "device_figures",
    "first_microbatch",
    "format_report",
    "measure_model",
    "optimizer_state_bytes",
    "plan_from_config",
    "plan_report",
    "plan_setting",
]

GIB = 2**30

# Memory of one device as `nvidia-smi` reports it, in MiB; the peak comes from the throughput monitor's table
# (PEAK_BF16_FLOPS) under the device name.
DEVICES: dict[str, tuple[str, int]] = {
    "h100": ("NVIDIA H100 80GB HBM3", 81559),
    "h200": ("NVIDIA H200", 143771),
    "a100-80gb": ("NVIDIA A100-SXM4-80GB", 81920),
    "a100-40gb": ("NVIDIA A100-SXM4-40GB", 40960),
}


def device_figures(device: str, memory_gib: float | None, peak_flops: float | None) -> tuple[str, float, float]:
    """``(name, bytes, peak FLOP/s)`` of one device: from :data:`DEVICES`, with ``memory_gib`` and ``peak_flops``
    overriding (both are needed for a device the table lacks).

    Raises:
        ValueError: An unknown device without both figures, or a figure that is not positive.
    """
    for what, value in (("--device-memory", memory_gib), ("--peak-flops", peak_flops)):
        if value is not None and not value > 0:
            raise ValueError(f"{what} must be positive, got {value}.")
    known = DEVICES.get(device.lower())
    if known is None and (memory_gib is None or peak_flops is None):
        raise ValueError(
            f"--device {device!r} is not in the table ({', '.join(DEVICES)}); choose one of those, or give "
            "--device-memory GIB and --peak-flops FLOPS for it."
        )
    name = known[0] if known else device
    memory = memory_gib * GIB if memory_gib is not None else known[1] * 2**20
    peak = peak_flops if peak_flops is not None else peak_flops_by_name(name)
    assert peak is not None, f"{name} is missing from PEAK_BF16_FLOPS ({len(PEAK_BF16_FLOPS)} entries)"
    return name, float(memory), float(peak)


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
    flops = stage_flops(
        meta_layers(module, layers),
        [range(i, i + 1) for i in range(len(layers))],
        module.pipeline_inputs,
        module.pipeline_loss,
        microbatch,
    )
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


@dataclass
class Setting:
    """One pipeline configuration to plan."""

    schedule: str
    stages: int
    replicas: int
    num_microbatches: int
    batch_size: int
    shard_optimizer: bool
    recomputed: list[bool]
    split_points: list[int] | None = None


def _partition(model: ModelFigures, stages: int, split_points: Sequence[int] | None) -> list[range]:
    n = len(model.layers)
    if split_points is not None:
        return stage_ranges([0, *split_points], n)
    counts = [float(sum(p.numel for p in layer.parameters.values())) for layer in model.layers]
    return stage_ranges(balanced_partition(counts, stages), n)


def plan_setting(
    model: ModelFigures, setting: Setting, memory: float, peak: float, efficiency: float, overhead: float = 0.0
) -> dict[str, Any]:
    """Memory per stage and predicted speed of one setting, as a JSON-ready dict; ``overhead`` is the host's
    seconds per forward and per backward of a micro-batch."""
    partition = _partition(model, setting.stages, setting.split_points)
    scale = setting.batch_size / setting.num_microbatches / model.microbatch_size
    stages = stage_memory(
        model.layers,
        partition,
        setting.schedule,
        setting.num_microbatches,
        setting.replicas,
        setting.shard_optimizer,
        setting.recomputed,
        model.autocast,
        scale,
        model.loss_saved_bytes,
        plan_owners,
    )
    flops = [sum(model.layers[i].flops for i in r) * scale for r in partition]
    again = [sum(model.layers[i].flops for i in r if setting.recomputed[i]) * scale / 3 for r in partition]
    seconds = 1.0 / (peak * efficiency)
    time = predict_time(
        [f / 3 * seconds for f in flops],
        setting.schedule,
        setting.num_microbatches,
        [a * seconds for a in again],
        overhead=[StageCosts(overhead, overhead)] * len(partition),
    )
    tokens = setting.batch_size * model.tokens_per_sample * setting.replicas
    model_flops = sum(flops) * setting.num_microbatches * setting.replicas
    peak_bytes = max(s.total for s in stages)
    return {
        "schedule": setting.schedule,
        "stages": [{**asdict(s), "layers": [s.layers.start, s.layers.stop], "total": s.total} for s in stages],
        "peak_bytes": peak_bytes,
        "fits": peak_bytes <= memory,
        "step_seconds": time.step_seconds,
        "bubble": time.bubble,
        "tokens_per_second": tokens / time.step_seconds,
        "mfu": model_flops / time.step_seconds / (peak * setting.stages * setting.replicas),
    }


def candidate_settings(setting: Setting, devices: int, layers: int) -> list[Setting]:
    """``(P, D, M)`` around ``setting``: every ``P`` dividing ``devices`` (at most the layers), ``M`` in
    ``{P, 2P, 4P}`` where it divides the batch, both schedules; the same sharding and recomputation."""
    out = []
    for stages in range(1, min(devices, layers) + 1):
        if devices % stages:
            continue
        for m in sorted({stages, 2 * stages, 4 * stages}):
            if setting.batch_size % m:
                continue
            for kind in ("2bw", "1f1b"):
                out.append(
                    Setting(
                        kind,
                        stages,
                        devices // stages,
                        m,
                        setting.batch_size,
                        setting.shard_optimizer,
                        setting.recomputed,
                    )
                )
    return out


def plan_report(
    model: ModelFigures,
    setting: Setting,
    devices: int,
    device: tuple[str, float, float],
    efficiency: float,
    reserved: float,
    overhead: float = 0.0,
) -> dict[str, Any]:
    """The whole plan: the setting under both schedules, and which ``(P, D, M)`` fit, as a JSON-ready dict."""
    name, memory, peak = device
    usable = memory - reserved
    schedules = {}
    for kind in ("2bw", "1f1b"):
        schedules[kind] = plan_setting(
            model, Setting(**{**vars(setting), "schedule": kind}), usable, peak, efficiency, overhead
        )
    grid = []
    for other in candidate_settings(setting, devices, len(model.layers)):
        result = plan_setting(model, other, usable, peak, efficiency, overhead)
        grid.append(
            {
                "schedule": other.schedule,
                "P": other.stages,
                "D": other.replicas,
                "M": other.num_microbatches,
                "peak_gib": result["peak_bytes"] / GIB,
                "fits": result["fits"],
                "tokens_per_second": result["tokens_per_second"],
            }
        )
    params = {}
    for layer in model.layers:
        params.update(layer.parameters)
    return {
        "device": {"name": name, "memory_bytes": memory, "usable_bytes": usable, "peak_flops": peak},
        "efficiency": efficiency,
        "overhead_seconds": overhead,
        "model": {
            "parameters": sum(p.numel for p in params.values()),
            "layers": model.names,
            "microbatch_size": setting.batch_size // setting.num_microbatches,
            "tokens_per_sample": model.tokens_per_sample,
            "autocast": model.autocast,
            "flops_per_token": sum(f.flops for f in model.layers) / model.microbatch_size / model.tokens_per_sample,
        },
        "setting": {k: v for k, v in vars(setting).items() if k != "recomputed"}
        | {"recomputed_layers": [i for i, r in enumerate(setting.recomputed) if r], "devices": devices},
        "low_precision_copies": "one per weight version held (2BW: 2, 1F1B: 1) under autocast, none without",
        "schedules": schedules,
        "grid": grid,
    }


def _in(unit: int) -> Callable[[float], str]:
    return lambda value: f"{value / unit:.2f}"


def format_report(report: dict[str, Any]) -> str:
    """The plan as text: per-stage memory of both schedules, their speed, and the ``(P, D, M)`` grid."""
    s, d = report["setting"], report["device"]
    small = max(r["peak_bytes"] for r in report["schedules"].values()) < GIB
    unit, _gib = ("MiB", _in(2**20)) if small else ("GiB", _in(GIB))
    lines = [
        f"Model: {report['model']['parameters']:,} parameters in {len(report['model']['layers'])} pipeline layers; "
        f"{report['model']['flops_per_token']:.4g} FLOPs per token (forward and backward)",
        f"Job: P = {s['stages']} stages x D = {s['replicas']} replicas, M = {s['num_microbatches']} micro-batches of "
        f"{report['model']['microbatch_size']} x {report['model']['tokens_per_sample']} tokens, "
        f"shard_optimizer={s['shard_optimizer']}, recomputed layers: {s['recomputed_layers'] or 'none'}",
        f"Device: {d['name']}, {d['memory_bytes'] / GIB:.2f} GiB ({d['usable_bytes'] / GIB:.2f} usable), "
        f"{d['peak_flops'] / 1e12:g} TFLOP/s peak x efficiency {report['efficiency']:g}",
        "Low-precision copies: " + report["low_precision_copies"] + ".",
    ]
    header = (
        f"{'stage':>5}  {'layers':<7} {'params':>13}"
        + "".join(f"{h:>9}" for h in ("weights", "grads", "optim", "corr", "lowp", "act/mb"))
        + f"{'in-flight':>11}"
        + "".join(f"{h:>9}" for h in ("acts", "recomp", "total"))
    )
    for kind, result in report["schedules"].items():
        lines += ["", f"{kind}: memory per stage, {unit}", header]
        for st in result["stages"]:
            figures = [st[k] for k in ("weights", "gradients", "optimizer_state", "correction", "low_precision_copies")]
            after = [st[k] for k in ("activations", "recompute_transient", "total")]
            lines.append(
                f"{st['stage']:>5}  {st['layers'][0]:>2}-{st['layers'][1] - 1:<4} {st['parameters']:>13,}"
                + "".join(f"{_gib(v):>9}" for v in figures)
                + f"{_gib(st['activations_per_microbatch']):>9}{st['in_flight']:>11}"
                + "".join(f"{_gib(v):>9}" for v in after)
            )
        verdict = "fits" if result["fits"] else "does NOT fit"
        lines.append(
            f"{kind}: peak {_gib(result['peak_bytes'])} {unit}, {verdict}; step {result['step_seconds']:.4g} s, "
            f"bubble {result['bubble']:.1%}, {result['tokens_per_second']:,.0f} tokens/s, MFU {result['mfu']:.1%}"
        )
    lines += ["", "P  D  M   schedule  peak GiB  fits  tokens/s"]
    for row in report["grid"]:
        lines.append(
            f"{row['P']:<2} {row['D']:<2} {row['M']:<3} {row['schedule']:<8}  {row['peak_gib']:>8.2f}  "
            f"{'yes' if row['fits'] else 'no':<4}  {row['tokens_per_second']:>10,.0f}"
        )
    return "\n".join(lines)


def first_microbatch(datamodule: Any, num_microbatches: int) -> tuple[Any, int]:
    """One micro-batch of the training data (its first sample, repeated) and the batch size of the data.

    Raises:
        ValueError: The data cannot be read, the dataloader has no fixed batch size, or the batch does not split
            into the micro-batches.
    """
    try:
        datamodule.prepare_data()
        datamodule.setup("fit")
        loader = datamodule.train_dataloader()
    except OSError as error:
        raise ValueError(
            f"plan reads the first training sample for the shapes of a micro-batch, and the data module could not "
            f"load it: {error}"
        ) from error
    batch_size = loader.batch_size
    if batch_size is None:
        raise ValueError("plan needs a training dataloader with a fixed batch_size.")
    sample = loader.dataset[0]
    if batch_size % num_microbatches:
        raise ValueError(
            f"The data's batch size {batch_size} is not a multiple of num_microbatches={num_microbatches}; change "
            "one of them (data.init_args.batch_size or the strategy's num_microbatches)."
        )
    return loader.collate_fn([sample] * (batch_size // num_microbatches)), batch_size


AUTOCAST_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def plan_from_config(
    module: LightningModule,
    datamodule: Any,
    strategy: Any,
    devices: int,
    precision: str,
    max_steps: int,
    device: tuple[str, float, float],
    efficiency: float,
    reserved: float,
    overhead: float = 0.0,
) -> dict[str, Any]:
    """The plan of a ``fit`` configuration: its model (built on the meta device), data, strategy and devices.

    Args:
        module: The model, its layers on the meta device.
        datamodule: The data module; its first training sample, repeated, gives the micro-batch's shapes.
        strategy: The ``AsyncPipelineStrategy`` of the configuration.
        devices: Processes of the job, ``devices x num_nodes``.
        precision: The trainer's precision (``"bf16-mixed"`` and ``"16-mixed"`` autocast the weights).
        max_steps: The trainer's ``max_steps`` (a learning-rate schedule may read it).
        device: ``(name, bytes, peak FLOP/s)`` of one device (:func:`device_figures`).
        efficiency: The fraction of the peak the layers reach.
        reserved: Bytes of a device not available to the stage (CUDA context, communication buffers).
        overhead: Host seconds per forward and per backward of a micro-batch, added to the layers' time.

    Raises:
        ValueError: A setting the plan cannot follow, with what to change.
    """
    require_pipeline_module(module, "plan cuts the model into stages")
    if strategy.auto_microbatches:
        raise ValueError(
            "num_microbatches='auto' is decided at the first batch; give the strategy a number to plan "
            "(--trainer.strategy.init_args.num_microbatches N)."
        )
    dims = PipelineDims.for_workers(devices, strategy.pipeline_parallel_size)
    M = strategy.num_microbatches
    microbatch, batch_size = first_microbatch(datamodule, M)
    layers = list(module.pipeline_layers())
    recomputed = set(select_layers(layers, strategy.activation_checkpointing))
    figures = measure_model(
        module, microbatch, AUTOCAST_DTYPES.get(str(precision)), optimizer_state_bytes(module, max_steps)
    )
    setting = Setting(
        schedule=strategy.schedule,
        stages=dims.num_stages,
        replicas=dims.data_parallel_size,
        num_microbatches=M,
        batch_size=batch_size,
        shard_optimizer=strategy.shard_optimizer,
        recomputed=[i in recomputed for i in range(len(layers))],
        split_points=strategy.split_points,
    )
    return plan_report(figures, setting, devices, device, efficiency, reserved, overhead)
