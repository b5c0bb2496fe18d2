"""Small models, data and runners shared by the tests."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader

from lightning_async_pp.demos import GPT

VOCAB, BLOCK = 256, 16


def tiny_gpt(**kwargs) -> GPT:
    defaults = dict(vocab_size=VOCAB, block_size=BLOCK, n_layer=2, n_head=2, n_embd=32, lr_schedule="constant")
    defaults.update(kwargs)
    return GPT(**defaults)


def random_batches(
    num_batches: int, batch_size: int = 8, seed: int = 0, block: int = BLOCK
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    data = torch.randint(0, VOCAB, (num_batches, batch_size, block + 1), generator=generator)
    return [(row[:, :-1].clone(), row[:, 1:].clone()) for row in data]


def global_batches(steps: int, replicas: int, **kwargs) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """What ``replicas`` pipeline replicas read together at each step from ``random_batches(steps * replicas)``.

    At step t replica r reads the t-th item of its shard (Lightning's DistributedSampler for training:
    shuffled with seed 0); the global batch is the union of the replicas' batches.
    """
    from torch.utils.data import DistributedSampler

    items = random_batches(steps * replicas, **kwargs)
    shards = [
        list(DistributedSampler(items, num_replicas=replicas, rank=r, shuffle=True, seed=0)) for r in range(replicas)
    ]
    return [tuple(torch.cat([items[shards[r][t]][k] for r in range(replicas)]) for k in range(2)) for t in range(steps)]


def loader(batches) -> DataLoader:
    # Each item is already a batch; batch_size=None hands it through unchanged.
    return DataLoader(batches, batch_size=None, shuffle=False)


class LossRecorder(Callback):
    """Records the loss that each training step returned."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def fit(model, batches, strategy="auto", ckpt_path=None, **trainer_kwargs) -> list[float]:
    recorder = LossRecorder()
    kwargs = dict(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=len(batches),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[recorder],
    )
    kwargs.update(trainer_kwargs)
    Trainer(**kwargs).fit(model, train_dataloaders=loader(batches), ckpt_path=ckpt_path)
    return recorder.losses


def flat_weights(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def run_group(
    command: list,
    timeout: float,
    cwd=None,
    env: dict | None = None,
    merge_stderr: bool = False,
    raise_on_timeout: bool = False,
) -> subprocess.CompletedProcess:
    """``subprocess.run(command, capture_output=True, text=True)`` for commands that start more processes (Lightning's
    launcher, torchrun, spawn): the command runs in a session of its own, and every process of that session is
    killed when the command returns or times out, so that no rank outlives the test. A timeout fails the test
    (``raise_on_timeout``: raises ``TimeoutError``, outside pytest). ``merge_stderr``: stderr goes to stdout, in
    the order written, and the result's ``stderr`` is empty."""
    command = [str(c) for c in command]
    stderr_to = subprocess.STDOUT if merge_stderr else subprocess.PIPE
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=stderr_to, text=True, cwd=cwd, env=env, start_new_session=True
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_session(process.pid)
        stdout, stderr = process.communicate()
        stderr = stderr or ""
        message = f"{' '.join(command[:3])} timed out after {timeout}s:\n{stdout[-4000:]}{stderr[-3000:]}"
        if raise_on_timeout:
            raise TimeoutError(message) from None
        import pytest

        pytest.fail(message)
    _kill_session(process.pid)  # a child that outlived its parent (an orphaned rank)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr or "")


def _kill_session(pid: int) -> None:
    try:
        os.killpg(pid, 9)
    except (ProcessLookupError, PermissionError):
        pass


def run_script(command: list[str], timeout: float, raise_on_timeout: bool = False) -> tuple[int, str]:
    """Run a training script (which may start more processes) with ``run_group``, with one intra-op thread per
    process. Returns the exit status and the combined output."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    done = run_group(command, timeout, env=env, merge_stderr=True, raise_on_timeout=raise_on_timeout)
    return done.returncode, done.stdout


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """Import ``benchmarks/<name>.py`` as module ``name`` (the scripts are not a package).

    The benchmarks folder goes on ``sys.path`` so a script finds ``bench_common`` as it does when run, and the
    module is registered in ``sys.modules`` while it executes (dataclasses look their module up there).
    """
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


class ConvClassifier(LightningModule):
    """A small convolutional classifier (``dims=1``: Conv1d on sequences, ``dims=2``: Conv2d on images),
    pipeline-ready: two conv layers and a head (mean over positions, then a linear layer named ``head``)."""

    def __init__(self, dims: int = 1, channels: int = 8, classes: int = 4, optimizer=None) -> None:
        super().__init__()
        conv = {1: nn.Conv1d, 2: nn.Conv2d}[dims]
        self.dims, self.optimizer = dims, optimizer
        self.layers = nn.ModuleList(
            [
                nn.Sequential(conv(2, channels, 3, padding=1), nn.GELU()),
                nn.Sequential(conv(channels, channels, 3, padding=1), nn.GELU()),
                _MeanHead(channels, classes),
            ]
        )

    def pipeline_layers(self):
        return self.layers

    def pipeline_inputs(self, batch):
        return batch[0]

    def pipeline_loss(self, output, batch):
        return nn.functional.cross_entropy(output, batch[1])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x

    def training_step(self, batch, batch_idx):
        return self.pipeline_loss(self(batch[0]), batch)

    def configure_optimizers(self):
        return self.optimizer(self.named_parameters())


class _MeanHead(nn.Module):
    def __init__(self, channels: int, classes: int) -> None:
        super().__init__()
        self.head = nn.Linear(channels, classes)

    def forward(self, x):
        return self.head(x.flatten(2).mean(dim=2))


def conv_batches(num_batches: int, dims: int = 1, batch_size: int = 8, seed: int = 0):
    """Random inputs (2 channels, length 16 or 8 x 8) and labels for :class:`ConvClassifier`."""
    generator = torch.Generator().manual_seed(seed)
    shape = (16,) if dims == 1 else (8, 8)
    return [
        (
            torch.randn(batch_size, 2, *shape, generator=generator),
            torch.randint(0, 4, (batch_size,), generator=generator),
        )
        for _ in range(num_batches)
    ]


def save_stage(trainer, model, out: Path, save_checkpoint: bool) -> int:
    """In a training script: the checkpoint (if asked) and this rank's state dict; returns the rank."""
    out.mkdir(parents=True, exist_ok=True)
    if save_checkpoint:
        trainer.save_checkpoint(out / "final.ckpt")
    rank = trainer.global_rank
    torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, out / f"weights_rank{rank}.pt")
    return rank
