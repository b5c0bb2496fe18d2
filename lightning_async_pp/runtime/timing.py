"""Per-stage step statistics, relayed to global rank 0 without stalling the pipeline.

Every stage but the one on rank 0 posts a small non-blocking send per step; rank 0 polls its posted
receives between steps and hands complete records to a callback. A blocking gather would make every
stage wait for the slowest one at every step, which is exactly the bubble 2BW removes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_async_pp.runtime.stage import StepStats

FIELDS = ("step", "wall", "forward", "backward", "wait", "update", "version_lag")


def encode(stats: StepStats) -> Tensor:
    return torch.tensor([float(getattr(stats, name)) for name in FIELDS], dtype=torch.float64)


def decode(values: Tensor) -> StepStats:
    record = dict(zip(FIELDS, values.tolist()))
    return StepStats(step=int(record.pop("step")), version_lag=int(record.pop("version_lag")), **record)


class StatsRelay:
    """Moves each stage's :class:`StepStats` to rank 0.

    Args:
        rank: This process's global rank.
        peers: Global ranks that report to rank 0 (the other stages of one pipeline).
        group: A gloo process group of rank 0 and ``peers``, used only for statistics, so that they never
            queue behind activations.
    """

    def __init__(self, rank: int, peers: list[int], group: dist.ProcessGroup | None) -> None:
        self.rank = rank
        self.peers = list(peers)
        self.group = group
        self._sends: list[tuple[dist.Work, Tensor]] = []
        self._recvs: dict[int, tuple[Tensor, dist.Work]] = {}
        self.sent = 0
        self.received = {peer: 0 for peer in self.peers}

    def publish(self, stats: StepStats) -> None:
        """Non-zero ranks: post the send of this step's record."""
        if self.rank not in self.peers:
            return
        values = encode(stats)
        self._sends = [(w, t) for w, t in self._sends if not w.is_completed()]
        self._sends.append((dist.isend(values, 0, group=self.group), values))
        self.sent += 1

    def poll(self, handle: Callable[[int, StepStats], None], steps: int, block: bool = False) -> None:
        """Rank 0: hand every arrived record to ``handle(rank, stats)``.

        Args:
            handle: Called once per record, in step order for each peer.
            steps: Steps run so far; every peer sends one record per step, so no receive is posted beyond.
            block: Wait until all ``steps`` records arrived from every peer (at the end of training).
        """
        if self.rank != 0:
            return
        for peer in self.peers:
            while self.received[peer] < steps:
                if peer not in self._recvs:
                    buffer = torch.empty(len(FIELDS), dtype=torch.float64)
                    self._recvs[peer] = (buffer, dist.irecv(buffer, peer, group=self.group))
                buffer, work = self._recvs[peer]
                if not block and not work.is_completed():
                    break
                work.wait()
                del self._recvs[peer]
                self.received[peer] += 1
                handle(peer, decode(buffer))

    def close(self) -> None:
        """Non-zero ranks: wait until rank 0 has taken every record."""
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()


def write_chrome_trace(stage_events: list[tuple[int, list[tuple[str, float, float]]]], directory: str) -> str:
    """Write every stage's action timings as one Chrome trace (one row per stage); returns its path.

    Args:
        stage_events: ``(stage, [(action, start, end), ...])`` per stage, times in seconds on one clock.
        directory: Created if missing; the file is ``pipeline_trace.json``, replaced atomically.
    """
    origin = min((events[0][1] for _, events in stage_events if events), default=0.0)
    trace = []
    for stage, events in sorted(stage_events):
        trace.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": stage, "args": {"name": f"stage {stage}"}})
        for name, start, end in events:
            kind = name.lstrip("0123456789")
            trace.append(
                {
                    "name": name,
                    "cat": kind.rstrip("0123456789"),
                    "ph": "X",
                    "pid": 0,
                    "tid": stage,
                    "ts": (start - origin) * 1e6,
                    "dur": (end - start) * 1e6,
                }
            )
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "pipeline_trace.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, f)
    os.replace(path + ".tmp", path)
    return path
