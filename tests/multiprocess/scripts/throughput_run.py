"""Train the tiny GPT on a pipeline with a given peak FLOP/s and log its throughput and MFU to TensorBoard.

Run as a script (Lightning's launcher starts one process per rank)::

    python -m tests.multiprocess.scripts.throughput_run --devices 2 --steps 6 --out DIR

TensorBoard's event files go to ``DIR/tb/version_0``; rank 0 writes ``DIR/result.json`` (the monitor's
FLOPs per token and per stage, and the by-hand FLOPs per token of the model).
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_async_pp import AsyncPipelineStrategy
from lightning_async_pp.strategy.throughput import PipelineThroughputMonitor
from tests.fixtures.helpers import fit, random_batches, tiny_gpt

N_LAYER, N_EMBD, BLOCK = 4, 32, 16
PEAK = 5e9  # FLOP/s per device, as a user would give it on a CPU
BATCH, EVERY = 4, 2


def gpt_flops_per_token(model) -> int:
    """By hand: 2 FLOPs per matmul weight and token forward, twice that backward (6 N, the embeddings are
    lookups), plus attention's ``Q K^T`` and ``A V``, ``2 x 2 T C`` per token and layer forward (not halved for
    the causal mask), x 3 for the backward."""
    matmul_weights = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "layers.0." not in n)
    return 6 * matmul_weights + 3 * 4 * N_LAYER * BLOCK * N_EMBD


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--recompute", action="store_true", help="activation_checkpointing=True")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    out = Path(args.out)
    model = tiny_gpt(n_layer=N_LAYER, n_embd=N_EMBD, block_size=BLOCK)
    by_hand = gpt_flops_per_token(model)
    strategy = AsyncPipelineStrategy(
        num_microbatches=2, activation_checkpointing=args.recompute, timeout=datetime.timedelta(seconds=120)
    )
    monitor = PipelineThroughputMonitor(peak_flops=PEAK)
    logger = TensorBoardLogger(save_dir=str(out), name="tb", version=0)
    batches = random_batches(args.steps, batch_size=BATCH, block=BLOCK)
    fit(model, batches, strategy, devices=args.devices, logger=logger, log_every_n_steps=EVERY, callbacks=[monitor])
    trainer = model.trainer
    if trainer.is_global_zero:
        record = {"flops_per_token": monitor.flops_per_item, "stage_flops": monitor.stage_flops, "by_hand": by_hand}
        (out / "result.json").write_text(json.dumps(record))
    trainer.strategy.barrier()  # rank 0's exit ends the job: every rank has finished by then


if __name__ == "__main__":
    main()
