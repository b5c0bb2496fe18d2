"""Runs one multi-stage training scenario and saves, per rank, what the test needs to compare.

    python -m tests.multiprocess.scripts.stage_run SCENARIO --devices 2 --steps 4 --out DIR

Scenarios:
    hooks      the tiny GPT with an ``on_before_optimizer_step`` hook (module and callback) that records every
               call's gradient norms per parameter; rank R writes ``DIR/hooks_rank{R}.json``.
    shuffled   a shuffled ``DataLoader`` of indexed samples, no seeding at all (each process draws its own
               global seed); rank R writes the sample ids of every micro-batch its stage used to
               ``DIR/seen_rank{R}.json``.
    differing  like ``shuffled`` but the data differ per rank on purpose (the loader cannot agree).
    meta       the tiny GPT built under ``trainer.init_module(empty_init=True)`` (``--normal`` builds it
               normally); rank R writes its stage's weights to ``DIR/weights_rank{R}.pt`` and rank 0 the losses
               to ``DIR/losses.json``. ``--save-checkpoint`` and ``--ckpt-path`` save and resume.
"""

from __future__ import annotations

import argparse
import json
import os
from datetime import timedelta
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader, Dataset

from lightning_async_pp import AsyncPipelineStrategy  # noqa: E402
from lightning_async_pp.demos import GPT  # noqa: E402
from tests.fixtures.helpers import BLOCK, VOCAB, loader, random_batches, tiny_gpt  # noqa: E402


class HookedGPT(GPT):
    """Records, at every ``on_before_optimizer_step``, the gradient norm of each parameter that has one."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.hook_calls: list[dict[str, float]] = []

    def on_before_optimizer_step(self, optimizer) -> None:
        self.hook_calls.append(
            {name: float(p.grad.norm()) for name, p in self.named_parameters() if p.grad is not None}
        )


class CallbackCounter(Callback):
    def __init__(self) -> None:
        self.calls = 0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.calls += 1


def hooked_gpt(**kwargs) -> HookedGPT:
    defaults = dict(vocab_size=VOCAB, block_size=BLOCK, n_layer=4, n_head=2, n_embd=32, lr_schedule="constant")
    defaults.update(kwargs)
    return HookedGPT(**defaults)


class IndexedTokens(Dataset):
    """Sample ``i``: tokens that encode ``i`` (first token ``i % VOCAB``, second ``i // VOCAB``), so that any
    stage can tell which samples a micro-batch holds, from the inputs or from the targets."""

    def __init__(self, size: int, offset: int = 0) -> None:
        self.size, self.offset = size, offset

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        index = index + self.offset
        generator = torch.Generator().manual_seed(index)
        row = torch.randint(0, VOCAB, (BLOCK + 1,), generator=generator)
        row[0], row[1] = index % VOCAB, index // VOCAB
        return row[:-1], row[1:]


def sample_ids(batch) -> list[int]:
    """The ids of the samples of a (micro-)batch, read from the inputs (first stage) or the targets."""
    inputs, targets = batch
    return (inputs[:, 0] + VOCAB * targets[:, 0]).tolist()


class SeenGPT(GPT):
    """Records which samples each micro-batch held, on the stage that uses them (inputs on the first stage,
    targets on the last)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.seen: list[list[int]] = []

    def pipeline_inputs(self, batch):
        self.seen.append(sample_ids(batch))
        return super().pipeline_inputs(batch)

    def pipeline_loss(self, output, batch):
        self.seen.append(sample_ids(batch))
        return super().pipeline_loss(output, batch)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["hooks", "shuffled", "differing", "meta"])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--total-steps", type=int, default=None)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--epochs-of", type=int, default=None, help="batches per epoch (shuffled data)")
    parser.add_argument("--normal", action="store_true", help="meta: build the model normally")
    parser.add_argument("--save-checkpoint", action="store_true")
    parser.add_argument("--ckpt-path", default=None)
    parser.add_argument("--split-points", default=None, help="comma-separated stage boundaries")
    parser.add_argument("--validate", action="store_true", help="validate on 2 batches at the end of training")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    split_points = [int(x) for x in args.split_points.split(",")] if args.split_points else None
    strategy = AsyncPipelineStrategy(
        num_microbatches=args.microbatches, split_points=split_points, timeout=timedelta(seconds=60)
    )
    callbacks = [CallbackCounter()] if args.scenario == "hooks" else []
    validation = (
        dict(limit_val_batches=2, val_check_interval=args.steps) if args.validate else dict(limit_val_batches=0)
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        **validation,
    )
    if args.scenario == "hooks":
        model = hooked_gpt()
        data = loader(random_batches(args.steps))
    elif args.scenario in ("shuffled", "differing"):
        model = SeenGPT(vocab_size=VOCAB, block_size=BLOCK, n_layer=2, n_head=2, n_embd=32, lr_schedule="constant")
        batches_per_epoch = args.epochs_of or args.steps
        # "differing": every process reads other samples, as a per-rank data pipeline would.
        offset = 1000 * int(os.environ.get("LOCAL_RANK", 0)) if args.scenario == "differing" else 0
        data = DataLoader(IndexedTokens(8 * batches_per_epoch, offset), batch_size=8, shuffle=True, drop_last=True)
    else:
        data = loader(random_batches(args.total_steps or args.steps))
        if args.normal:
            model = tiny_gpt(n_layer=4)
        else:
            with trainer.init_module(empty_init=True):
                model = tiny_gpt(n_layer=4)
    recorder = LossRecorder()
    trainer.callbacks.append(recorder)
    val_data = loader(random_batches(2, seed=1)) if args.validate else None
    trainer.fit(model, train_dataloaders=data, val_dataloaders=val_data, ckpt_path=args.ckpt_path)

    rank = trainer.global_rank
    if args.scenario == "hooks":
        record = {"module": model.hook_calls, "callback": callbacks[0].calls}
        (out / f"hooks_rank{rank}.json").write_text(json.dumps(record))
    elif args.scenario in ("shuffled", "differing"):
        (out / f"seen_rank{rank}.json").write_text(json.dumps(model.seen))
    else:
        if args.save_checkpoint:
            trainer.save_checkpoint(out / "final.ckpt")
        torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, out / f"weights_rank{rank}.pt")
        if rank == 0:
            metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
            result = {"losses": recorder.losses, "steps": recorder.steps, "val": metrics}
            (out / "losses.json").write_text(json.dumps(result))


class LossRecorder(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.steps: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if "train/loss" in trainer.callback_metrics:
            self.losses.append(float(trainer.callback_metrics["train/loss"]))
            self.steps.append(trainer.global_step - 1)


if __name__ == "__main__":
    main()
