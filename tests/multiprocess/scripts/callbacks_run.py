"""Lightning's monitoring callbacks and trainer.validate/test/predict on a pipeline, for test_native.py
(from the repository root):

    python -m tests.multiprocess.scripts.callbacks_run fit --devices 2 --out DIR                    # 2 stages
    python -m tests.multiprocess.scripts.callbacks_run fit --devices 4 --pipeline-size 2 --out DIR  # 2 x 2
    python -m tests.multiprocess.scripts.callbacks_run evaluate --devices 2 --out DIR               # validate...

Every rank writes ``DIR/rank{R}.json`` with what its callbacks saw and did; ``devices=1`` runs the same thing in
one process with the single-device 2BW reference (``run(...)`` is also called in-process by the tests).
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from lightning_async_pp import AsyncPipelineStrategy, PipelineModule  # noqa: E402
from tests.fixtures.helpers import loader, random_batches, tiny_gpt  # noqa: E402

STEPS, VAL_EVERY = 24, 2


class Seen(Callback):
    """What this rank's callbacks could read: the monitored values at each validation end and train step."""

    def __init__(self) -> None:
        self.val: list[tuple[int, float]] = []
        self.train_keys: list[list[str]] = []

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self.val.append((trainer.global_step, float(trainer.callback_metrics["val/loss"])))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.train_keys.append(sorted(trainer.callback_metrics))


def _checkpoint_state(callback: ModelCheckpoint) -> dict:
    return {
        "best_k": {Path(p).name: float(v) for p, v in callback.best_k_models.items()},
        "best": Path(callback.best_model_path).name,
        "files": sorted(p.name for p in Path(callback.dirpath).glob("*.ckpt")),
    }


def fit(
    devices: int, out: Path, pipeline_size: int | None = None, batches=None, microbatches: int | str = "auto"
) -> dict:
    """Train with the monitoring callbacks. ``batches``: the training data (default: what each of the
    ``devices / pipeline_size`` replicas reads its shard of); 4 validation batches, sharded likewise."""
    torch.set_num_threads(1)
    model = tiny_gpt(n_layer=2, lr_schedule="cosine", optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    val_ckpt = ModelCheckpoint(dirpath=out / "val_ckpt", monitor="val/loss", save_top_k=2, filename="val-{step}")
    train_ckpt = ModelCheckpoint(
        dirpath=out / "train_ckpt", monitor="train/loss", every_n_train_steps=2, save_top_k=2, filename="train-{step}"
    )
    stopper = EarlyStopping(monitor="val/loss", patience=2, min_delta=0.01)
    seen = Seen()
    trainer = Trainer(
        accelerator="cpu",
        devices=devices,
        max_steps=STEPS,
        val_check_interval=VAL_EVERY,
        check_val_every_n_epoch=None,
        strategy=AsyncPipelineStrategy(
            num_microbatches=microbatches, pipeline_parallel_size=pipeline_size, timeout=datetime.timedelta(seconds=120)
        ),
        callbacks=[val_ckpt, train_ckpt, stopper, LearningRateMonitor(logging_interval="step"), seen],
        logger=CSVLogger(out, name="logs", version=0),
        log_every_n_steps=2,
        num_sanity_val_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = batches if batches is not None else random_batches(STEPS * (devices // (pipeline_size or devices)))
    trainer.fit(model, loader(data), loader(random_batches(4, seed=1)))
    result = {
        "global_step": trainer.global_step,
        "stopped": trainer.should_stop,
        "stopping_reason": stopper.stopping_reason_message,
        "val_ckpt": _checkpoint_state(val_ckpt),
        "train_ckpt": _checkpoint_state(train_ckpt),
        "val_seen": seen.val,
        "train_loss_seen_from_step": next((i for i, keys in enumerate(seen.train_keys) if "train/loss" in keys), None),
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
    return result


class Classifier(PipelineModule):
    """A small MLP classifier: the contract, a torchmetrics test metric, and nothing else."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3)])
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
        self.test_accuracy = MulticlassAccuracy(num_classes=3, average="micro")

    def pipeline_layers(self):
        return self.layers

    def pipeline_inputs(self, batch):
        return batch[0]

    def pipeline_loss(self, output, batch):
        return F.cross_entropy(output, batch[1])

    def pipeline_validation_step(self, output, batch, batch_idx):
        loss = super().pipeline_validation_step(output, batch, batch_idx)
        self.log("val/loss_synced", loss, sync_dist=True)  # runs on the last stage only: must not wait for others
        return loss

    def pipeline_test_step(self, output, batch, batch_idx):
        loss = super().pipeline_test_step(output, batch, batch_idx)
        self.test_accuracy(output, batch[1])
        self.log("test/accuracy", self.test_accuracy)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def classification_data(samples: int = 100) -> DataLoader:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(samples, 8, generator=generator)
    y = torch.randint(0, 3, (samples,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=16)  # the last batch is smaller (4)


def evaluate(devices: int, out: Path, strategy: bool = True) -> dict:
    torch.set_num_threads(1)
    model = Classifier()
    trainer = Trainer(
        accelerator="cpu",
        devices=devices,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        strategy=AsyncPipelineStrategy(timeout=datetime.timedelta(seconds=120)) if strategy else "auto",
    )
    validated = trainer.validate(model, classification_data(), verbose=False)
    tested = trainer.test(model, classification_data(), verbose=False)
    test_callback_metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    predictions = trainer.predict(model, classification_data())
    result = {
        "validate": validated,
        "test": tested,
        "test_callback_metrics": test_callback_metrics,
        "predictions": None if predictions is None or predictions[0] is None else torch.cat(predictions).tolist(),
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
    return result


def train_classifier(
    devices: int, out: Path | None, strategy="auto", data=None, batch_size: int = 32, steps: int = 5
) -> dict:
    """Train ``Classifier`` with any strategy; ``devices`` processes share each global batch of ``batch_size``
    (``data``: the batches instead, for one device)."""
    torch.set_num_threads(1)
    model = Classifier()
    losses = []

    class Losses(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            losses.append(float(trainer.callback_metrics["train/loss"]))

    trainer = Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        callbacks=[Losses()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = data if data is not None else DataLoader(classification_data().dataset, batch_size=batch_size // devices)
    trainer.fit(model, data)
    result = {"weights": {k: v.tolist() for k, v in model.state_dict().items()}, "losses": losses}
    if out is not None:
        (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["fit", "evaluate", "ddp"])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--pipeline-size", type=int, default=None)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.mode == "fit":
        fit(args.devices, args.out, args.pipeline_size)
    elif args.mode == "ddp":
        train_classifier(args.devices, args.out, strategy="ddp")
        # Lightning's DDP leaves the gloo group to the interpreter's exit, where its threads can be torn down
        # while running (abort: "terminate called without an active exception"): close it first.
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    else:
        evaluate(args.devices, args.out)
