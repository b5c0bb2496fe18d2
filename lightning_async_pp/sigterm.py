"""A SIGTERM on any rank stops every rank of the job before the same training step.

Lightning handles a SIGTERM with a blocking broadcast of rank 0's flag over the default group before every
training step (a barrier per step, on the whole job), a broadcast inside the signal handler itself, and a
check of the local flag after each step that stops the receiving rank alone. In a pipeline the ranks are
up to a step apart, so a rank that stops on its own leaves its neighbours waiting for its transfers, and
a signal that reaches only one rank (not rank 0) would not stop the others at all.

:func:`install` replaces that: the signal handler only records the signal on the rank that received it; the
flag travels in the per-step message of :class:`~lightning_async_pp.metrics.MetricsRelay` (small groups, one
step late, see there), which tells every rank the same step to stop before. There every rank sets
``trainer.received_sigterm`` and raises Lightning's ``SIGTERMException``, so ``on_exception`` callbacks run on
every rank at the same ``global_step`` (two steps after the signal with one pipeline, three with replicas).
The flag is sampled at the end of each training step: a signal during validation stops training two
steps after it resumes, and one that arrives after the last step is dropped (the run ends normally).
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_async_pp.metrics import MetricsRelay

log = logging.getLogger(__name__)

__all__ = ["install"]


def install(trainer: Trainer, relay: MetricsRelay) -> None:
    """Route this rank's SIGTERM through ``relay`` and stop where ``relay`` agrees to stop.

    Replaces the epoch loop's per-step ``_broadcast_sigterm_tensor`` (no collective any more) and, at the first
    step (Lightning registers its handlers after the strategy's setup), Lightning's SIGTERM notifier by one
    that only records the signal.

    Args:
        trainer: The trainer whose fit loop is about to run.
        relay: The relay whose per-step message carries the flag.
    """
    received = [False]
    connector = trainer._signal_connector

    def notify(signum: int, _: Any) -> None:
        log.info(f"Received SIGTERM: {signum}; every rank stops before the same step")
        if not received[0] and trainer.strategy.launcher is not None:
            trainer.strategy.launcher.kill(signum)  # as Lightning: pass it on to the processes it started
        received[0] = True

    def stop_where_every_rank_stops() -> None:
        if not stop_where_every_rank_stops.replaced:
            _replace_notifier(connector._sigterm_notifier_fn, notify)
            stop_where_every_rank_stops.replaced = True
        if relay.should_stop():
            connector.received_sigterm = True
            raise SIGTERMException()

    stop_where_every_rank_stops.replaced = False
    relay.stop_requested = lambda: received[0]
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = stop_where_every_rank_stops


def _replace_notifier(notifier: Callable, replacement: Callable) -> None:
    """Swap Lightning's notifier for ``replacement`` in the installed SIGTERM handler (a list of handlers)."""
    handler = signal.getsignal(signal.SIGTERM)
    handlers = getattr(handler, "signal_handlers", None)
    if isinstance(handlers, list):
        handlers[:] = [replacement if h == notifier else h for h in handlers]
    elif handler == notifier:
        signal.signal(signal.SIGTERM, replacement)
