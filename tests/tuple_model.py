"""A tiny language model whose layers pass several tensors: a dict or a tuple of hidden states, a gate that
carries gradients, token ids (integers, no gradient) and a float mask computed without grad.

    python tests/tuple_model.py --devices 2 --schedule 1f1b --steps 8 --out DIR

trains it with AsyncPipelineStrategy; rank 0 writes ``DIR/losses.json``, every rank ``DIR/weights_rank{R}.pt``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from helpers import LossRecorder, loader, random_batches  # noqa: E402

from lightning_async_pp import AsyncPipelineStrategy  # noqa: E402

VOCAB, WIDTH = 256, 16


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.gate = nn.Linear(WIDTH, WIDTH)

    def forward(self, ids):
        h = self.tok(ids)
        with torch.no_grad():
            mask = (ids % 3 != 0).float().unsqueeze(-1)  # float, but without grad: travels forward only
        return {"h": h, "gate": torch.sigmoid(self.gate(h)), "ids": ids, "mask": mask}


class Mix(nn.Module):
    """Reads every entry; the gate and the hidden states both carry gradients."""

    def __init__(self, as_tuple: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.as_tuple = as_tuple

    def forward(self, x):
        if isinstance(x, tuple):
            h, gate, ids, mask = x
        else:
            h, gate, ids, mask = x["h"], x["gate"], x["ids"], x["mask"]
        h = h + torch.tanh(self.fc(h)) * gate * mask + 0.01 * ids.unsqueeze(-1).float()
        gate = gate * 0.9 + 0.1 * torch.sigmoid(h)
        return (h, gate, ids, mask) if self.as_tuple else {"h": h, "gate": gate, "ids": ids, "mask": mask}


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(WIDTH, VOCAB)

    def forward(self, x):
        h, gate = (x[0], x[1]) if isinstance(x, tuple) else (x["h"], x["gate"])
        return self.out(h * gate)


class TupleLM(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([Embed(), Mix(False), Mix(True), Mix(True), Mix(False), Head()])

    def pipeline_layers(self):
        return self.layers

    def pipeline_inputs(self, batch):
        return batch[0]

    def pipeline_loss(self, output, batch):
        return F.cross_entropy(output.reshape(-1, VOCAB), batch[1].reshape(-1))

    def training_step(self, batch, batch_idx):
        x = self.pipeline_inputs(batch)
        for layer in self.layers:
            x = layer(x)
        return self.pipeline_loss(x, batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def train(devices: int, schedule: str, microbatches: int, steps: int, split_points=None):
    torch.set_num_threads(1)
    model = TupleLM()
    recorder = LossRecorder()
    trainer = Trainer(
        accelerator="cpu",
        devices=devices,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        strategy=AsyncPipelineStrategy(
            schedule=schedule,
            num_microbatches=microbatches,
            split_points=split_points,
            timeout=__import__("datetime").timedelta(seconds=120),
        ),
        callbacks=[recorder],
    )
    trainer.fit(model, loader(random_batches(steps)))
    return trainer, model, recorder.losses


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--split-points", default=None, help="e.g. 3 or 2,4")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    split = [int(s) for s in args.split_points.split(",")] if args.split_points else None
    trainer, model, losses = train(args.devices, args.schedule, args.microbatches, args.steps, split)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.cpu() for k, v in model.state_dict().items()}, out / f"weights_rank{trainer.global_rank}.pt")
    if trainer.global_rank == 0:
        (out / "losses.json").write_text(json.dumps(losses))


if __name__ == "__main__":
    main()
