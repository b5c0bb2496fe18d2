"""Trains the tiny GPT or a tiny Llama with compiled blocks under AsyncPipelineStrategy; saves what a test compares.

    python -m tests.multiprocess.scripts.compile_run --model gpt --devices 2 --backend aot_eager --out DIR

``--where option`` compiles through the model's ``compile`` argument; ``--where configure_model`` compiles the
blocks in the model's ``configure_model``, as a user's own model would. Every rank writes its stage's state
dict to ``DIR/weights_rank{R}.pt`` and ``DIR/compile_rank{R}.json``: dynamo's compiled frames and graphs after
each step, and how many of its modules are compiled; rank 0 adds the losses.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
from lightning.pytorch import Callback
from torch._dynamo.utils import counters

from lightning_async_pp import AsyncPipelineStrategy
from lightning_async_pp.demos.gpt import GPT, Block
from lightning_async_pp.models.compiling import is_compiled
from tests.fixtures.helpers import fit, random_batches, save_stage, tiny_gpt
from tests.fixtures.hf_models import adamw, tiny_causal_lm, token_batches


class CompiledInConfigureModel(GPT):
    """A user's model that compiles its own transformer blocks in ``configure_model``."""

    def __init__(self, backend: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.backend = backend

    def configure_model(self) -> None:
        for layer in self.layers:
            if isinstance(layer, Block):
                layer.compile(backend=self.backend)


class CompileRecorder(Callback):
    """Dynamo's totals after each step (frames compiled, distinct graphs) and the step's loss."""

    def __init__(self) -> None:
        self.frames: list[int] = []
        self.graphs: list[int] = []
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.frames.append(int(counters["frames"]["total"]))
        self.graphs.append(int(counters["stats"]["unique_graphs"]))
        if "train/loss" in trainer.callback_metrics:
            self.losses.append(float(trainer.callback_metrics["train/loss"]))


def build(args: argparse.Namespace):
    option = False if args.backend == "none" else {"backend": args.backend}
    if args.model == "llama":
        return tiny_causal_lm("llama", optimizer=adamw, compile=option)
    if args.where == "configure_model":
        return CompiledInConfigureModel(
            args.backend, vocab_size=256, block_size=16, n_layer=4, n_head=2, n_embd=32, lr_schedule="constant",
            optimizer=adamw,
        )  # fmt: skip
    return tiny_gpt(n_layer=4, optimizer=adamw, compile=option)


def batches(model: str, steps: int) -> list:
    return token_batches(steps) if model == "llama" else random_batches(steps)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["gpt", "llama"], default="gpt")
    parser.add_argument("--where", choices=["option", "configure_model"], default="option")
    parser.add_argument("--backend", default="aot_eager", help="torch.compile's backend; 'none': eager")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--recompute", action="store_true", help="activation_checkpointing=True")
    parser.add_argument("--save-checkpoint", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    model = build(args)
    strategy = AsyncPipelineStrategy(
        schedule="2bw",
        num_microbatches=args.microbatches,
        activation_checkpointing=args.recompute,
        timeout=datetime.timedelta(seconds=120),
    )
    recorder = CompileRecorder()
    fit(model, batches(args.model, args.steps), strategy=strategy, devices=args.devices, callbacks=[recorder])
    trainer = model.trainer
    out = Path(args.out)
    rank = save_stage(trainer, model, out, args.save_checkpoint)
    compiled = sum(is_compiled(module) for module in model.modules())
    record = {"frames": recorder.frames, "graphs": recorder.graphs, "compiled": compiled}
    if rank == 0:
        record["losses"] = recorder.losses
    (out / f"compile_rank{rank}.json").write_text(json.dumps(record))
    trainer.strategy.barrier()  # rank 0's exit ends the job: every rank has written its files by then


if __name__ == "__main__":
    main()
