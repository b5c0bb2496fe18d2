"""One training run: the demo GPT (with a delay profile for the profile modes), its Trainer, its result."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch.optim import Optimizer

from lightning_async_pp import AsyncPipelineStrategy
from lightning_async_pp.demos import GPT, TextDataModule
from lightning_async_pp.files import atomic_write_text
from lightning_async_pp.optim.muon import newton_schulz_dtype
from lightning_async_pp.reference.profile import DelayProfile

from .optimizers import make_optimizer_factory
from .spec import CORRECTED_MODES, PROFILE_MODES, RunSpec, portable_path


class ProfiledGPT(GPT):
    """The demo GPT whose gradients follow a delay profile (the modes that are neither sync nor 2BW).

    Args:
        mode: ``pipedream`` (stage ``s`` of ``stages`` is ``stages-1-s`` steps stale), ``delayed_matrices_only``
            or ``delayed_adamw_only`` (one step of delay on one part of Muon only).
        stages: The number of stages of the ``pipedream`` profile.
    """

    def __init__(self, *args: Any, mode: str = "pipedream", stages: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.mode = mode
        self.stages = stages
        self.profile: DelayProfile | None = None

    def make_profile(self, optimizer: Optimizer) -> DelayProfile:
        if self.mode == "pipedream":
            # Cut between parameter tensors: the 6-layer model then emulates pipelines up to 53 stages deep.
            return DelayProfile.pipedream(self.pipeline_layers(), self.stages, granularity="parameter")
        matrices = [p for g in optimizer.param_groups if g.get("use_muon") for p in g["params"]]
        others = [p for g in optimizer.param_groups if not g.get("use_muon") for p in g["params"]]
        delays = [1, 0] if self.mode == "delayed_matrices_only" else [0, 1]
        return DelayProfile([matrices, others], delays)

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        if self.profile is None:
            self.profile = self.make_profile(optimizer)
        optimizer.step(closure=self.profile.wrap_closure(optimizer_closure))


def build_model(spec: RunSpec) -> GPT:
    """The demo GPT of ``spec``, initialised from its seed, with its optimizer and learning-rate schedule.

    Raises:
        ValueError: For a mode that splits Muon's parameters with another optimizer.
    """
    kwargs = dict(
        vocab_size=256,
        block_size=spec.block_size,
        n_layer=spec.n_layer,
        n_head=spec.n_head,
        n_embd=spec.n_embd,
        init_seed=1000 * spec.seed,
        optimizer=make_optimizer_factory(spec),
        lr_schedule="cosine",
        warmup_fraction=spec.warmup_fraction,
        min_lr_ratio=spec.min_lr_ratio,
        n_experts=spec.n_experts,
        experts_per_token=spec.experts_per_token,
        aux_loss_coef=spec.aux_loss_coef,
    )
    if spec.mode in PROFILE_MODES:
        if spec.mode != "pipedream" and spec.optimizer != "muon":
            raise ValueError(f"Mode {spec.mode!r} splits Muon's parameters; it needs optimizer='muon'.")
        return ProfiledGPT(mode=spec.mode, stages=spec.stages, **kwargs)
    return GPT(**kwargs)


class Recorder(Callback):
    """Records the training loss of every step, the validation curve and, for ``delayed_auto``, the spread of
    the automatic coefficients at every validation step.

    Args:
        spec: The run.
        names: Parameter names by ``id`` of the parameter.
    """

    def __init__(self, spec: RunSpec, names: dict[int, str]) -> None:
        self.spec = spec
        self.names = names
        self.train_loss: list[float] = []
        self.aux_loss: list[float] = []  # runs with experts: the routers' load-balancing loss of every step
        self.val_curve: list[list[float]] = []
        self.auto_curve: list[list[float]] = []  # [step, min, median, max] of the automatic coefficients

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        value = trainer.callback_metrics.get("train/loss")
        self.train_loss.append(float(value) if value is not None else float("nan"))
        if self.spec.n_experts:
            aux = trainer.callback_metrics.get("train/aux_loss")
            self.aux_loss.append(float(aux) if aux is not None else float("nan"))
        if self.spec.mode == "delayed_auto":
            values = sorted(auto_coefficients(trainer.optimizers[0], self.names).values())
            if values and trainer.global_step % self.spec.val_every == 0:
                self.auto_curve.append([trainer.global_step, values[0], statistics.median(values), values[-1]])

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        value = trainer.callback_metrics.get("val/loss")
        if value is not None:
            step = trainer.global_step
            if self.val_curve and self.val_curve[-1][0] == step:
                self.val_curve[-1] = [step, float(value)]
            else:
                self.val_curve.append([step, float(value)])


def train(spec: RunSpec) -> dict[str, Any] | None:
    """Train one run; returns its result on global rank 0 (``None`` on other pipeline ranks).

    Raises:
        ValueError: For an unknown ``muon_ns_dtype``.
    """
    if spec.muon_ns_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"`muon_ns_dtype` must be 'float32' or 'bfloat16', got {spec.muon_ns_dtype!r}.")
    threads = torch.get_num_threads()
    torch.set_num_threads(spec.threads)
    try:
        with newton_schulz_dtype(spec.muon_ns_dtype):
            return _train(spec)
    finally:  # matters when a run shares its process (--in-process)
        torch.set_num_threads(threads)


def _trainer(spec: RunSpec, recorder: Recorder) -> Trainer:
    schedule = "2bw" if spec.mode in ("delayed", *CORRECTED_MODES) else "1f1b"
    return Trainer(
        accelerator="cpu",
        devices=spec.devices,
        strategy=AsyncPipelineStrategy(schedule=schedule, num_microbatches=spec.microbatches),
        max_steps=spec.steps,
        gradient_clip_val=spec.clip,
        val_check_interval=spec.val_every,
        check_val_every_n_epoch=None,
        limit_val_batches=spec.val_batches,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder],
    )


def _train(spec: RunSpec) -> dict[str, Any] | None:
    warnings.filterwarnings("ignore", message=r".*(does not have many workers|smaller than the logging interval).*")
    seed_everything(spec.seed, workers=True, verbose=False)
    data = TextDataModule(path=spec.corpus, block_size=spec.block_size, batch_size=spec.batch_size, seed=spec.seed)
    model = build_model(spec)
    names = {id(p): name for name, p in model.named_parameters()}
    recorder = Recorder(spec, names)
    trainer = _trainer(spec, recorder)
    start = time.perf_counter()
    trainer.fit(model, datamodule=data)
    wall = time.perf_counter() - start
    if spec.steps % spec.val_every:
        # The last step is not a multiple of val_every: every rank measures once more after training.
        trainer.validate(model, datamodule=data, verbose=False)
    if trainer.global_rank != 0:
        return None
    val_curve = recorder.val_curve
    if val_curve and val_curve[-1][0] != spec.steps:
        raise RuntimeError(f"The last validation ran at step {val_curve[-1][0]}, not after the last step {spec.steps}.")
    return _result(spec, model, trainer, recorder, wall)


def _result(spec: RunSpec, model: LightningModule, trainer: Trainer, recorder: Recorder, wall: float) -> dict:
    """The result of a finished run, as its cache file and the report's ``runs`` record it."""
    final = recorder.val_curve[-1][1] if recorder.val_curve else math.nan
    diverged = not math.isfinite(final)
    auto = spec.mode == "delayed_auto"
    return {
        **dataclasses.asdict(spec),
        "corpus": portable_path(spec.corpus),
        "kind": None,
        "final_val_loss": None if diverged else final,
        "diverged": diverged,
        "val_curve": [[s, v if math.isfinite(v) else None] for s, v in recorder.val_curve],
        "train_loss": [_round(v) for v in recorder.train_loss],
        "aux_loss": [_round(v) for v in recorder.aux_loss] if spec.n_experts else None,
        "wall_s": round(wall, 2),
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_tokens": spec.steps * spec.batch_size * spec.block_size,
        "tokens_per_s": round(spec.steps * spec.batch_size * spec.block_size / wall, 1),
        # delayed_auto: the coefficient of every parameter tensor after the last step, and their spread over time.
        "auto_coefficients": {
            k: round(v, 4) for k, v in auto_coefficients(trainer.optimizers[0], recorder.names).items()
        }
        if auto
        else None,
        "auto_coefficient_curve": [[s, *(round(v, 4) for v in rest)] for s, *rest in recorder.auto_curve]
        if auto
        else None,
    }


def auto_coefficients(optimizer: Optimizer, names: dict[int, str]) -> dict[str, float]:
    """The ``"lookahead"`` coefficient ``DelayCorrected(coefficient="auto")`` keeps for each parameter, by name."""
    return {
        names.get(id(p), str(i)): float(state["lookahead"])
        for i, (p, state) in enumerate(optimizer.state.items())
        if "lookahead" in state
    }


def _round(value: float, digits: int = 7) -> float | None:
    return round(value, digits) if math.isfinite(value) else None


def worker_main(spec_path: str, result_path: str) -> None:
    """Train the run whose spec is the JSON file ``spec_path``; rank 0 writes the result to ``result_path``."""
    spec = RunSpec(**json.loads(Path(spec_path).read_text()))
    result = train(spec)
    if result is not None:
        atomic_write_text(result_path, json.dumps(result))
