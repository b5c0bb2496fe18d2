"""Trains the tiny test GPT with AsyncPipelineStrategy and saves what a test compares.

Run as a script (Lightning's launcher starts one process per stage):

    python -m tests.multiprocess.scripts.pipeline_run --devices 2 --schedule 2bw --microbatches 4 --steps 20 --out DIR

Rank 0 writes ``DIR/losses.json`` (the logged ``train/loss`` of every step); every rank writes its
stage's weights to ``DIR/weights_rank{R}.pt``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer

from lightning_async_pp import AsyncPipelineStrategy  # noqa: E402
from lightning_async_pp.optim.muon import use_float32_newton_schulz  # noqa: E402
from tests.fixtures.helpers import global_batches, loader, random_batches, save_stage, tiny_gpt  # noqa: E402


def make_optimizer(name: str):
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=0.5, momentum=0.9)
    if name == "adamw":
        return lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    if name == "lbfgs":  # one history over all parameters: its parameters cannot be split between replicas
        return lambda params: torch.optim.LBFGS(params)
    from lightning_async_pp.optim import DelayCorrected, Muon

    if name == "muon":
        return lambda params: Muon(params, lr=0.02, adamw_lr=1e-2)
    if name == "corrected_adamw":
        return lambda params: DelayCorrected(torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1))
    if name == "corrected_muon":
        return lambda params: DelayCorrected(Muon(params, lr=0.02, adamw_lr=1e-2))
    if name == "auto_adamw":
        return lambda params: DelayCorrected(torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1), coefficient="auto")
    if name in ("corrected_soap", "corrected_adan"):
        # The `research` extra; SOAP recomputes its eigenbases every 2 steps, so 20 steps exercise them.
        import pytorch_optimizer

        if name == "corrected_soap":
            return lambda params: DelayCorrected(
                pytorch_optimizer.SOAP(params, lr=3e-3, weight_decay=0.1, precondition_frequency=2)
            )
        return lambda params: DelayCorrected(pytorch_optimizer.Adan(params, lr=1e-2, weight_decay=0.02))
    raise ValueError(name)


class FaultInjector(Callback):
    """Kills rank ``kill_rank`` at ``fail_step`` (noting the wall time in ``out/killed_at``), or makes losses NaN."""

    def __init__(self, kill_rank, nan_step, fail_step, out) -> None:
        self.kill_rank, self.nan_step, self.fail_step, self.out = kill_rank, nan_step, fail_step, Path(out)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.kill_rank == trainer.global_rank and trainer.global_step == self.fail_step:
            (self.out / "killed_at").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        if self.nan_step is not None and trainer.global_step == self.nan_step:
            loss = pl_module.pipeline_loss
            pl_module.pipeline_loss = lambda output, batch: loss(output, batch) * float("nan")


class StopAt(Callback):
    """Ends `fit` after `step` steps, leaving `max_steps` (and so the learning-rate schedule) as in a longer run."""

    def __init__(self, step) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.step is not None and trainer.global_step >= self.step:
            trainer.should_stop = True


class Recorder(Callback):
    """``train/loss`` at each optimizer step (with gradient accumulation, at the last batch of each window)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.steps: list[int] = []
        self.batch_sums: list[int] = []
        self._step: int | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        metrics = trainer.callback_metrics
        if "train/loss" in metrics and trainer.global_step != self._step:
            self._step = trainer.global_step
            self.losses.append(float(metrics["train/loss"]))
            self.steps.append(trainer.global_step - 1)
            self.batch_sums.append(int(batch[0].sum()))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--pipeline-size", type=int, default=None)
    parser.add_argument("--schedule", default="2bw")
    parser.add_argument("--microbatches", type=lambda v: v if v == "auto" else int(v), default=4, help="or 'auto'")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--experts", type=int, default=0, help="GPT(n_experts=...): 0 is dense")
    parser.add_argument("--experts-per-token", type=int, default=2)
    parser.add_argument("--aux-coef", type=float, default=0.01)
    parser.add_argument("--clip", type=float, default=None)
    parser.add_argument("--accumulate", type=int, default=1, help="Trainer(accumulate_grad_batches=...)")
    parser.add_argument("--split-points", type=str, default=None)
    parser.add_argument("--trace", action="store_true")
    parser.add_argument("--tie-weights", action="store_true")
    parser.add_argument("--model-summary", action="store_true", help="Lightning's default model summary callback")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--save-checkpoint", action="store_true")
    parser.add_argument("--ckpt-path", default=None)
    parser.add_argument("--kill-rank", type=int, default=None, help="SIGKILL this rank at --fail-step")
    parser.add_argument("--nan-step", type=int, default=None, help="make the loss NaN from this step on")
    parser.add_argument("--fail-step", type=int, default=3)
    parser.add_argument("--total-steps", type=int, default=None, help="batches in the data (default: --steps)")
    parser.add_argument("--stop-at", type=int, default=None, help="end fit after this many steps (of --steps)")
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        default=None,
        help="ModelCheckpoint every this many steps, during training, to DIR/final.ckpt",
    )
    parser.add_argument(
        "--checkpoint-io",
        choices=["sync", "async_save", "lightning_async"],
        default="sync",
        help="how --checkpoint-every saves: ShardedCheckpointIO, with async_save=True, or in AsyncCheckpointIO",
    )
    parser.add_argument("--lr-schedule", default="constant")
    parser.add_argument(
        "--global-batches",
        type=int,
        default=None,
        help="data for this many replicas: each replica reads its shard; one replica reads the union",
    )
    parser.add_argument(
        "--muon-ns-float32",
        action="store_true",
        help="Muon's Newton-Schulz in float32 (results that do not depend on the CPU's bfloat16)",
    )
    parser.add_argument("--shard-optimizer", action="store_true", help="AsyncPipelineStrategy(shard_optimizer=True)")
    parser.add_argument("--recompute", action="store_true", help="activation_checkpointing=True")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    with use_float32_newton_schulz() if args.muon_ns_float32 else contextlib.nullcontext():
        _run(args)


def _run(args: argparse.Namespace) -> None:
    if args.accelerator == "cpu":
        torch.set_num_threads(1)

    model = tiny_gpt(
        n_layer=args.layers,
        n_embd=args.width,
        block_size=args.seq,
        optimizer=make_optimizer(args.optimizer),
        tie_weights=args.tie_weights,
        lr_schedule=args.lr_schedule,
        n_experts=args.experts,
        experts_per_token=args.experts_per_token,
        aux_loss_coef=args.aux_coef,
    )
    split_points = [int(x) for x in args.split_points.split(",")] if args.split_points else None
    strategy = AsyncPipelineStrategy(
        schedule=args.schedule,
        num_microbatches=args.microbatches,
        split_points=split_points,
        pipeline_parallel_size=args.pipeline_size,
        timeout=__import__("datetime").timedelta(seconds=60),
        trace_dir=str(Path(args.out) / "trace") if args.trace else None,
        shard_optimizer=args.shard_optimizer,
        activation_checkpointing=args.recompute,
    )
    recorder = Recorder()
    callbacks = [recorder, FaultInjector(args.kill_rank, args.nan_step, args.fail_step, args.out), StopAt(args.stop_at)]
    if args.checkpoint_every:
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks.append(ModelCheckpoint(dirpath=args.out, filename="final", every_n_train_steps=args.checkpoint_every))
    trainer = Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=bool(args.checkpoint_every),
        enable_progress_bar=False,
        enable_model_summary=args.model_summary,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        gradient_clip_val=args.clip,
        accumulate_grad_batches=args.accumulate,
        precision=args.precision,
        plugins=_checkpoint_plugins(args.checkpoint_io),
    )
    batches = random_batches(args.total_steps or args.steps, batch_size=args.batch_size, block=args.seq)
    if args.global_batches:
        replicas = args.devices // (args.pipeline_size or args.devices)
        total, shards = args.total_steps or args.steps, args.global_batches
        batches = random_batches(total * shards, batch_size=args.batch_size, block=args.seq)
        if replicas == 1:
            batches = global_batches(total, shards, batch_size=args.batch_size, block=args.seq)
    trainer.fit(model, train_dataloaders=loader(batches), ckpt_path=args.ckpt_path)

    out = Path(args.out)
    rank = save_stage(trainer, model, out, args.save_checkpoint)
    if rank == 0:
        stage_bubbles = {
            str(stage): [r.bubble_fraction for r in records] for stage, records in strategy.stage_stats.items()
        }
        stage_lags = {str(stage): [r.version_lag for r in records] for stage, records in strategy.stage_stats.items()}
        result = {
            "losses": recorder.losses,
            "steps": recorder.steps,
            "batch_sums": recorder.batch_sums,
            "stage_bubbles": stage_bubbles,
            "version_lag": stage_lags,
            "step_seconds": [r.wall for r in strategy.stage_stats.get(0, [])],
        }
        (out / "losses.json").write_text(json.dumps(result))


def _checkpoint_plugins(kind: str) -> list:
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    from lightning_async_pp.checkpoint import ShardedCheckpointIO

    return {"sync": [], "async_save": [ShardedCheckpointIO(async_save=True)], "lightning_async": [AsyncCheckpointIO()]}[
        kind
    ]


if __name__ == "__main__":
    main()
