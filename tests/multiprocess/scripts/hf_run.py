"""Trains a tiny Hugging Face model (CausalLM) with AsyncPipelineStrategy and saves what a test compares.

    python -m tests.multiprocess.scripts.hf_run --family llama --devices 2 --schedule 1f1b \
        --microbatches 2 --steps 10 --out DIR

Rank 0 writes ``DIR/result.json`` (losses, validation losses, and for a mixture of experts each step's routers'
loss summed over stages); every rank writes its parameters under their ``transformers`` names to
``DIR/weights_rank{R}.pt`` and the safetensors keys it read to ``DIR/read_rank{R}.json``.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.loggers import Logger
from torch.utils.data import DataLoader

import lightning_async_pp.models.hf as hf  # noqa: E402
from lightning_async_pp import AsyncPipelineStrategy  # noqa: E402
from tests.fixtures.hf_models import adamw, sgd, tiny_causal_lm, token_batches  # noqa: E402

READ: list[str] = []


class _RecordingFile:
    """Wraps a safetensors file handle and records every tensor read from it."""

    def __init__(self, handle) -> None:
        self.handle = handle

    def __enter__(self):
        self.handle.__enter__()
        return self

    def __exit__(self, *args):
        return self.handle.__exit__(*args)

    def keys(self):
        return self.handle.keys()

    def get_tensor(self, key):
        READ.append(key)
        return self.handle.get_tensor(key)

    def get_slice(self, key):
        READ.append(key)
        return self.handle.get_slice(key)


_safe_open = hf.safe_open
hf.safe_open = lambda *args, **kwargs: _RecordingFile(_safe_open(*args, **kwargs))


class Recorder(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.val_losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if "train/loss" in trainer.callback_metrics:
            self.losses.append(float(trainer.callback_metrics["train/loss"]))

    def on_validation_end(self, trainer, pl_module) -> None:
        if "val/loss" in trainer.callback_metrics:
            self.val_losses.append(float(trainer.callback_metrics["val/loss"]))


class MemoryLogger(Logger):
    """Keeps what Lightning logs, per step (rank 0 writes it to result.json)."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: dict[int, dict[str, float]] = {}

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.metrics.setdefault(int(step), {}).update({k: float(v) for k, v in metrics.items()})


def make_optimizer(name: str):
    if name == "adamw":
        return adamw
    if name == "sgd":
        return sgd
    from lightning_async_pp.optim import DelayCorrected, Muon

    if name == "corrected_muon":
        return lambda params: DelayCorrected(Muon(params, lr=0.02, adamw_lr=1e-2))
    raise ValueError(name)


def batches_for(args) -> tuple[list[dict], list[dict]]:
    """Training batches (the second half longer when --val-every is set; ``steps`` per replica, each replica
    reading its shard) and validation batches."""
    replicas = args.devices // (args.pipeline_size or args.devices)
    train = token_batches(args.steps * replicas, batch_size=args.batch_size, seq=args.seq, padding=args.padding)
    if args.val_every:
        later = token_batches(args.steps, batch_size=args.batch_size, seq=args.seq + 8, seed=1, padding=args.padding)
        train = train[: args.val_every] + later[args.val_every :]
    val = token_batches(2, batch_size=args.batch_size // 2, seq=args.seq - 4, seed=2, padding=args.padding)
    return train, val


def build(args):
    if args.pretrained:
        from lightning_async_pp.models import CausalLM

        return CausalLM(
            pretrained=args.pretrained,
            optimizer=make_optimizer(args.optimizer),
            lr_schedule="constant",
            attn_implementation=args.attn_implementation,
        )
    return tiny_causal_lm(args.family, optimizer=make_optimizer(args.optimizer))


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", default="llama")
    parser.add_argument("--pretrained", default=None)
    parser.add_argument("--attn-implementation", default="sdpa", help="with --pretrained")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--padding", action="store_true")
    parser.add_argument("--clip", type=float, default=None, help="Trainer(gradient_clip_val=...)")
    parser.add_argument("--pipeline-size", type=int, default=None, help="stages per replica (default: --devices)")
    parser.add_argument("--shard-optimizer", action="store_true", help="AsyncPipelineStrategy(shard_optimizer=True)")
    parser.add_argument("--val-every", type=int, default=0, help="validate after this many steps (0: never)")
    parser.add_argument(
        "--save-checkpoint", action="store_true", help="trainer.save_checkpoint(DIR/final.ckpt) after fit"
    )
    parser.add_argument("--log-metrics", action="store_true", help="log every step; result.json's 'logged'")
    parser.add_argument("--out", required=True)
    return parser


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    torch.set_num_threads(1)

    model = build(args)
    strategy = AsyncPipelineStrategy(
        schedule=args.schedule,
        num_microbatches=args.microbatches,
        pipeline_parallel_size=args.pipeline_size,
        shard_optimizer=args.shard_optimizer,
        timeout=__import__("datetime").timedelta(seconds=120),
    )
    recorder = Recorder()
    logger = MemoryLogger() if args.log_metrics else None
    train, val = batches_for(args)
    validation = (
        dict(val_check_interval=args.val_every, check_val_every_n_epoch=None)
        if args.val_every
        else dict(limit_val_batches=0)
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.steps,
        logger=logger if logger is not None else False,
        log_every_n_steps=1 if logger is not None else None,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[recorder],
        gradient_clip_val=args.clip,
        **validation,
    )
    trainer.fit(
        model,
        train_dataloaders=DataLoader(train, batch_size=None),
        val_dataloaders=DataLoader(val, batch_size=None) if args.val_every else None,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.save_checkpoint:
        trainer.save_checkpoint(out / "final.ckpt")
    rank = trainer.global_rank
    torch.save({k: v.cpu() for k, v in model.hf_state_dict().items()}, out / f"weights_rank{rank}.pt")
    (out / f"read_rank{rank}.json").write_text(json.dumps({"read": READ, "owned": sorted(model.hf_state_dict())}))
    if rank == 0:
        aux: dict[int, float] = {}
        for records in strategy.stage_stats.values():
            for record in records:
                if not math.isnan(record.aux_loss):  # the stage attached an auxiliary loss
                    aux[record.step] = aux.get(record.step, 0.0) + record.aux_loss
        result = {
            "losses": recorder.losses,
            "val_losses": recorder.val_losses,
            "aux_losses": [aux[k] for k in sorted(aux)],
            "logged": logger.metrics if logger is not None else {},
        }
        (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
