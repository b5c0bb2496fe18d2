"""A training run's lifecycle under a pipeline: its data order, resuming mid-epoch, and the optimizer-step hooks.

**Data order.** Every stage of a pipeline reads the same batches, in the same order. Each process of a
pipeline runs its own training dataloader: the first stage takes the inputs of a batch, the last stage the
targets of *its* batch. If the processes shuffle differently, the two come from different
samples. With several processes the strategy therefore gives every stage of one pipeline the same data order,
and each replica its own shard, whatever the processes' global random states:

- a shuffled ``DataLoader`` (``shuffle=True``: a ``RandomSampler``) gets a ``DistributedSampler`` with one seed
  agreed by all processes (rank 0's ``seed_everything`` seed, or 0), reshuffled from that seed and the epoch,
  so a run resumed in another epoch draws the same order as the uninterrupted one (Lightning's DDP replaces it
  with a ``DistributedSampler`` too; a ``RandomSampler`` draws from each process's random state, which the
  stages do not share);
- a ``DistributedSampler`` of the user's keeps its settings (its order on every stage alike), and any other
  sampler of the user's is kept as it is: it must give every stage the same order (seed it with a constant);
- worker processes get their seeds from that seed and the epoch too, and ``seed_everything(workers=True)``
  mixes in the replica, not the global rank, so random transforms in workers agree between the stages;
- replicas (data parallelism) read disjoint shards, as with DDP.

On one device there is one stage: the loader is left as the user made it, sampler included, as Lightning's
single-device strategy leaves it.

What this cannot reach (a sampler of the user's own that draws from the process's random state, random
transforms in the main process, a dataset that differs per process) is caught by the micro-batch fingerprint:
see :mod:`lightning_async_pp.runtime.fingerprint`.

**Resuming.** :class:`ResumableLoader` continues a training epoch at the batch where a checkpoint left it.

**Hooks.** Lightning's optimizer-step hooks for a pipeline stage, whose updates the stage runtime applies
itself: :func:`before_optimizer_step`, and the refusal of an overridden ``configure_gradient_clipping``.

**Micro-batches.** ``num_microbatches="auto"`` is decided by the first training batch
(:func:`choose_num_microbatches`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from functools import partial
from operator import attrgetter
from typing import Any

import torch
from lightning.fabric.utilities.data import sized_len
from lightning.fabric.utilities.seed import pl_worker_init_function
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer import call
from lightning.pytorch.trainer.connectors.data_connector import _worker_check
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import _update_dataloader
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.optim import Optimizer
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from lightning_async_pp.runtime.microbatch import auto_num_microbatches, batch_size_of

log = logging.getLogger("lightning.pytorch.strategies.async_pp")

# Keeps the stream of worker base seeds apart from the shuffle, which uses `seed + epoch` itself.
_WORKER_STREAM = 0x5EED


def choose_num_microbatches(batch: Any, num_stages: int, announce: bool) -> int:
    """``num_microbatches="auto"``: the smallest valid number for this batch's size (logged if ``announce``)."""
    size = batch_size_of(batch)
    count = auto_num_microbatches(size, num_stages)
    if announce:
        log.info(
            f"num_microbatches='auto': {count} micro-batches of {size // count} samples, the smallest number that "
            f"is at least the {num_stages} pipeline stage(s) and divides the batch size {size}"
        )
    return count


def local_seed() -> int:
    """This process's candidate for the data seed: the ``seed_everything`` seed, or 0 (Lightning's DDP default)."""
    return int(os.environ.get("PL_GLOBAL_SEED", 0))


class EpochSampler(DistributedSampler):
    """``DistributedSampler`` that also reseeds the dataloader's worker seeds from ``seed`` and the epoch.

    A ``DataLoader`` draws its workers' base seed from its ``generator`` each time an epoch's iterator starts;
    reseeding that generator at :meth:`set_epoch` makes every stage (and a resumed run) give its workers the
    same seeds.
    """

    def __init__(self, *args: Any, worker_generator: torch.Generator, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.worker_generator = worker_generator
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.worker_generator.manual_seed(self.seed * 1_000_003 + _WORKER_STREAM + epoch)


def same_order_loader(dataloader: Any, seed: int, num_replicas: int, replica: int) -> Any:
    """Make a training dataloader read the same order on every stage of a pipeline.

    Args:
        dataloader: The training dataloader, after Lightning's own processing (with replicas it already has a
            ``DistributedSampler`` built from :func:`sampler_kwargs`).
        seed: The seed all processes agreed on.
        num_replicas: Number of pipeline replicas ``D``.
        replica: This process's replica.

    Returns:
        The dataloader to use: a shuffled one is rebuilt around an :class:`EpochSampler`; others are returned
        with their worker seeding fixed.
    """
    if not isinstance(dataloader, DataLoader):
        return dataloader
    sampler = dataloader.sampler
    shuffled = isinstance(sampler, RandomSampler) and not sampler.replacement and sampler._num_samples is None
    if shuffled or type(sampler) is DistributedSampler:
        generator = torch.Generator()
        if shuffled:
            arguments = dict(num_replicas=num_replicas, rank=replica, shuffle=True, seed=seed)
        else:  # Lightning's, for replicas (or the user's own): keep its order, add the worker seeding
            arguments = dict(
                num_replicas=sampler.num_replicas,
                rank=sampler.rank,
                shuffle=sampler.shuffle,
                seed=sampler.seed,
                drop_last=sampler.drop_last,
            )
        epoch_sampler = EpochSampler(dataloader.dataset, worker_generator=generator, **arguments)
        dataloader = _update_dataloader(dataloader, epoch_sampler, mode=RunningStage.TRAINING)
        dataloader.generator = generator
    elif dataloader.num_workers > 0 and getattr(dataloader, "generator", None) is None:
        # Not shuffled by us: still give the workers one base-seed stream on every stage.
        dataloader.generator = torch.Generator().manual_seed(seed * 1_000_003 + _WORKER_STREAM)
    if int(os.environ.get("PL_SEED_WORKERS", 0)) and dataloader.worker_init_fn is None:
        # Lightning would mix the global rank into the worker seeds, which differs between the stages.
        dataloader.worker_init_fn = partial(pl_worker_init_function, rank=replica)
    return dataloader


def sampler_kwargs(num_replicas: int, replica: int, seed: int) -> dict[str, Any]:
    """Arguments of the ``DistributedSampler`` Lightning injects when there are replicas."""
    return {"num_replicas": num_replicas, "rank": replica, "seed": seed}


def resume_mid_epoch(trainer: Trainer, dataloader: Any) -> Any:
    """The training dataloader as the loop should read it: wrapped in a :class:`ResumableLoader` when the run
    resumes in the middle of an epoch (Lightning's progress counts completed batches of it), else unchanged, so
    that ``trainer.train_dataloader`` is the loader the user gave (or the one :func:`same_order_loader` made)."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    if progress.current.completed == 0:
        return dataloader
    # Lightning checks the workers of the DataLoader it is handed, which the wrapper is not: check the wrapped one.
    _worker_check(trainer, dataloader, name=f"{RunningStage.TRAINING.dataloader_prefix}_dataloader")
    return ResumableLoader(dataloader, partial(attrgetter("current.completed"), progress))


class ResumableLoader:
    """Wraps a training dataloader so that a resumed epoch continues at the next unseen batch.

    Lightning restores how many batches of the current epoch were completed, but restarts a plain
    ``DataLoader`` from its first batch. This wrapper skips the completed ones (reading, not training on
    them) when iteration actually begins, so a resumed run sees the same batches as an uninterrupted one,
    provided the loader itself is deterministic per epoch (for example a sampler seeded by epoch). A sampler
    with a ``resume_after(samples)`` method (:class:`~lightning_async_pp.models.tokens.WindowSampler`) is told
    how many samples to pass over instead, and the skipped batches are never read.

    Attributes other than its own are read from and written to the wrapped loader, so that Lightning's reset of
    a loader (``loader._iterator = None``, which lets ``persistent_workers`` start anew) reaches the
    ``DataLoader``. A loader without a length (an ``IterableDataset``) is read as it comes.

    Args:
        dataloader: The training dataloader.
        completed_batches: Returns the number of batches of the current epoch already trained on (a picklable
            callable: a fitted Trainer can be pickled and copied).
    """

    _OWN = ("dataloader", "completed_batches")

    def __init__(self, dataloader: Any, completed_batches: Callable[[], int]) -> None:
        self.dataloader = dataloader
        self.completed_batches = completed_batches

    def __iter__(self) -> Iterator[Any]:
        return self._iterate()

    def _iterate(self) -> Iterator[Any]:
        # A generator: this body runs at the first `next()`, after Lightning has restored its progress
        # counters and called `set_epoch` on the sampler.
        skip = self.completed_batches()
        length = sized_len(self.dataloader)
        if length:
            skip %= length
        sampler = getattr(self.dataloader, "sampler", None)
        batch_size = getattr(self.dataloader, "batch_size", None)
        if skip and batch_size and hasattr(sampler, "resume_after"):
            # The sampler starts after the trained samples itself: nothing before them is read.
            sampler.resume_after(skip * batch_size)
            skip = 0
        iterator = iter(self.dataloader)
        for _ in range(skip):
            next(iterator, None)
        yield from iterator

    def __len__(self) -> int:
        return len(self.dataloader)  # a TypeError without one, as a DataLoader of an IterableDataset raises

    def __getattr__(self, name: str) -> Any:
        # `sampler`, `batch_size`, `dataset`, ...: look like the wrapped loader to Lightning.
        if "dataloader" not in self.__dict__:  # not initialised: being copied or unpickled
            raise AttributeError(name)
        return getattr(self.__dict__["dataloader"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._OWN:
            self.__dict__[name] = value
        else:
            setattr(self.dataloader, name, value)

    # Marks the loader as resumable for Lightning: the position lives in Lightning's own loop state.
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


def before_optimizer_step(trainer: Trainer, optimizer: Optimizer) -> Callable[[], None] | None:
    """What a stage runs when the gradient of a step is complete, as Lightning does before an optimizer step:
    the callbacks' and the module's ``on_before_optimizer_step``. They see this stage's parameters only.

    ``None`` when neither the module nor any callback overrides the hook: the update then needs no complete
    gradient at ``UPDATE``, so the average over the replicas stays in flight (see
    :class:`~lightning_async_pp.runtime.updates.UpdateDriver`)."""
    callbacks = [
        c for c in trainer.callbacks if type(c).on_before_optimizer_step is not Callback.on_before_optimizer_step
    ]
    module = trainer.lightning_module
    if not callbacks and type(module).on_before_optimizer_step is LightningModule.on_before_optimizer_step:
        return None

    def run() -> None:
        call._call_callback_hooks(trainer, "on_before_optimizer_step", optimizer)
        call._call_lightning_module_hook(trainer, "on_before_optimizer_step", optimizer)

    return run


def check_gradient_clipping_hook(module: LightningModule) -> None:
    """Refuse an overridden ``configure_gradient_clipping``: each stage holds part of the gradient, so code that
    clips ``self.parameters()`` would clip every stage by its own norm, not by the norm of the whole model."""
    if type(module).configure_gradient_clipping is not LightningModule.configure_gradient_clipping:
        raise MisconfigurationException(
            f"{type(module).__name__} overrides `configure_gradient_clipping`, which a multi-stage pipeline cannot "
            "run: each stage holds only its own gradients, so it would clip every stage by a different norm. Remove "
            "the override and set `Trainer(gradient_clip_val=...)`: AsyncPipelineStrategy clips by the global norm "
            "across all stages. (On one device the override runs as usual.)"
        )
