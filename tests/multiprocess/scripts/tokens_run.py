"""Trains the tiny GPT on a token file as ``P`` stages times ``D`` replicas and saves what each stage read.

    python -m tests.multiprocess.scripts.tokens_run DATA --devices 4 --stages 2 --steps 3 --out DIR

``DATA`` is a token file whose token ``i`` is ``i`` (``tests.fixtures.token_files.position_file``), so
a window's first input (or first target, minus one) is where it starts. Rank R writes ``DIR/seen_rank{R}.json``:
its stage, its replica, and the window starts of every micro-batch its stage used (inputs on the first stage,
targets on the last).
"""

from __future__ import annotations

import argparse
import json
from datetime import timedelta
from pathlib import Path

import torch
from lightning.pytorch import Trainer

from lightning_async_pp import AsyncPipelineStrategy
from lightning_async_pp.demos import GPT
from lightning_async_pp.models.tokens import TokenFileDataModule

BLOCK = 16


class StartsGPT(GPT):
    """Records the window starts of each micro-batch on the stage that reads it."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.seen: list[list[int]] = []

    def pipeline_inputs(self, batch):
        self.seen.append(batch[0][:, 0].tolist())
        return super().pipeline_inputs(batch)

    def pipeline_loss(self, output, batch):
        self.seen.append((batch[1][:, 0] - 1).tolist())
        return super().pipeline_loss(output, batch)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("data")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=AsyncPipelineStrategy(
            num_microbatches=2, pipeline_parallel_size=args.stages, timeout=timedelta(seconds=60)
        ),
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    model = StartsGPT(vocab_size=2048, block_size=BLOCK, n_layer=2, n_head=2, n_embd=16, lr_schedule="constant")
    data = TokenFileDataModule(args.data, val_fraction=0, block_size=BLOCK, batch_size=4, batch_format="pairs")
    trainer.fit(model, data)
    strategy = trainer.strategy
    record = {"stage": strategy.stage, "replica": strategy.replica, "seen": model.seen}
    (out / f"seen_rank{trainer.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
