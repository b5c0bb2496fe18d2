"""Starts a job of ``--num-nodes`` nodes on this machine alone, as a user mistyping ``--trainer.num_nodes`` would.

    python -m tests.multiprocess.scripts.missing_node_run --num-nodes 2 --devices 2 --timeout 6

The processes wait for ranks that never come; the strategy says what it waits for and fails at ``--timeout``.
"""

from __future__ import annotations

import argparse
from datetime import timedelta

from lightning.pytorch import Trainer

from lightning_async_pp import AsyncPipelineStrategy
from tests.fixtures.helpers import loader, random_batches, tiny_gpt


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-nodes", type=int, default=2)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=6.0)
    args = parser.parse_args()
    trainer = Trainer(
        strategy=AsyncPipelineStrategy(num_microbatches=4, timeout=timedelta(seconds=args.timeout)),
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        max_steps=1,
    )
    trainer.fit(tiny_gpt(), loader(random_batches(1)))


if __name__ == "__main__":
    main()
