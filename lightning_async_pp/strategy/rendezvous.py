"""Joining the job: say early which ranks are awaited where, and fail at the timeout with the same words.

``init_process_group`` blocks until every rank of the job has reached the rendezvous at
``MASTER_ADDR:MASTER_PORT``, silently, for the whole timeout. A job started with more ranks than exist
(``--trainer.num_nodes 2`` on one machine, a node that never started) would print nothing for minutes; here
each machine's first process says after a few seconds how many ranks are awaited at which address, and the
error at the timeout repeats it.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from datetime import timedelta

__all__ = ["ANNOUNCE_AFTER_S", "join_job", "waiting_message"]

ANNOUNCE_AFTER_S = 5.0
"""Seconds the rendezvous may take before the wait is explained (at most half the timeout)."""


def waiting_message(
    world_size: int, num_nodes: int, processes_per_node: int, node_rank: int, address: str, port: int
) -> str:
    """What is awaited, and what to check.

    Args:
        world_size: Ranks the job waits for (``num_nodes x devices``).
        num_nodes: ``Trainer(num_nodes=...)``.
        processes_per_node: ``Trainer(devices=...)``: the processes this machine starts.
        node_rank: This machine's node rank.
        address: ``MASTER_ADDR``.
        port: ``MASTER_PORT``.
    """
    first, last = node_rank * processes_per_node, (node_rank + 1) * processes_per_node - 1
    ranks = f"rank {first}" if first == last else f"ranks {first}-{last}"
    text = (
        f"Waiting for all {world_size} ranks of the job (num_nodes={num_nodes} x devices={processes_per_node}) "
        f"to join at {address}:{port}; this machine (node {node_rank}) runs {ranks}."
    )
    if num_nodes > 1:
        text += (
            f" The other {num_nodes - 1} node(s) must run the same command with their own NODE_RANK and "
            f"MASTER_ADDR={address} MASTER_PORT={port} (under torchrun or SLURM the launcher sets them). "
            "If every process runs on this machine, set `num_nodes=1` (`--trainer.num_nodes 1`)."
        )
    else:
        text += (
            " Each process joins once it has started (Python imports, its model built), which can take a while on"
            " a busy machine; one that failed before joining has printed its error above."
        )
    return text


def join_job(
    init: Callable[[], None],
    message: str,
    timeout: timedelta,
    announce: bool,
    announce_after: float = ANNOUNCE_AFTER_S,
) -> None:
    """Run ``init`` (the rendezvous); print ``message`` if it takes long, and raise with it if it fails.

    Args:
        init: Joins the default process group; blocks until every rank has joined or the timeout.
        message: What is awaited (:func:`waiting_message`).
        timeout: The strategy's timeout, after which ``init`` fails.
        announce: Whether this process prints the message (one per machine).
        announce_after: Seconds before it prints (at most half the timeout).

    Raises:
        RuntimeError: If ``init`` fails, with ``message`` and the timeout; the original error is its cause.
    """
    delay = min(announce_after, timeout.total_seconds() / 2)
    timer = threading.Timer(delay, lambda: print(f"{message} (gives up after {timeout})", file=sys.stderr, flush=True))
    timer.daemon = True
    if announce:
        timer.start()
    try:
        init()
    except Exception as error:
        raise RuntimeError(
            f"This process could not join the job ({type(error).__name__}: {error}); waiting for the other ranks "
            f"gives up after the strategy's timeout ({timeout}). {message}"
        ) from error
    finally:
        timer.cancel()
