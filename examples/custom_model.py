"""Making your own model pipeline-ready: a residual MLP classifier trained as a 2-stage 2BW pipeline.

python examples/custom_model.py                 # 2 stages on 2 CPU processes
python examples/custom_model.py --devices 1     # the exact same trajectory on one process
"""

import argparse

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_async_pp import AsyncPipelineStrategy, PipelineModule


class Residual(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class ResidualMLP(PipelineModule):
    def __init__(self, in_features: int = 32, dim: int = 128, depth: int = 6, classes: int = 10, lr: float = 1e-3):
        super().__init__()
        self.save_hyperparameters()
        # The pipeline contract, part 1: an ordered list of layers, each mapping one tensor to one tensor.
        self.layers = nn.ModuleList(
            [nn.Linear(in_features, dim)] + [Residual(dim) for _ in range(depth)] + [nn.Linear(dim, classes)]
        )

    def pipeline_layers(self):
        return self.layers

    # Part 2: what the first layer receives from a (micro-)batch ...
    def pipeline_inputs(self, batch):
        return batch[0]

    # ... and part 3: the loss from the last layer's output, a mean over the (micro-)batch.
    def pipeline_loss(self, output, batch):
        return F.cross_entropy(output, batch[1])

    # PipelineModule derives forward, training_step, validation_step, ... from the three methods above, so
    # the same module also trains without the strategy (strategy="ddp", or one device).
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def synthetic_data(samples: int = 4096, in_features: int = 32, classes: int = 10) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, in_features, generator=generator)
    teacher = torch.randn(in_features, classes, generator=generator)
    y = (x @ teacher).argmax(dim=1)
    dataset = TensorDataset(x, y)
    # One shuffled order on one device and on every stage alike, so that the two runs can be compared (on one
    # device Lightning keeps a loader's own sampler; a pipeline gives a shuffled loader a seeded one).
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    return DataLoader(dataset, batch_size=64, sampler=sampler, drop_last=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=200)
    args = parser.parse_args()
    L.seed_everything(0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=AsyncPipelineStrategy(schedule="2bw", num_microbatches=4),
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(ResidualMLP(), synthetic_data())
    if trainer.is_global_zero:
        print(f"final train/loss: {float(trainer.callback_metrics['train/loss']):.6f}")


if __name__ == "__main__":
    main()
