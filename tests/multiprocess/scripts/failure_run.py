"""Trains the tiny test GPT as a pipeline and makes one rank fail mid-step, for the failure tests.

    python -m tests.multiprocess.scripts.failure_run --devices 3 --fail-rank 1 --how raise --nccl-like --out DIR

``--how raise`` raises a ``RuntimeError`` from a forward of the failing rank's stage at ``--fail-step`` (the
error goes through Lightning's ``on_exception``); ``--how kill`` ends the process with SIGKILL there (no word).
The failing rank writes ``DIR/death.json`` (the wall-clock time of its failure) just before. ``--nccl-like``
installs :mod:`tests.fixtures.nccl_like` in every rank.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer

from lightning_async_pp import AsyncPipelineStrategy
from tests.fixtures import nccl_like
from tests.fixtures.helpers import loader, random_batches, tiny_gpt

ERROR = "injected failure"


class FailMidStep(Callback):
    """At ``step`` on ``rank``: the stage's next forward raises (or the process is killed)."""

    def __init__(self, rank: int, step: int, how: str, out: Path) -> None:
        self.rank, self.step, self.how, self.out = rank, step, how, out

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank != self.rank or trainer.global_step != self.step:
            return

        def fail(module, args) -> None:
            (self.out / "death.json").write_text(json.dumps({"time": time.time(), "rank": self.rank}))
            if self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"{ERROR} at step {self.step}")

        for module in pl_module.pipeline_layers():
            module.register_forward_pre_hook(fail)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=3)
    parser.add_argument("--fail-rank", type=int, default=1)
    parser.add_argument("--fail-step", type=int, default=4)
    parser.add_argument("--how", choices=["raise", "kill"], default="raise")
    parser.add_argument("--nccl-like", action="store_true")
    parser.add_argument("--timeout", type=float, default=30.0, help="the strategy's timeout, in seconds")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.nccl_like:
        nccl_like.install()
    out = Path(args.out)
    strategy = AsyncPipelineStrategy(schedule="2bw", num_microbatches=4, timeout=timedelta(seconds=args.timeout))
    trainer = Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[FailMidStep(args.fail_rank, args.fail_step, args.how, out)],
    )
    model = tiny_gpt(n_layer=args.devices, n_embd=32)
    trainer.fit(model, train_dataloaders=loader(random_batches(args.steps)))


if __name__ == "__main__":
    main()
