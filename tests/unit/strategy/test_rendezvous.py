"""The rendezvous explains a long wait once, and its failure repeats what was awaited."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest

from lightning_async_pp.strategy.rendezvous import join_job, waiting_message


def test_a_long_wait_is_explained_then_the_failure_repeats_it(capsys):
    said = threading.Event()
    message = waiting_message(4, 2, 2, 0, "10.0.0.1", 29500)

    def rendezvous():
        # Blocks like a rendezvous missing ranks, until the explanation was printed (or a generous bound).
        for _ in range(500):
            if message in capsys.readouterr().err:
                said.set()
                break
            said.wait(0.01)
        raise TimeoutError("wait timeout after 6000ms")

    with pytest.raises(RuntimeError, match=r"could not join the job \(TimeoutError.*timeout \(0:00:06\)") as error:
        join_job(rendezvous, message, timedelta(seconds=6), announce=True, announce_after=0.01)
    assert said.is_set()
    assert "4 ranks" in str(error.value) and "10.0.0.1:29500" in str(error.value)
    assert "ranks 0-1" in message and "`--trainer.num_nodes 1`" in message


def test_a_quick_rendezvous_says_nothing(capsys):
    join_job(lambda: None, "waiting", timedelta(seconds=6), announce=True, announce_after=0.01)
    threading.Event().wait(0.05)  # the cancelled timer must not fire late
    assert capsys.readouterr().err == ""


def test_one_node_explains_a_slow_start_and_points_at_a_failed_process():
    """Said after a few seconds of a healthy start too: it must not claim that a process failed."""
    message = waiting_message(2, 1, 2, 0, "127.0.0.1", 1234)
    assert "joins once it has started" in message and "failed before joining has printed its error" in message
    assert "has failed" not in message
