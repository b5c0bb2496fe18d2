"""PeerWatchdog in one process: what it concludes from the heartbeat's statuses and the store, with the heartbeat's
all-reduce replaced by a stand-in that plays the other ranks (the multi-process runs are in
tests/multiprocess/test_nccl_like_failures.py)."""

from __future__ import annotations

import threading
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from lightning_async_pp.strategy import watchdog as watchdog_module
from lightning_async_pp.strategy.watchdog import FAILED, FINISHED, TEXT_LIMIT, PeerWatchdog, printable


class _Work:
    def __init__(self, error: str | None) -> None:
        self.error = error

    def is_completed(self) -> bool:
        return True

    def wait(self) -> bool:
        if self.error:
            raise RuntimeError(self.error)
        return True


def _heartbeat(monkeypatch, others: dict[int, int] | None, error: str | None = None) -> None:
    """The all-reduce answers ``others`` (rank: status) on top of this rank's status, or raises ``error``."""

    def all_reduce(statuses, group=None, async_op=False, **kwargs):
        for rank, status in (others or {}).items():
            statuses[rank] = status
        return _Work(error)

    monkeypatch.setattr(watchdog_module.dist, "all_reduce", all_reduce)
    monkeypatch.setattr(watchdog_module, "ROLL_CALL_S", 0.3)


TOKEN = "0123abcd"


@pytest.fixture(autouse=True)
def _no_spent_tokens(monkeypatch):
    """Each test starts with no token spent (most reuse ``TOKEN``)."""
    monkeypatch.setattr(watchdog_module, "SPENT_TOKENS", set())


def _watchdog(
    store: dist.Store, rank: int = 0, world_size: int = 3, token: str | None = TOKEN
) -> tuple[PeerWatchdog, list[str], threading.Event]:
    calls: list[str] = []
    called = threading.Event()

    def on_failure(message: str) -> None:
        calls.append(message)
        called.set()

    group = SimpleNamespace(group_name="test")
    dog = PeerWatchdog(
        group,
        rank,
        world_size,
        lambda r: f"stage {2 - r} (rank {r})",
        timedelta(seconds=5),
        on_failure,
        store,
        0.05,
        token,
    )
    return dog, calls, called


def _peer_store(store: dist.Store, token: str = TOKEN) -> dist.Store:
    """The store as another rank's watchdog of the same job sees it."""
    return dist.PrefixStore(f"async_pp/watchdog/{token}/", store)


def test_a_reported_failure_reaches_on_failure_with_the_error(monkeypatch):
    store = dist.HashStore()
    _peer_store(store).set("failed/1", "ValueError: the batch had 7 samples")
    _heartbeat(monkeypatch, {1: FAILED})
    dog, calls, called = _watchdog(store)
    dog.start()
    assert called.wait(5)
    assert calls == ["stage 1 (rank 1) failed: ValueError: the batch had 7 samples"]


def test_a_silent_rank_is_named_dead_after_the_roll_call(monkeypatch):
    store = dist.HashStore()
    _peer_store(store).set("alive/2", "1")  # rank 2 survived and answered; rank 1 did not
    _heartbeat(monkeypatch, None, error="Connection closed by peer")
    dog, calls, called = _watchdog(store)
    dog.start()
    assert called.wait(5)
    assert calls[0].startswith("stage 1 (rank 1) died or stopped responding without reporting an error")
    assert "Connection closed by peer" in calls[0]


def test_every_rank_finished_is_no_failure(monkeypatch):
    _heartbeat(monkeypatch, {1: FINISHED, 2: FINISHED})
    dog, calls, _ = _watchdog(dist.HashStore())
    dog.start()
    assert dog.finish()
    assert calls == [] and dog.peer_failure is None


@pytest.mark.parametrize("claimed", [True, False])
def test_a_claimed_failure_is_left_to_the_main_thread(monkeypatch, claimed):
    """While this rank handles its own failure, the watchdog only records what it learnt."""
    store = dist.HashStore()
    _peer_store(store).set("failed/2", "RuntimeError: out of memory")
    _heartbeat(monkeypatch, {2: FAILED})
    dog, calls, _ = _watchdog(store)
    if claimed:
        assert dog.claim() is None  # nothing learnt yet
    dog.start()
    dog._thread.join(5)
    assert dog.peer_failure == "stage 0 (rank 2) failed: RuntimeError: out of memory"
    assert calls == ([] if claimed else [dog.peer_failure])


def test_a_late_survivor_takes_the_verdict_of_the_first_one(monkeypatch):
    """Rank 0 concluded the roll call first (and may exit, taking its store along): rank 2 reads its verdict
    instead of waiting out a roll call of its own."""
    store = dist.HashStore()
    peer = _peer_store(store)
    peer.set("gone", "1")
    peer.set("verdict", "stage 1 (rank 1) died or stopped responding without reporting an error")
    _heartbeat(monkeypatch, None, error="Connection reset by peer")
    monkeypatch.setattr(watchdog_module, "ROLL_CALL_S", 30.0)  # a second roll call would outlast the test
    dog, calls, called = _watchdog(store, rank=2)
    dog.start()
    assert called.wait(5)
    assert calls == ["stage 1 (rank 1) died or stopped responding without reporting an error"]
    assert peer.check(["seen/2"])  # what rank 0 waits for before it exits


def test_rank_0_holds_the_store_until_every_survivor_read_it(monkeypatch):
    store = dist.HashStore()
    peer = _peer_store(store)
    _heartbeat(monkeypatch, None, error="Connection closed by peer")
    dog, _, called = _watchdog(store, rank=0)
    peer.set("alive/2", "1")  # rank 1 is dead, rank 2 answered the roll call
    dog.start()
    assert called.wait(5)
    read = threading.Event()

    def rank_2_reads_later() -> None:
        read.wait(0.5)
        peer.set("seen/2", "1")
        read.set()

    threading.Thread(target=rank_2_reads_later).start()
    dog.hold_store(limit=10)
    assert read.is_set() and peer.check(["seen/2"])


def test_other_ranks_do_not_hold_the_store(monkeypatch):
    """Only rank 0 waits for the others to read the store; rank 1 returns at once although nobody has read it."""
    _heartbeat(monkeypatch, {1: FINISHED, 2: FINISHED})
    dog, _, _ = _watchdog(dist.HashStore(), rank=1)
    holding = threading.Thread(target=dog.hold_store, kwargs={"limit": 60.0}, daemon=True)
    holding.start()
    holding.join(timeout=5.0)
    assert not holding.is_alive(), "rank 1 waits for the other ranks to read the store, as only rank 0 should"


def _job(store: dist.Store, drawn: list[torch.Tensor]) -> list[PeerWatchdog]:
    """Ranks 0 and 1 of one job make their watchdogs; the broadcast over the group is played by ``drawn``: rank 0's
    tensor is recorded and rank 1 receives it."""

    def broadcast(tensor, src=None, group=None, **kwargs):
        assert src == 0
        if group.rank == 0:
            drawn.append(tensor.clone())
        else:
            tensor.copy_(drawn[-1])

    dogs = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(watchdog_module.dist, "broadcast", broadcast)
        for rank in (0, 1):
            group = SimpleNamespace(group_name="test", rank=rank)
            dogs.append(PeerWatchdog(group, rank, 2, str, timedelta(seconds=5), print, store, 0.05))
    return dogs


def test_the_keys_start_with_a_token_rank_0_shares_over_the_group():
    """The ranks of one job share their keys (what one reports, the other reads); another job's keys differ; and
    the token itself never enters the store, where anyone who reaches it could read it."""
    store, drawn = dist.HashStore(), []
    first, second = _job(store, drawn), _job(store, drawn)
    assert len(drawn) == 2 and not torch.equal(drawn[0], drawn[1])
    first[1].store.set("failed/1", "ValueError: bad batch")
    assert first[0].store.check(["failed/1"]) and not second[0].store.check(["failed/1"])
    assert _peer_store(store, bytes(drawn[0].tolist()).hex()).get("failed/1") == b"ValueError: bad batch"
    assert store.num_keys() == 1  # the failure only


def test_a_token_shown_by_the_store_after_a_failure_is_spent(monkeypatch):
    """A reported failure writes keys, so listing the store's keys shows the token: no watchdog takes it again
    (anyone could forge a failure under it)."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    dog, _, _ = _watchdog(store)
    dog.report_failure("ValueError: bad batch", wait=0.0)
    assert any(TOKEN in key for key in store.list_keys())
    with pytest.raises(ValueError, match="This watchdog token is spent"):
        _watchdog(store)
    assert _watchdog(store, token="4567ef01")[0].store.num_keys() == 2  # another token is taken


def test_keys_under_the_old_predictable_names_are_ignored(monkeypatch):
    """Someone who reaches the store writes a failure and a verdict where the watchdog used to look
    (``async_pp/watchdog/<group name>/``): the job is not stopped, nor told their message."""
    store = dist.HashStore()
    old = dist.PrefixStore("async_pp/watchdog/test/", store)
    for key, value in (("broken", "1"), ("failed/1", "stop now"), ("gone", "1"), ("verdict", "stop now")):
        old.set(key, value)
    _heartbeat(monkeypatch, {1: FINISHED, 2: FINISHED})
    dog, calls, _ = _watchdog(store)
    assert not dog._store_says_broken()
    dog.start()
    assert dog.finish()
    assert calls == [] and dog.peer_failure is None
    # A reported failure is still read, from the keys of the job's token, without the planted text.
    _peer_store(store).set("failed/1", "ValueError: real")
    assert dog._failures([1]) == "stage 1 (rank 1) failed: ValueError: real"


def test_what_is_read_back_is_cut_and_printable(monkeypatch):
    """A reported error is printed by every other rank: control characters (terminal escapes, a forged line of
    output) and an unbounded length do not get through."""
    store = dist.HashStore()
    _peer_store(store).set("failed/1", "boom\x1b[2J\rrank 0: all good\n\u202eevil\x00" + "x" * 10**6)
    _peer_store(store).set("failed/2", b"\xff\xfe not utf-8")
    dog, _, _ = _watchdog(store)
    message = dog._failures([1, 2])
    assert all(c.isprintable() for c in message)
    assert len(message) < TEXT_LIMIT + 200
    assert "boom?[2J rank 0: all good ?evil?xxx" in message
    assert message.endswith("...; stage 0 (rank 2) failed: \ufffd\ufffd not utf-8")
    assert printable("a\tb", limit=10) == "a b" and printable("x" * 11, limit=10) == "x" * 7 + "..."


def test_a_verdict_with_garbage_ranks_is_read(monkeypatch):
    """The list of dead ranks another survivor wrote is parsed defensively: words that are not ranks of the job
    are dropped, the verdict still reaches ``on_failure``."""
    store = dist.HashStore()
    peer = _peer_store(store)
    peer.set("gone", "1,x,99,-2")
    peer.set("verdict", "stage 1 (rank 1) died\x07")
    _heartbeat(monkeypatch, None, error="Connection reset by peer")
    monkeypatch.setattr(watchdog_module, "ROLL_CALL_S", 30.0)
    dog, calls, called = _watchdog(store, rank=2)
    dog.start()
    assert called.wait(5)
    assert calls == ["stage 1 (rank 1) died?"] and dog._gone == {1}
