"""Cluster signals at a step boundary: a SIGTERM, or SLURM's requeue signal, on any rank stops every rank of the job
before the same training step; the requeue signal first has every rank save a checkpoint there.

Lightning handles a SIGTERM with a blocking broadcast of rank 0's flag over the default group before every
training step (a barrier per step, on the whole job), a broadcast inside the signal handler itself, and a
check of the local flag after each step that stops the receiving rank alone. In a pipeline the ranks are
up to a step apart, so a rank that stops on its own leaves its neighbours waiting for its transfers, and
a signal that reaches only one rank (not rank 0) would not stop the others at all. Under SLURM with
auto-requeue (``SLURMEnvironment(auto_requeue=True)``, the default on SLURM), Lightning's handler of the requeue
signal (``SLURMEnvironment.requeue_signal``, SIGUSR1 by default) saves a checkpoint from inside the signal
handler, wherever the main thread is: in the middle of a pipeline step, whose flush then waits for transfers
the other stages are not making, and hangs.

:func:`install_signal_stop` replaces both. The handlers only record the signal on the rank that received it; the
request travels in the per-step message of :class:`~lightning_async_pp.strategy.metrics.MetricsRelay` (small
groups, one step late, see there), which tells every rank the same step to stop before (two steps after the
signal with one pipeline, three with replicas). There every rank

- for the requeue signal: saves a checkpoint to Lightning's HPC path (``hpc_ckpt_{n}.ckpt`` in
  ``default_root_dir``, which a requeued job resumes from when ``ckpt_path`` is ``None``), a collective of every
  rank at the same step, after which rank 0 runs ``scontrol requeue $SLURM_JOB_ID`` (as Lightning does);
- sets ``trainer.received_sigterm`` and raises Lightning's ``SIGTERMException``, so ``on_exception`` callbacks
  run on every rank at the same ``global_step`` and the processes exit.

A request is sampled at the end of each training step: a signal during validation stops training two steps
after it resumes, and one that arrives after the last step is dropped (the run ends normally; with the requeue
signal, without a checkpoint: the job is complete).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
from collections.abc import Callable
from typing import Any

from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import Trainer
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_async_pp.strategy.metrics import MetricsRelay

__all__ = ["REQUEUE", "STOP", "checkpoint_and_requeue", "hpc_save_path", "install_signal_stop", "requeue_slurm_job"]

log = logging.getLogger("lightning.pytorch.strategies.async_pp")

STOP = 1
"""The relay's stop code of a SIGTERM: stop."""
REQUEUE = 2
"""The relay's stop code of the requeue signal: checkpoint, requeue, stop (the larger code wins)."""


def install_signal_stop(trainer: Trainer, relay: MetricsRelay) -> None:
    """Route this rank's SIGTERM and requeue signal through ``relay`` and act where ``relay`` agrees to stop.

    Replaces the epoch loop's per-step ``_broadcast_sigterm_tensor`` (no collective any more) and, at the first
    step (Lightning registers its handlers after the strategy's setup), Lightning's SIGTERM notifier and SLURM
    requeue handler by ones that only record the signal.

    Args:
        trainer: The trainer whose fit loop is about to run.
        relay: The relay whose per-step message carries the request.
    """
    request = [0]
    connector = trainer._signal_connector

    def notify_sigterm(signum: int, _: Any) -> None:
        log.info(f"Received SIGTERM: {signum}; every rank stops before the same step")
        if not request[0] and trainer.strategy.launcher is not None:
            trainer.strategy.launcher.kill(signum)  # as Lightning: pass it on to the processes it started
        request[0] = max(request[0], STOP)

    def notify_requeue(signum: int, _: Any) -> None:
        log.info(f"Received the requeue signal {signum}; every rank saves a checkpoint before the same step")
        request[0] = REQUEUE

    def stop_where_every_rank_stops() -> None:
        if not stop_where_every_rank_stops.replaced:
            _replace_handler(signal.SIGTERM, connector._sigterm_notifier_fn, notify_sigterm)
            requeue_signal = _requeue_signal(trainer)
            if requeue_signal is not None:
                _replace_handler(requeue_signal, connector._slurm_sigusr_handler_fn, notify_requeue)
            stop_where_every_rank_stops.replaced = True
        if relay.should_stop():
            if relay.stop_reason >= REQUEUE:
                checkpoint_and_requeue(trainer)
            connector.received_sigterm = True
            raise SIGTERMException()

    stop_where_every_rank_stops.replaced = False
    relay.stop_requested = lambda: request[0]
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = stop_where_every_rank_stops


def _requeue_signal(trainer: Trainer) -> signal.Signals | None:
    """The signal Lightning requeues on: only under SLURM with auto-requeue (else it installs no handler)."""
    environment = trainer._accelerator_connector.cluster_environment
    if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
        return environment.requeue_signal
    return None


def checkpoint_and_requeue(trainer: Trainer) -> None:
    """What Lightning's SLURM handler does, at a step boundary: every rank saves the HPC checkpoint (a collective),
    then rank 0 requeues the job.

    Args:
        trainer: The trainer, between two training steps on every rank.
    """
    for logger in trainer.loggers:
        logger.finalize("finished")  # as Lightning: the metrics logged so far reach their files
    path = hpc_save_path(trainer.default_root_dir)
    log.info(f"Saving the requeue checkpoint {path}")
    trainer.save_checkpoint(path)
    if trainer.is_global_zero:
        requeue_slurm_job()


def hpc_save_path(directory: Any) -> str:
    """``hpc_ckpt_{n+1}.ckpt`` in ``directory``, ``n`` the highest of the complete ``hpc_ckpt_{n}.ckpt`` there.

    Lightning's own ``hpc_save_path`` counts every name containing ``hpc_ckpt_``, including the hidden directory
    another rank is already writing the checkpoint into, so two ranks could pick different numbers; here every
    rank lists the same complete checkpoints before any of them starts writing.
    """
    numbers = [0]
    if os.path.isdir(directory):
        for name in os.listdir(directory):
            match = re.fullmatch(r"hpc_ckpt_(\d+)\.ckpt", name)
            if match:
                numbers.append(int(match.group(1)))
    return os.path.join(directory, f"hpc_ckpt_{max(numbers) + 1}.ckpt")


def requeue_slurm_job() -> int:
    """Run ``scontrol requeue`` on this SLURM job (or array task), as Lightning's SLURM handler does.

    Returns:
        The command's exit status (logged; a failed requeue leaves the checkpoint for a manual resubmission).
    """
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ["SLURM_JOB_ID"]
    if not re.fullmatch(r"[0-9_-]+", job):
        raise ValueError(f"Cannot requeue the SLURM job {job!r}: not a SLURM job id.")
    log.info(f"Requeuing SLURM job {job}")
    try:
        result = subprocess.call(["scontrol", "requeue", job])
    except FileNotFoundError:
        result = subprocess.call(f"scontrol requeue {job}", shell=True)  # as Lightning: a shell may find it
    if result == 0:
        log.info(f"Requeued SLURM job {job}")
    else:
        log.warning(f"Requeuing SLURM job {job} failed with exit status {result}")
    return result


def _replace_handler(signum: int, handler_fn: Callable, replacement: Callable) -> None:
    """Swap Lightning's ``handler_fn`` for ``replacement`` in the handler installed for ``signum`` (a list of
    handlers)."""
    handler = signal.getsignal(signum)
    handlers = getattr(handler, "signal_handlers", None)
    if isinstance(handlers, list):
        handlers[:] = [replacement if h == handler_fn else h for h in handlers]
    elif handler == handler_fn:
        signal.signal(signum, replacement)
