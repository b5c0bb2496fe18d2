"""Before training: the strategy's arguments and the model checked, the processes started.

Configuration errors are raised in the main process, before any other process starts, so that a job fails
once with one message instead of once per rank: the strategy's launcher runs :class:`LaunchChecks` first.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sized
from dataclasses import dataclass
from typing import Any

from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_async_pp.checkpoint.compat import check_checkpoint_path
from lightning_async_pp.runtime.contract import require_pipeline_module
from lightning_async_pp.runtime.microbatch import auto_num_microbatches
from lightning_async_pp.runtime.recompute import ActivationCheckpointing, select_layers
from lightning_async_pp.schedule import SCHEDULES, validate
from lightning_async_pp.schedule.ir import is_int
from lightning_async_pp.strategy.failure import SELF_EXIT_S
from lightning_async_pp.strategy.lifecycle import check_gradient_clipping_hook
from lightning_async_pp.strategy.placement import check_timing_input, partition_layers
from lightning_async_pp.strategy.processes import PipelineProcesses
from lightning_async_pp.strategy.topology import check_process_count

__all__ = [
    "LaunchChecks",
    "check_arguments",
    "check_datamodule",
    "check_pipeline_model",
    "check_train_loader",
    "check_trainer_settings",
    "configure_launcher",
]


def check_arguments(
    schedule: str, num_microbatches: Any, pipeline_parallel_size: Any, balance: Any, start_method: str
) -> None:
    """Refuse constructor arguments the strategy cannot run with, before the Trainer is built."""
    if schedule not in SCHEDULES:
        raise ValueError(
            f"Unknown pipeline schedule {schedule!r}. Set `schedule` to one of {', '.join(map(repr, SCHEDULES))}."
        )
    if num_microbatches != "auto" and (not is_int(num_microbatches) or num_microbatches < 1):
        raise ValueError(f"`num_microbatches` must be a positive integer or 'auto', got {num_microbatches!r}.")
    if not (balance in ("parameters", "time") or (not isinstance(balance, str) and len(balance) > 0)):
        raise ValueError(f"`balance` must be 'parameters', 'time' or a list of per-layer costs, got {balance!r}.")
    if start_method not in ("popen", "spawn"):
        raise ValueError(f"`start_method` must be 'popen' or 'spawn', got {start_method!r}.")
    if pipeline_parallel_size is not None and (not is_int(pipeline_parallel_size) or pipeline_parallel_size < 1):
        raise ValueError(f"`pipeline_parallel_size` must be a positive integer, got {pipeline_parallel_size!r}.")


def check_trainer_settings(trainer: Trainer, multi_process: bool) -> None:
    """Refuse Trainer settings the strategy cannot run with: before launching, and again in ``setup`` (where a
    launcher that is not the strategy's, torchrun or SLURM, first sees them)."""
    if multi_process and trainer.gradient_clip_algorithm not in (None, "norm"):
        raise MisconfigurationException(
            f"AsyncPipelineStrategy clips by the global gradient norm only; got gradient_clip_algorithm="
            f"{getattr(trainer.gradient_clip_algorithm, 'value', trainer.gradient_clip_algorithm)!r}. Set it to 'norm'."
        )


def check_train_loader(
    loader: Any,
    num_microbatches: int | None,
    num_stages: int,
    replicas: int,
    max_steps: int = -1,
    limit_batches: int | float = 1.0,
    accumulate: int = 1,
) -> None:
    """Refuse a training ``DataLoader`` whose batches cannot be cut into equal micro-batches, the last batch of an
    epoch included, before training starts rather than at the end of the first epoch. Loaders whose batches are not
    known in advance (an iterable dataset, a batch sampler of the user's) are checked batch by batch in training.

    Args:
        loader: What ``fit`` got as ``train_dataloaders``.
        num_microbatches: Micro-batches per batch (``None``: ``"auto"``, chosen from the first batch).
        num_stages: Pipeline stages (``"auto"`` takes at least one micro-batch per stage).
        replicas: Data-parallel replicas, each reading ``ceil(len(dataset) / replicas)`` samples an epoch.
        max_steps: The Trainer's ``max_steps``: a run that ends before the last batch of the first epoch is not
            refused for that batch (neither is one whose ``limit_train_batches`` leaves it out).
        limit_batches: The Trainer's ``limit_train_batches``.
        accumulate: The Trainer's ``accumulate_grad_batches`` (batches per optimizer step, which ``max_steps`` counts).
    """
    if not isinstance(loader, DataLoader) or loader.batch_size is None or not isinstance(loader.dataset, Sized):
        return
    size = loader.batch_size
    num_microbatches = _check_batch_size(size, num_microbatches, num_stages, "The training DataLoader's")
    samples = math.ceil(len(loader.dataset) / replicas)
    last = samples % size
    batches = math.ceil(samples / size)
    if isinstance(limit_batches, float):  # Lightning: a float is a fraction of the epoch, an int a batch count
        reached = limit_batches >= 1.0
    else:
        reached = limit_batches is None or limit_batches >= batches
    reached = reached and (max_steps is None or max_steps < 0 or max_steps * accumulate >= batches)
    if reached and last and not loader.drop_last and last % num_microbatches:
        per_replica = f" per replica (of {replicas})" if replicas > 1 else ""
        raise ValueError(
            f"The last batch of every epoch holds {last} samples ({samples} samples{per_replica} in batches of "
            f"{size}), which num_microbatches={num_microbatches} cannot split into equal micro-batches. Set "
            "`DataLoader(drop_last=True)`, or use a dataset whose length is a multiple of the batch size."
        )


def check_datamodule(datamodule: Any, num_microbatches: int | None, num_stages: int) -> None:
    """Refuse a data module whose ``batch_size`` cannot be cut into equal micro-batches, before any process starts.

    Its loaders exist only after ``setup`` in each process, so the batch size is taken where Lightning's batch size
    finder takes it: the ``batch_size`` attribute (or hyperparameter) of the data module. One without it, or with a
    value that is not an integer, is checked batch by batch in training.

    Args:
        datamodule: What ``fit`` got as ``datamodule``.
        num_microbatches: Micro-batches per batch (``None``: ``"auto"``).
        num_stages: Pipeline stages.
    """
    if datamodule is None:
        return
    size = getattr(datamodule, "batch_size", None)
    hparams = getattr(datamodule, "hparams", None)
    if size is None and isinstance(hparams, Mapping):
        size = hparams.get("batch_size")
    if is_int(size):
        _check_batch_size(size, num_microbatches, num_stages, f"{type(datamodule).__name__}'s")


def _check_batch_size(size: int, num_microbatches: int | None, num_stages: int, whose: str) -> int:
    """Refuse a batch size that is not positive or that ``num_microbatches`` does not divide; returns the number of
    micro-batches (``None``: ``"auto"``, chosen from ``size``)."""
    if size < 1:
        raise ValueError(f"{whose} batch_size={size} is not a positive number of samples: set a positive batch size.")
    if num_microbatches is None:
        num_microbatches = auto_num_microbatches(size, num_stages)
    if size % num_microbatches:
        raise ValueError(
            f"{whose} batch_size={size} cannot be split into num_microbatches={num_microbatches} equal micro-batches. "
            "Make the batch size a multiple of `num_microbatches`, or change `num_microbatches`."
        )
    return num_microbatches


def check_pipeline_model(
    module: LightningModule,
    precision: str,
    activation_checkpointing: ActivationCheckpointing,
    num_stages: int | None,
    time_balanced: bool,
    partition: Callable[[LightningModule], list[range]],
) -> None:
    """Raise a clear error if ``module`` cannot be trained as the strategy's pipeline.

    Args:
        module: The model.
        precision: The Trainer's precision.
        activation_checkpointing: The strategy's ``activation_checkpointing``.
        num_stages: Pipeline stages; ``None`` on one process.
        time_balanced: Whether the stages are balanced by measured layer times (measured in ``setup``: here the
            input and the layer count are checked).
        partition: The strategy's partition of the model's layers.
    """
    if str(precision) in ("16-mixed", "16-true", "16"):
        raise MisconfigurationException(
            f"AsyncPipelineStrategy does not support precision={precision!r}: fp16 needs a loss scale shared by "
            "all stages. Use precision='bf16-mixed' or '32-true'."
        )
    if activation_checkpointing is not False:
        require_pipeline_module(module, "needed to apply `activation_checkpointing` to its layers")
        select_layers(list(module.pipeline_layers()), activation_checkpointing)
    if num_stages is not None:
        require_pipeline_module(module, f"needed to cut it into {num_stages} stages")
        check_gradient_clipping_hook(module)
        if time_balanced:
            check_timing_input(module)
            partition_layers(list(module.pipeline_layers()), num_stages, costs=None)
        else:
            partition(module)


@dataclass(frozen=True)
class LaunchChecks:
    """What the launcher checks of a ``fit``/``validate``/... call before it starts the other processes.

    Args:
        check_trainer: Refuses the Trainer's settings (:func:`check_trainer_settings`).
        check_model: Refuses a model the pipeline cannot run (the strategy's ``check_model``).
        num_stages: Pipeline stages ``P``.
        replicas: Data-parallel replicas ``D``.
        num_microbatches: Micro-batches per batch (``None``: ``"auto"``, chosen from the first batch).
    """

    check_trainer: Callable[[Trainer], None]
    check_model: Callable[[LightningModule], None]
    num_stages: int
    replicas: int
    num_microbatches: int | None

    def wrap(self, launch: Callable) -> Callable:
        """``launch`` run after the checks."""
        return functools.partial(self._checked_launch, launch)

    def _checked_launch(self, launch: Callable, function: Callable, *args: Any, **kwargs: Any) -> Any:
        # `fit(model, ...)`: find configuration errors here, before any other process starts.
        trainer = kwargs.get("trainer")
        if trainer is not None:
            self.check_trainer(trainer)
        if args and isinstance(args[0], LightningModule):
            self.check_model(args[0])
        limits = {}
        if trainer is not None:
            limits = {"max_steps": trainer.max_steps, "limit_batches": trainer.limit_train_batches}
            limits["accumulate"] = trainer.accumulate_grad_batches
        loader = _argument(function, "train_dataloaders", args, kwargs)
        datamodule = _argument(function, "datamodule", args, kwargs)
        if isinstance(loader, LightningDataModule):  # `fit(model, datamodule)`, which Lightning accepts
            loader, datamodule = None, loader
        check_train_loader(loader, self.num_microbatches, self.num_stages, self.replicas, **limits)
        check_datamodule(datamodule, self.num_microbatches, self.num_stages)
        ckpt_path = _argument(function, "ckpt_path", args, kwargs)
        if ckpt_path is not None:
            check_checkpoint_path(ckpt_path)
        return launch(function, *args, **kwargs)


def configure_launcher(
    strategy: PipelineProcesses,
    start_method: str,
    schedule: str,
    num_microbatches: int | None,
    check_model: Callable[[LightningModule], None],
) -> _Launcher | None:
    """Check the process count and the schedule, and return the launcher of ``strategy``'s processes (``None`` for
    one process), which checks the call's model, Trainer and data before it starts the other processes.

    Args:
        strategy: The strategy whose processes are launched (``devices * num_nodes`` of them).
        start_method: ``"popen"`` or ``"spawn"``.
        schedule: The pipeline schedule.
        num_microbatches: Micro-batches per batch (``None``: ``"auto"``, chosen from the first batch).
        check_model: Refuses a model the pipeline cannot run (the strategy's ``check_model``).
    """
    num_processes, num_nodes, num_stages = strategy.num_processes, strategy.num_nodes, strategy.num_stages
    check_process_count(num_processes, num_nodes, num_stages)
    validate(schedule, num_stages, num_stages if num_microbatches is None else num_microbatches)
    if not strategy.multi_process:
        return None
    replicas = max(1, num_processes * num_nodes // num_stages)
    check_trainer = functools.partial(check_trainer_settings, multi_process=True)
    checks = LaunchChecks(check_trainer, check_model, num_stages, replicas, num_microbatches)
    if start_method == "popen":
        assert strategy.cluster_environment is not None
        launcher = _ScriptLauncher(strategy.cluster_environment, strategy.num_processes, strategy.num_nodes)
    else:
        launcher = _SpawnLauncher(strategy, start_method=start_method)
    launcher.launch = checks.wrap(launcher.launch)
    return launcher


def _argument(function: Callable, name: str, args: tuple, kwargs: dict) -> Any:
    """The value ``function(*args, **kwargs)`` would get for ``name`` (``None`` if it has no such parameter)."""
    kwargs = {k: v for k, v in kwargs.items() if k != "trainer"}  # the launcher's own keyword
    try:
        return inspect.signature(function).bind_partial(*args, **kwargs).arguments.get(name)
    except (TypeError, ValueError):
        return None


class _ScriptLauncher(_SubprocessScriptLauncher):
    """Lightning's launcher of ``python -m ...`` children, watching them with :class:`_ChildWatch`."""

    @override
    def launch(self, function: Callable, *args: Any, trainer: Trainer | None = None, **kwargs: Any) -> Any:
        # Lightning's `launch`, with its watch over the children replaced.
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            _ChildWatch(main_pid=os.getpid(), child_processes=self.procs).start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)


class _ChildWatch(_ChildProcessObserver):
    """Lightning's watch over the children SIGKILLs every process of the job (exit status 137) within seconds of a
    child's non-zero exit, even when every rank is ending by itself after a clean refusal. This one waits
    :data:`~lightning_async_pp.strategy.failure.SELF_EXIT_S` first: the ranks of a failed job say why and exit with
    status 1 on their own (rank 0, which runs this thread, last: it hosts the store the others read the failure
    from). Only if this process still runs after that is a rank stuck, and every process is ended."""

    @override
    def _run(self) -> bool:
        codes = [process.poll() for process in self._child_processes]
        if all(code == 0 for code in codes):
            return True
        failed = [(rank, code) for rank, code in enumerate(codes, start=1) if code]
        if not failed:
            return False
        time.sleep(SELF_EXIT_S)
        rank, code = failed[0]
        sys.stderr.write(
            f"local rank {rank} exited with status {code} and local rank 0 is still running {SELF_EXIT_S:.0f} s "
            "later: ending every process of the job.\n"
        )
        self._terminate_all()
        return True


class _SpawnLauncher(_MultiProcessingLauncher):
    """Spawn launcher that hands the *whole* trained model back to the main process, not only rank 0's stage."""

    @override
    def _collect_rank_zero_results(self, trainer: Trainer, results: Any) -> Any:
        full = self._strategy.full_state_dict()  # every rank takes part
        output = super()._collect_rank_zero_results(trainer, results)
        if output is not None and output.weights_path is not None:
            self._strategy.checkpoint_io.save_checkpoint(full, output.weights_path)
        return output
