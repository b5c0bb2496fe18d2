"""A small language model that is not the demo GPT, and a script that trains it with AsyncPipelineStrategy.

The model exercises what the demo GPT does not: weights tied across stages (the embedding reused as the
output head, and optionally a block matrix reused by a later block), blocks that recompute their forward in
backward with ``torch.utils.checkpoint``, and a second reference to the layers (``self.alias``).

Run as a script (Lightning's launcher starts one process per rank):

    python -m tests.multiprocess.scripts.toy_run --devices 2 --schedule 2bw --microbatches 2 --steps 8 \
        --tie-embedding --out DIR

Rank 0 writes ``DIR/result.json`` (the logged ``train/loss`` of every step); every rank writes its
module's state dict to ``DIR/weights_rank{R}.pt`` and, after every update it applied, the values of the
model's tied parameters to ``DIR/tied_rank{R}.pt``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_async_pp import AsyncPipelineStrategy  # noqa: E402
from lightning_async_pp.optim.muon import use_float32_newton_schulz  # noqa: E402
from tests.fixtures.helpers import loader, random_batches, run_script, save_stage  # noqa: E402

VOCAB, WIDTH = 256, 16


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(VOCAB, WIDTH)

    def forward(self, idx: Tensor) -> Tensor:
        return self.table(idx)


class Block(nn.Module):
    """Residual MLP block; with ``recompute`` it recomputes its inner part in backward (user-written)."""

    def __init__(self, recompute: bool = False) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)
        self.recompute = recompute

    def inner(self, x: Tensor) -> Tensor:
        return self.down(torch.tanh(self.up(x)))

    def forward(self, x: Tensor) -> Tensor:
        if self.recompute and torch.is_grad_enabled():
            return x + checkpoint(self.inner, x, use_reentrant=False)
        return x + self.inner(x)


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.out = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.norm(x))


class ToyLM(LightningModule):
    """``[Embed, Block x n_blocks, Head]``.

    Args:
        n_blocks: Number of blocks.
        tie_embedding: The head's output matrix is the embedding table (one parameter).
        tie_blocks: The last block's ``up`` matrix is the first block's (one parameter).
        recompute: Blocks recompute their forward in backward with ``torch.utils.checkpoint``.
        alias: Keep a second reference to the layers (``self.alias``, an ``nn.Sequential`` of the same modules).
        lr: AdamW learning rate.
        optimizer: ``"adamw"``, ``"adamw_by_name"`` (no weight decay for parameters named ``*table*``), or a name
            ``pipeline_run.make_optimizer`` knows (``"corrected_muon"``, ...).
    """

    def __init__(
        self,
        n_blocks: int = 3,
        tie_embedding: bool = False,
        tie_blocks: bool = False,
        recompute: bool = False,
        alias: bool = False,
        lr: float = 1e-2,
        optimizer: str = "adamw",
    ) -> None:
        super().__init__()
        self.lr = lr
        self.optimizer_name = optimizer
        self.layers = nn.ModuleList([Embed(), *[Block(recompute) for _ in range(n_blocks)], Head()])
        if tie_embedding:
            self.layers[-1].out.weight = self.layers[0].table.weight
        if tie_blocks:
            self.layers[n_blocks].up.weight = self.layers[1].up.weight
        if alias:
            self.alias = nn.Sequential(*self.layers)
        for index, layer in enumerate(self.layers):
            self.reset_pipeline_layer(index, layer)

    def tied_names(self) -> list[list[str]]:
        """The names of each shared parameter (every name under which the model reaches it)."""
        names: dict[int, list[str]] = {}
        for name, p in self.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
        return [group for group in names.values() if len(group) > 1]

    def reset_pipeline_layer(self, index: int, layer: nn.Module) -> None:
        if any(p.is_meta for p in layer.parameters()):
            return
        generator = torch.Generator().manual_seed(100 + index)
        shared = {id(p) for group in self.tied_names() for p in [self.get_parameter(group[0])]}
        first_use = {id(p) for i in range(index) for p in self.layers[i].parameters()}
        with torch.no_grad():
            for name, p in layer.named_parameters():
                if id(p) in shared and id(p) in first_use:
                    continue  # a tied parameter is initialised by the first layer that uses it
                if name.endswith("bias"):
                    p.zero_()
                elif "norm" in name:
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=generator) * 0.3)

    def pipeline_layers(self):
        return self.layers

    def pipeline_inputs(self, batch):
        return batch[0]

    def pipeline_loss(self, output, batch):
        return F.cross_entropy(output.reshape(-1, VOCAB), batch[1].reshape(-1))

    def training_step(self, batch, batch_idx):
        x = batch[0]
        for layer in self.layers:
            x = layer(x)
        return self.pipeline_loss(x, batch)

    def configure_optimizers(self):
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1)
        if self.optimizer_name == "adamw_by_name":
            # The common "no decay for embeddings" grouping by name: a stage sees only its own layers' names.
            named = list(self.named_parameters())
            return torch.optim.AdamW(
                [
                    {"params": [p for n, p in named if "table" in n], "weight_decay": 0.0},
                    {"params": [p for n, p in named if "table" not in n], "weight_decay": 0.1},
                ],
                lr=self.lr,
            )
        from tests.multiprocess.scripts.pipeline_run import make_optimizer

        return make_optimizer(self.optimizer_name)(self.parameters())


class Recorder(Callback):
    """Logged losses, and the tied parameters' values after every update this rank applied."""

    def __init__(self, tied_names: list[list[str]]) -> None:
        self.names = {n for group in tied_names for n in group}
        self.losses: list[float] = []
        self.steps: list[int] = []
        self.tied: list[tuple[int, dict[str, Tensor]]] = []

    def on_train_start(self, trainer, pl_module) -> None:
        stage = trainer.strategy.pipeline_stage
        if stage is None:  # one process: no runtime, the one-device path
            return
        runtime = stage.runtime
        assert runtime is not None and runtime.updates is not None, "the training runtime is built at setup"
        names = self.names
        apply = runtime.updates.apply

        def recorded(pending):
            apply(pending)
            state = pl_module.state_dict()
            self.tied.append((pending.step, {n: state[n].clone() for n in names if n in state}))

        runtime.updates.apply = recorded

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if "train/loss" in trainer.callback_metrics:
            self.losses.append(float(trainer.callback_metrics["train/loss"]))
            self.steps.append(trainer.global_step - 1)


def model_kwargs(args) -> dict:
    return dict(
        n_blocks=args.blocks,
        tie_embedding=args.tie_embedding,
        tie_blocks=args.tie_blocks,
        recompute=args.recompute,
        alias=args.alias,
        optimizer=args.optimizer,
    )


def strategy_kwargs(args) -> dict:
    kwargs = dict(schedule=args.schedule, num_microbatches=args.microbatches)
    if args.split_points:
        kwargs["split_points"] = [int(x) for x in args.split_points.split(",")]
    if args.activation_checkpointing:
        kwargs["activation_checkpointing"] = json.loads(args.activation_checkpointing)
    return kwargs


def run_toy(out: Path, devices: int, *args: str, timeout: float = 420):
    """Run this script on ``devices`` processes; returns (result, merged weights, per-rank tied records)."""
    code, output = run_script(
        [sys.executable, "-m", __spec__.name, "--devices", str(devices), "--out", str(out), *args], timeout
    )
    assert code == 0, output[-6000:]
    result = json.loads((out / "result.json").read_text())
    weights, tied = {}, []
    for rank in range(devices):
        weights.update(torch.load(out / f"weights_rank{rank}.pt"))
        tied.append(torch.load(out / f"tied_rank{rank}.pt"))
    return result, weights, tied


def reference_toy(*args: str, steps: int = 8, clip: float | None = None):
    """The same run on one device, in this process: (losses, state dict, model)."""
    from tests.fixtures.helpers import fit

    parser_args = _parser().parse_args(["--out", "unused", "--steps", str(steps), *args])
    torch.set_num_threads(1)
    model = ToyLM(**model_kwargs(parser_args))
    batches = random_batches(parser_args.total_steps or steps, batch_size=6, block=8)
    strategy = AsyncPipelineStrategy(**strategy_kwargs(parser_args))
    losses = fit(model, batches, strategy=strategy, gradient_clip_val=clip)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, model


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--pipeline-size", type=int, default=None)
    parser.add_argument("--schedule", default="2bw")
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--total-steps", type=int, default=None, help="batches in the data (default: --steps)")
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--tie-embedding", action="store_true")
    parser.add_argument("--tie-blocks", action="store_true")
    parser.add_argument("--recompute", action="store_true")
    parser.add_argument("--alias", action="store_true")
    parser.add_argument("--meta", action="store_true", help="build the model with trainer.init_module(empty_init=True)")
    parser.add_argument("--activation-checkpointing", default=None, help="JSON value of the strategy option")
    parser.add_argument("--clip", type=float, default=None)
    parser.add_argument("--split-points", default=None)
    parser.add_argument("--save-checkpoint", action="store_true")
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument(
        "--checkpoint-at",
        type=int,
        default=None,
        help="ModelCheckpoint saves DIR/at-{step}.ckpt after this many steps (and the run goes on)",
    )
    parser.add_argument("--ckpt-path", default=None, help="resume from this checkpoint")
    parser.add_argument(
        "--muon-ns-float32",
        action="store_true",
        help="Muon's Newton-Schulz in float32 (results that do not depend on the CPU's bfloat16)",
    )
    parser.add_argument("--out", required=True)
    return parser


def main(argv=None) -> None:
    args = _parser().parse_args(argv)
    with use_float32_newton_schulz() if args.muon_ns_float32 else contextlib.nullcontext():
        _run(args)


def _run(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)

    strategy = AsyncPipelineStrategy(
        pipeline_parallel_size=args.pipeline_size, timeout=timedelta(seconds=120), **strategy_kwargs(args)
    )
    recorder = Recorder([])
    callbacks: list[Callback] = [recorder]
    if args.checkpoint_at:
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks.append(
            ModelCheckpoint(
                dirpath=args.out,
                filename="at-{step}",
                auto_insert_metric_name=False,
                every_n_train_steps=args.checkpoint_at,
                save_top_k=-1,
            )
        )
    trainer = Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=bool(args.checkpoint_at),
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        gradient_clip_val=args.clip,
    )
    with trainer.init_module(empty_init=args.meta):
        model = ToyLM(**model_kwargs(args))
    recorder.names = {n for group in model.tied_names() for n in group}  # before the stages drop layers
    batches = random_batches(args.total_steps or args.steps, batch_size=6, block=8)
    trainer.fit(model, train_dataloaders=loader(batches), ckpt_path=args.ckpt_path)

    out = Path(args.out)
    rank = save_stage(trainer, model, out, args.save_checkpoint)
    torch.save(recorder.tied, out / f"tied_rank{rank}.pt")
    if rank == 0:
        (out / "result.json").write_text(json.dumps({"losses": recorder.losses, "steps": recorder.steps}))


if __name__ == "__main__":
    main()
