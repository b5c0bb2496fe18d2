"""Planning a run for ``python -m lightning_async_pp plan``: a configuration's memory and speed per stage, and
which shapes around it fit a device.

The model's figures come from :mod:`~lightning_async_pp.strategy.model_figures`;
:mod:`lightning_async_pp.schedule.plan` adds them up for any number of stages, replicas and micro-batches;
:func:`plan_report` does so for the configuration and a range around it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from lightning.pytorch import LightningModule

from lightning_async_pp.runtime.contract import require_pipeline_module
from lightning_async_pp.runtime.recompute import select_layers
from lightning_async_pp.runtime.sharding import plan_owners
from lightning_async_pp.schedule.partition import balanced_partition, stage_ranges
from lightning_async_pp.schedule.plan import predict_time, stage_memory
from lightning_async_pp.schedule.simulate import StageCosts
from lightning_async_pp.strategy.model_figures import ModelFigures, measure_model, optimizer_state_bytes
from lightning_async_pp.strategy.strategy import AsyncPipelineStrategy
from lightning_async_pp.strategy.throughput import PEAK_BF16_FLOPS, peak_flops_by_name
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
    strategy: AsyncPipelineStrategy,
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
    if strategy.microbatches.pending:
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
