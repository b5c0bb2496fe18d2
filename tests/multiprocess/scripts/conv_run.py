"""Trains the small conv classifier of tests/fixtures/helpers.py with Muon as a pipeline and saves what a test compares.

    python -m tests.multiprocess.scripts.conv_run --devices 2 --dims 1 --optimizer muon --steps 8 --out DIR

Rank 0 writes ``DIR/losses.json``; every rank writes its stage's weights to ``DIR/weights_rank{R}.pt``.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
from lightning.pytorch import Trainer

from lightning_async_pp import AsyncPipelineStrategy  # noqa: E402
from lightning_async_pp.optim import DelayCorrected, Muon  # noqa: E402
from tests.fixtures.helpers import ConvClassifier, conv_batches, loader  # noqa: E402
from tests.multiprocess.scripts.pipeline_run import Recorder  # noqa: E402


def make_optimizer(name: str):
    if name == "muon":
        return lambda params: Muon(params, lr=0.02, adamw_lr=1e-2)
    if name == "corrected_muon":
        return lambda params: DelayCorrected(Muon(params, lr=0.02, adamw_lr=1e-2))
    if name == "muon_kernels_on_adamw":
        return lambda params: Muon(params, lr=0.02, adamw_lr=1e-2, muon_kernels=False)
    raise ValueError(name)


def train(devices: int, dims: int, optimizer: str, steps: int, microbatches: int = 2):
    torch.manual_seed(0)
    model = ConvClassifier(dims=dims, optimizer=make_optimizer(optimizer))
    recorder = Recorder()
    trainer = Trainer(
        accelerator="cpu",
        devices=devices,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder],
        strategy=AsyncPipelineStrategy(num_microbatches=microbatches, timeout=datetime.timedelta(seconds=120)),
    )
    trainer.fit(model, train_dataloaders=loader(conv_batches(steps, dims=dims)))
    return trainer, model, recorder.losses


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--dims", type=int, default=1)
    parser.add_argument("--optimizer", default="muon")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    trainer, model, losses = train(args.devices, args.dims, args.optimizer, args.steps)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.detach() for k, v in model.state_dict().items()}, out / f"weights_rank{trainer.global_rank}.pt")
    if trainer.global_rank == 0:
        (out / "losses.json").write_text(json.dumps(losses))


if __name__ == "__main__":
    main()
