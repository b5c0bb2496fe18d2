"""Trains with start_method="spawn" (as in a notebook) and prints how far the returned model is from one device."""

from lightning.pytorch import Trainer  # noqa: E402

from lightning_async_pp import AsyncPipelineStrategy  # noqa: E402
from tests.fixtures.helpers import loader, random_batches, tiny_gpt  # noqa: E402


def train(devices, **strategy_kwargs):
    model = tiny_gpt(n_layer=4)
    Trainer(
        strategy=AsyncPipelineStrategy(num_microbatches=2, **strategy_kwargs),
        accelerator="cpu",
        devices=devices,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        max_steps=4,
    ).fit(model, loader(random_batches(4)))
    return model


if __name__ == "__main__":
    spawned, reference = train(2, start_method="spawn"), train(1)
    difference = max(
        (a - b).abs().max().item() for a, b in zip(spawned.state_dict().values(), reference.state_dict().values())
    )
    moved = max(
        (a - b).abs().max().item()
        for a, b in zip(spawned.state_dict().values(), tiny_gpt(n_layer=4).state_dict().values())
    )
    print(f"MAXDIFF {difference} MOVED {moved}")
