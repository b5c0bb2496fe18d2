"""Transfers under NCCL's point-to-point semantics: the posting order the runtime uses never deadlocks.

The model (:func:`check_transfers`): per link, a stage's batches of sends and receives run one after the
other in posting order; a receive completes only once the peer's matching send has started, and (with
``rendezvous``) a send only once the matching receive has started. The programs checked are the ones
the runtime follows (:func:`host_program` over :func:`posting_plan`), and the last test records what
:class:`StageRuntime` actually posts to prove it follows them.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_async_pp.runtime.stage import StageRuntime
from lightning_async_pp.schedule import (
    SCHEDULES,
    check_transfers,
    drain_actions,
    evaluation_actions,
    host_program,
    step_actions,
)

# Two runs with a validation pass between them, then a resumed run (a new process starting at step 7).
RUNS = [(0, 3), (3, 5)]
RESUMED = (7, 9)


def segments(kind: str, P: int, M: int, stage: int, runs, evaluations: int = 2):
    out = []
    for start, end in runs:
        for step in range(start, end):
            out.append(step_actions(kind, P, M, stage, step, run_start=start))
        out.append(drain_actions(kind, P, M, stage, end - 1, run_start=start))
        out += [evaluation_actions(P, stage, index) for index in range(evaluations)]
    return out


def programs(kind: str, P: int, M: int, eager: bool = False, runs=(*RUNS, RESUMED)):
    return [host_program(segments(kind, P, M, s, runs), eager=eager) for s in range(P)]


@pytest.mark.parametrize("kind", SCHEDULES)
@pytest.mark.parametrize("P", [*range(2, 9), *(pytest.param(P, marks=pytest.mark.slow) for P in range(9, 17))])
def test_schedules_never_deadlock_under_nccl_semantics(kind, P):
    for M in (P, 2 * P, 4 * P):
        progs = programs(kind, P, M)
        # Sends that wait for their receive (large NCCL messages), one queue per link (a group per link)
        # and one queue per stage (every link on one communicator, as batched operations on a shared group).
        for per_link in (True, False):
            check_transfers(progs, rendezvous=True, per_link=per_link)
        check_transfers(progs, rendezvous=False, per_link=True)


@pytest.mark.parametrize("kind", SCHEDULES)
@pytest.mark.parametrize("P", [2, 3, 4, 8])
def test_eager_prefetch_deadlocks_under_the_model(kind, P):
    """The order used before transfers were batched (each link's receive posted at the segment start and
    re-posted as soon as one completed, ahead of sends) deadlocks at the first step, even with sends that
    never wait for their receive."""
    with pytest.raises(AssertionError, match="transfers deadlock"):
        check_transfers(programs(kind, P, P, eager=True, runs=[(0, 1)]), rendezvous=False)


def test_model_catches_crossed_sends():
    """Both neighbours sending before receiving, unbatched, with rendezvous sends: the classic NCCL hang."""
    link = (0, 1)
    a = [
        ("post", (("S", link, ("F", 0, 0)),)),
        ("post", (("R", link, ("B", 0, 0)),)),
        ("wait", ("R", link, ("B", 0, 0))),
    ]
    b = [
        ("post", (("S", link, ("B", 0, 0)),)),
        ("post", (("R", link, ("F", 0, 0)),)),
        ("wait", ("R", link, ("F", 0, 0))),
    ]
    with pytest.raises(AssertionError, match="deadlock"):
        check_transfers([a, b], rendezvous=True)
    check_transfers([a, b], rendezvous=False)  # buffered sends would pass
    batched_a = [("post", (a[0][1][0], a[1][1][0])), a[2]]
    batched_b = [("post", (b[0][1][0], b[1][1][0])), b[2]]
    check_transfers([batched_a, batched_b], rendezvous=True)  # batching is the fix


class RecordingChannel:
    """Stands in for :class:`Channel` and records what the runtime posts and waits for."""

    def __init__(self, side: str, log: list, shape) -> None:
        self.side, self.log, self.shape, self.posted = side, log, shape, False

    def send(self, tensors, post_recv: bool = False) -> None:
        assert isinstance(tensors, list) and all(isinstance(t, torch.Tensor) for t in tensors)
        ops = [("S", self.side)]
        if post_recv and not self.posted:
            ops.append(("R", self.side))
            self.posted = True
        self.log.append(("post", tuple(ops)))

    def prefetch(self) -> None:
        if not self.posted:
            self.log.append(("post", (("R", self.side),)))
            self.posted = True

    def recv(self):
        self.prefetch()
        self.posted = False
        self.log.append(("wait", ("R", self.side)))
        return [torch.randn(self.shape)]

    def forget_layout(self) -> None:
        assert not self.posted

    def wait_sends(self) -> None:
        pass


def project(items, stage: int):
    """The model's items as (role, side) per operation, as RecordingChannel logs them."""

    def side(op):
        return "prev" if op[1][0] < stage else "next"

    out = []
    for kind, arg in items:
        if kind == "post":
            if arg:
                out.append(("post", tuple((op[0], side(op)) for op in arg)))
        else:
            out.append(("wait", (arg[0], side(arg))))
    return out


@pytest.mark.parametrize("kind", SCHEDULES)
@pytest.mark.parametrize("P,M", [(2, 2), (3, 6), (4, 4)])
def test_runtime_posts_what_the_model_checks(kind, P, M):
    torch.manual_seed(0)
    width, rows = 4, 2
    for stage in range(P):
        log: list = []
        layer = nn.Linear(width, width)
        runtime = StageRuntime(
            kind=kind,
            stage=stage,
            num_stages=P,
            num_microbatches=M,
            layers=[layer],
            optimizer=torch.optim.SGD(layer.parameters(), lr=0.1),
            inputs_fn=lambda mb: mb,
            loss_fn=lambda out, mb: out.pow(2).mean(),
            device=torch.device("cpu"),
            prev_rank=stage - 1 if stage else None,
            next_rank=stage + 1 if stage < P - 1 else None,
            check_finite=False,
            check_data_order=False,  # the recording channels carry activations only
        )
        if runtime.prev is not None:
            runtime.prev = RecordingChannel("prev", log, (rows, width))
        if runtime.next is not None:
            runtime.next = RecordingChannel("next", log, (rows, width))
        for start, end in RUNS:
            for step in range(start, end):
                runtime.run_step(step, torch.randn(rows * M, width))
            runtime.drain()
            for _ in range(2):
                runtime.evaluate(torch.randn(rows, width))
        expected = project(host_program(segments(kind, P, M, stage, RUNS)), stage)
        assert log == expected, f"stage {stage}"
