"""Trains the tiny GPT on stages with Lightning's ModelCheckpoint, for tests/unit/checkpoint/test_io.py.

    python -m tests.multiprocess.scripts.checkpoint_run --devices 2 --out DIR [--async-io] [--dcp-async]

Every rank logs ``score`` (a fixed value per validation, the same on every rank) at each validation; a
``ModelCheckpoint(monitor="score", mode="min", save_top_k=2, save_last=True)`` keeps the two lowest. Rank 0
writes ``DIR/result.json`` with the callback's view and the weights of its stage.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_async_pp import AsyncPipelineStrategy  # noqa: E402
from lightning_async_pp.demos import GPT  # noqa: E402
from tests.fixtures.helpers import loader, random_batches  # noqa: E402

SCORES = {2: 3.0, 4: 1.0, 6: 2.0, 8: 0.5, 10: 4.0}


class ScoredGPT(GPT):
    def on_validation_epoch_end(self) -> None:
        self.log("score", SCORES[self.trainer.global_step])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--out", required=True)
    parser.add_argument("--async-io", action="store_true", help="Lightning's AsyncCheckpointIO plugin")
    parser.add_argument("--dcp-async", action="store_true", help="ShardedCheckpointIO(async_save=True)")
    parser.add_argument("--single-file", action="store_true", help="save_distributed_checkpoint=False")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    plugins = []
    if args.async_io:
        from lightning.pytorch.plugins.io import AsyncCheckpointIO

        plugins.append(AsyncCheckpointIO())
    if args.dcp_async:
        from lightning_async_pp.checkpoint import ShardedCheckpointIO

        plugins.append(ShardedCheckpointIO(async_save=True))
    checkpoints = ModelCheckpoint(
        dirpath=out / "checkpoints",
        monitor="score",
        mode="min",
        save_top_k=2,
        save_last=True,
        filename="step={step}",
        auto_insert_metric_name=False,
    )
    model = ScoredGPT(vocab_size=256, block_size=16, n_layer=4, n_head=2, n_embd=32, lr_schedule="constant")
    trainer = Trainer(
        accelerator="cpu",
        devices=args.devices,
        max_steps=10,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        strategy=AsyncPipelineStrategy(
            num_microbatches=2, start_method="popen", save_distributed_checkpoint=not args.single_file
        ),
        callbacks=[checkpoints],
        val_check_interval=2,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        plugins=plugins,
    )
    trainer.fit(model, loader(random_batches(10)), loader(random_batches(1, seed=5)))
    torch.save({k: v.detach() for k, v in model.state_dict().items()}, out / f"weights_rank{trainer.global_rank}.pt")
    if trainer.global_rank == 0:
        result = {
            "best_k_models": {Path(k).name: float(v) for k, v in checkpoints.best_k_models.items()},
            "best_model_path": Path(checkpoints.best_model_path).name,
            "last_model_path": Path(checkpoints.last_model_path).name,
        }
        (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
