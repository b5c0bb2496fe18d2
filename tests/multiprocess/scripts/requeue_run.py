"""Trains the tiny GPT on 2 stages as a (faked) SLURM job with auto-requeue, for test_requeue.py.

    python -m tests.multiprocess.scripts.requeue_run --out DIR --root ROOT --steps 10 \
        [--signal-rank R --signal-step S]

Without ``SLURM_PROCID`` in its environment the script plays ``srun``: it starts one copy of itself per task with
the variables SLURM sets (``SLURM_JOB_ID``, ``SLURM_PROCID``, ...), ``MASTER_PORT`` and, first on ``PATH``, a fake
``scontrol`` that appends its arguments to ``DIR/scontrol.txt``, and exits with the largest exit status.

Each task trains with ``default_root_dir=ROOT`` and ``ckpt_path=None``, so a job started again on the same ROOT
resumes from the HPC checkpoint there, as a requeued job does. Rank ``R`` sends itself the requeue signal (SIGUSR1)
after step ``S``. Each rank writes ``DIR/rank{r}.json`` (``losses`` and ``steps`` of the steps it ran, ``stopped_at``:
the ``global_step`` at which a ``SIGTERMException`` reached ``on_exception``, or null) and, when training ends
normally, its stage's weights to ``DIR/weights_rank{r}.pt``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import stat
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_async_pp import AsyncPipelineStrategy
from lightning_async_pp.optim.muon import use_float32_newton_schulz
from tests.fixtures.helpers import loader, random_batches, tiny_gpt
from tests.multiprocess.scripts.pipeline_run import Recorder, make_optimizer

TASKS = 2
JOB_ID = "4242"


class SignalAndRecord(Recorder):
    def __init__(self, out: Path, signal_rank: int, signal_step: int) -> None:
        super().__init__()
        self.out, self.signal_rank, self.signal_step = out, signal_rank, signal_step
        self.stopped_at = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if trainer.global_rank == self.signal_rank and trainer.global_step == self.signal_step:
            os.kill(os.getpid(), signal.SIGUSR1)

    def on_exception(self, trainer, pl_module, exception) -> None:
        if isinstance(exception, SIGTERMException):
            self.stopped_at = trainer.global_step
        self.write(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        self.write(trainer)

    def write(self, trainer) -> None:
        record = {"losses": self.losses, "steps": self.steps, "stopped_at": self.stopped_at}
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def train(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    out = Path(args.out)
    model = tiny_gpt(n_layer=4, optimizer=make_optimizer("corrected_muon"), lr_schedule="cosine")
    recorder = SignalAndRecord(out, args.signal_rank, args.signal_step)
    trainer = Trainer(
        accelerator="cpu",
        devices=TASKS,
        strategy=AsyncPipelineStrategy(num_microbatches=4, start_method="popen", timeout=timedelta(seconds=60)),
        max_steps=args.steps,
        default_root_dir=args.root,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        gradient_clip_val=0.5,
        callbacks=[recorder],
    )
    try:
        with use_float32_newton_schulz():
            trainer.fit(model, train_dataloaders=loader(random_batches(args.steps)))
    except SIGTERMException:
        return  # stopped by the signal: the requeue checkpoint is written, the job requeued
    state = {k: v.detach() for k, v in model.state_dict().items()}
    torch.save(state, out / f"weights_rank{trainer.global_rank}.pt")


def srun(argv: list[str], out: Path) -> int:
    """Start one task per rank as SLURM would, with a fake ``scontrol``; the largest exit status."""
    bin_dir = out / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {out / "scontrol.txt"}\n')
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tasks = []
    for rank in range(TASKS):
        env = dict(os.environ)
        env.update(
            SLURM_JOB_ID=JOB_ID,
            SLURM_JOB_NAME="requeue-test",
            SLURM_NTASKS=str(TASKS),
            SLURM_NTASKS_PER_NODE=str(TASKS),
            SLURM_NNODES="1",
            SLURM_NODEID="0",
            SLURM_NODELIST="127.0.0.1",
            SLURM_PROCID=str(rank),
            SLURM_LOCALID=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
        )
        tasks.append(subprocess.Popen([sys.executable, "-m", "tests.multiprocess.scripts.requeue_run", *argv], env=env))
    return max(task.wait() for task in tasks)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--signal-rank", type=int, default=-1)
    parser.add_argument("--signal-step", type=int, default=-1)
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if "SLURM_PROCID" not in os.environ:
        sys.exit(srun(sys.argv[1:], Path(args.out)))
    train(args)


if __name__ == "__main__":
    main()
