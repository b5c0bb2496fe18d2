"""Noticing a failed or dead rank from a thread of its own, while the main thread waits on the data path.

On NCCL a rank's death is not seen by its neighbours' pending receives: ``Work.wait()`` only queues the wait on
the GPU stream, and the host later blocks for good in an event's ``synchronize()`` (``HostFlag.get``) behind a
receive that never completes, until torch's NCCL watchdog ends the process at the timeout, often without
saying which stage failed. Gloo's TCP connections, which the control traffic uses, do see a peer close them.

:class:`PeerWatchdog` runs a daemon thread with a heartbeat on a gloo group of every rank of the job: every
``period`` seconds one small non-blocking all-reduce of each rank's status (running, finished, failed). It
learns

- **a failure reported by a rank** (:meth:`PeerWatchdog.report_failure`, from the strategy's ``on_exception``):
  the rank writes its error into the rendezvous store and sets its status to failed, and waits until a
  heartbeat that carries the status completed (every rank then sees it);
- **a rank that died without a word** (killed, crashed, out of host memory): the heartbeat's connections
  close and the all-reduce raises on the ranks connected to it. The first rank that notices says so in the
  store; the others, whose heartbeat waits behind one that stopped, look at the store once a heartbeat is
  late. Every survivor then answers a roll call in the store; the ranks that did not answer within a few
  seconds are the dead, and the first survivor to conclude writes the verdict for the others to read. A
  store that cannot be reached says that its host, rank 0 (or the launcher's agent), is gone; so rank 0,
  before it exits, holds the store until every survivor has read what happened (:meth:`PeerWatchdog.hold_store`);
- **a rank that stopped answering** (its whole process frozen): the heartbeat times out after the timeout
  and the roll call names the rank.

What it learnt goes to ``on_failure`` (on the watchdog's thread, so it acts even when the main thread is
blocked in the device), unless the main thread already handles a failure of its own
(:meth:`PeerWatchdog.claim`). A hung rank whose threads still run (a collective of the data path that never
completes) keeps its heartbeat going: torch's own NCCL watchdog ends it at the timeout.

The store's keys start with a random token that rank 0 draws and broadcasts over the watchdog's group when
the watchdog is made (:func:`share_token`): the token never passes through the store, so whoever else can reach
the store (torchrun's agent store listens on every interface) can neither read nor guess the keys, and cannot
stop the job by writing a failure into it. Once a rank has written a key (a failure, a roll call), the token can
be seen by anyone who lists the store's keys: it is then spent, and a watchdog is never made with it again
(:data:`SPENT_TOKENS`; every watchdog draws its own by default). What a rank reads back from the store is cut to
:data:`TEXT_LIMIT` characters and to printable ones (:func:`printable`) before it is printed or raised.

The watchdog imports nothing of Lightning: it needs a gloo group of every rank and the job's store.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["FAILED", "FINISHED", "RUNNING", "SPENT_TOKENS", "TEXT_LIMIT", "PeerWatchdog", "printable", "share_token"]

RUNNING, FINISHED, FAILED = 0, 1, 2
POLL_S = 0.05
"""How often the watchdog's thread looks whether its pending heartbeat completed (the thread only; cheap)."""
ROLL_CALL_S = 3.0
"""At least this long the survivors of a death answer the roll call before the silent ranks are called dead."""
TEXT_LIMIT = 4000
"""Characters of a rank's error, or of a verdict, that go through the store."""
TOKEN_BYTES = 16
"""Random bytes of the token the store's keys start with."""
SPENT_TOKENS: set[str] = set()
"""The tokens this process has written keys under: visible to whoever lists the store's keys, refused from then on."""


class _Broken(Exception):
    """The heartbeat cannot complete: a peer closed its connections, timed out, or the store says so."""


class PeerWatchdog:
    """A heartbeat between all ranks on a gloo group, in a daemon thread (see the module docstring).

    Args:
        group: A gloo group of every rank, used by this watchdog only.
        rank: This process's global rank.
        world_size: The number of ranks in ``group``.
        describe: Names a rank in messages, e.g. ``"stage 1 (rank 1)"``.
        timeout: The strategy's timeout: how long a heartbeat may take before the silent ranks are called dead.
        on_failure: Called once, on the watchdog's thread, with a message naming the failed or dead ranks,
            unless this rank :meth:`claim`-ed the failure handling first.
        store: Where failures are reported and the roll call is held (default: the default group's store).
        period: Seconds between heartbeats (default: a tenth of the timeout, at most one second).
        token: What the watchdog's keys in the store start with; the same on every rank and secret to the job
            (default: rank 0 draws one and broadcasts it over ``group``: a collective, every rank makes its
            watchdog at the same point). A spent one (in :data:`SPENT_TOKENS`) is refused.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        rank: int,
        world_size: int,
        describe: Callable[[int], str],
        timeout: timedelta,
        on_failure: Callable[[str], None],
        store: dist.Store | None = None,
        period: float | None = None,
        token: str | None = None,
    ) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.describe = describe
        self.timeout = timeout.total_seconds()
        self.period = period if period is not None else min(1.0, self.timeout / 10)
        base = store if store is not None else dist.distributed_c10d._get_default_store()
        token = token if token is not None else share_token(group, rank)
        if token in SPENT_TOKENS:
            raise ValueError(
                "This watchdog token is spent: keys were written under it, so anyone who lists the store's keys "
                "has seen it. Leave `token` out (rank 0 draws a new one) or pass a new one."
            )
        self._token = token
        self.store = dist.PrefixStore(f"async_pp/watchdog/{token}/", base)
        self.on_failure = on_failure
        self.peer_failure: str | None = None
        """What the watchdog learnt about the other ranks (``None``: nothing failed)."""
        self._status = RUNNING
        self._claimed = False
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._learnt = threading.Event()
        self._carried = threading.Event()  # a heartbeat that carried this rank's FAILED completed
        self._roll_call_started = threading.Event()
        self._roll_call_s = max(ROLL_CALL_S, 3 * self.period)
        self._gone: set[int] = set()  # the ranks the watchdog found failed or dead
        self._thread = threading.Thread(target=self._run, name="async_pp watchdog", daemon=True)

    def start(self) -> None:
        """Start the heartbeat (every rank, after the group was created)."""
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    # --- the main thread -----------------------------------------------------------------------------

    def claim(self, wait: float = 0.0) -> str | None:
        """The main thread handles a failure of this rank: ``on_failure`` is not called any more.

        Args:
            wait: Seconds to wait for the watchdog to learn of a failed or dead peer (an error of the main
                thread may be a consequence of one: a closed connection, a transfer that timed out).

        Returns:
            The peer's failure if one is known (this rank's error is then a consequence), else ``None``.
        """
        with self._lock:
            self._claimed = True
        if wait > 0 and self.running:
            self._learnt.wait(wait)
            if self._roll_call_started.is_set():  # the heartbeat broke too: let the roll call conclude
                self._learnt.wait(self._roll_call_s + 1.0)
        return self.peer_failure

    def report_failure(self, error: str, wait: float) -> None:
        """Tell every rank that this rank failed with ``error``; return once they know, or after ``wait`` seconds."""
        try:
            self._set(f"failed/{self.rank}", error[:TEXT_LIMIT])
            self._set("broken", str(self.rank))
        except Exception:  # noqa: BLE001 - the store's host is gone; the heartbeat still carries the status
            pass
        self._status = FAILED
        self._gone.add(self.rank)
        self._wake.set()
        deadline = time.monotonic() + wait
        while self.running and not self._carried.is_set() and time.monotonic() < deadline:
            self._carried.wait(POLL_S)
        self.hold_store(max(0.0, deadline - time.monotonic()))

    def hold_store(self, limit: float | None = None) -> None:
        """On rank 0, whose process hosts the job's store in a plain launch: return once every other rank that is
        still alive has read what failed from it (or after ``limit`` seconds, by default the roll call and two
        heartbeats), so that none of them takes rank 0's exit for the failure. Other ranks return at once."""
        if self.rank != 0:
            return
        deadline = time.monotonic() + (limit if limit is not None else self._roll_call_s + 2 * self.period)
        waiting = [r for r in range(self.world_size) if r != self.rank and r not in self._gone]
        while waiting and time.monotonic() < deadline:
            try:
                waiting = [r for r in waiting if not self.store.check([f"seen/{r}"])]
            except Exception:  # noqa: BLE001 - the store cannot be reached: nobody can read it any more
                return
            time.sleep(POLL_S)

    def finish(self) -> bool:
        """This rank is done (a normal end): wait until every rank is, at most the timeout.

        Returns:
            Whether every rank finished (``False``: a peer failed, or did not finish within the timeout).
        """
        self._status = FINISHED
        self._wake.set()
        self._thread.join(self.timeout)
        return not self._thread.is_alive() and self.peer_failure is None

    # --- the watchdog's thread -----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._heartbeats()
        except _Broken as error:
            self._learn(self._roll_call(str(error)))

    def _heartbeats(self) -> None:
        while True:
            status = self._status
            statuses = torch.zeros(self.world_size, dtype=torch.uint8)
            statuses[self.rank] = status
            self._complete(dist.all_reduce(statuses, group=self.group, async_op=True))
            if status == FAILED:
                self._carried.set()
                return
            values = statuses.tolist()
            failed = [r for r, s in enumerate(values) if s == FAILED]
            if failed:
                self._learn(self._failures(failed) or "; ".join(f"{self.describe(r)} failed" for r in failed))
                return
            if all(s == FINISHED for s in values):
                return
            if self._status == status:  # a change of status travels at once
                self._wake.wait(self.period)
            self._wake.clear()

    def _complete(self, work: dist.Work) -> None:
        start = time.monotonic()
        next_look = start + self.period
        while not work.is_completed():
            now = time.monotonic()
            if now >= next_look:  # late: a rank may have stopped answering; has another one noticed?
                next_look = now + self.period
                if self._store_says_broken():
                    raise _Broken("another rank noticed a failure")
            if now - start > self.timeout + self.period:
                raise _Broken(f"no heartbeat for {self.timeout:.0f} s")
            time.sleep(POLL_S)
        try:
            work.wait()
        except RuntimeError as error:
            raise _Broken(str(error)) from error

    def _store_says_broken(self) -> bool:
        try:
            return self.store.check(["broken"])
        except Exception:  # noqa: BLE001 - an unreachable store is a failure too
            return True

    def _roll_call(self, reason: str) -> str:
        """Who failed or died: the ranks that reported an error, else those that do not answer a roll call."""
        self._roll_call_started.set()
        try:
            self._set("broken", str(self.rank))
            self._set(f"alive/{self.rank}", "1")
            deadline = time.monotonic() + self._roll_call_s
            while time.monotonic() < deadline:
                failed = [r for r in range(self.world_size) if self.store.check([f"failed/{r}"])]
                if failed:
                    return self._failures(failed)
                if self.store.check(["verdict"]):  # another survivor concluded first
                    self._gone.update(self._ranks(self.store.get("gone")))
                    return printable(self.store.get("verdict"))
                time.sleep(0.2)
            silent = [r for r in range(self.world_size) if not self.store.check([f"alive/{r}"])]
            self._gone.update(silent)
        except Exception:  # noqa: BLE001 - the store lives in rank 0 (or the launcher's agent)
            return (
                f"{self.describe(0)} died or stopped responding: the job's rendezvous store, which it hosts, "
                f"cannot be reached ({reason})"
            )
        if not silent:
            return f"the heartbeat between the ranks broke ({reason}), but every rank answered"
        names = ", ".join(self.describe(r) for r in silent)
        verdict = (
            f"{names} died or stopped responding without reporting an error (killed, crashed, out of host memory, "
            f"or frozen; see its output and the system log); the heartbeat said: {reason}"
        )
        try:
            self._set("gone", ",".join(map(str, silent)))  # before the verdict: whoever reads one finds both
            self._set("verdict", verdict)
        except Exception:  # noqa: BLE001 - its host went in the meantime; this rank still says what it saw
            pass
        return verdict

    def _failures(self, ranks: list[int]) -> str:
        self._gone.update(ranks)
        messages = []
        for r in ranks:
            try:
                error = printable(self.store.get(f"failed/{r}")) if self.store.check([f"failed/{r}"]) else None
            except Exception:  # noqa: BLE001 - its host is gone; the status alone names the rank
                error = None
            messages.append(f"{self.describe(r)} failed" + (f": {error}" if error else " (its error is above)"))
        return "; ".join(messages)

    def _set(self, key: str, value: str) -> None:
        SPENT_TOKENS.add(self._token)  # before the key appears: from then on the store's listing shows the token
        self.store.set(key, value)

    def _ranks(self, text: bytes) -> set[int]:
        words = text.decode(errors="replace").split(",")
        return {int(w) for w in words if w.isdigit() and int(w) < self.world_size}

    def _learn(self, message: str) -> None:
        with self._lock:
            self.peer_failure = message
            claimed = self._claimed
        try:
            self._set(f"seen/{self.rank}", "1")  # rank 0 may hold the store until every survivor read it
        except Exception:  # noqa: BLE001 - the store's host is gone; nothing waits for this rank
            pass
        self._learnt.set()
        if not claimed and self._status != FAILED:
            self.on_failure(message)


def share_token(group: dist.ProcessGroup, rank: int) -> str:
    """A random token, drawn on rank 0 and broadcast over ``group`` (a collective of its ranks; rank 0 is one).

    Args:
        group: A group of every rank.
        rank: This process's global rank.
    """
    drawn = secrets.token_bytes(TOKEN_BYTES) if rank == 0 else bytes(TOKEN_BYTES)
    token = torch.tensor(list(drawn), dtype=torch.uint8)
    dist.broadcast(token, src=0, group=group)
    return bytes(token.tolist()).hex()


def printable(raw: bytes | str, limit: int = TEXT_LIMIT) -> str:
    """``raw`` as text fit to print: at most ``limit`` characters, line breaks and tabs as spaces, every other
    character that does not print (escape sequences, other controls) as ``?``.

    Args:
        raw: What was read from the store (undecodable bytes become U+FFFD).
        limit: Characters kept; a longer text ends in ``...``.
    """
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    cut = len(text) > limit
    text = text[: limit - 3] if cut else text
    text = "".join(c if c.isprintable() else " " if c in "\n\r\t" else "?" for c in text)
    return text + "..." if cut else text
