"""Transfers under NCCL's point-to-point semantics: the posting order the runtime uses never deadlocks.

The model (:func:`check_transfers`): per link, a stage's batches of sends and receives run one after the
other in posting order; a receive completes only once the peer's matching send has started, and (with
``rendezvous``) a send only once the matching receive has started. The programs checked are the ones
the runtime follows (:func:`host_program` over :func:`posting_plan`), and the last test records what
:class:`StageRuntime` actually posts to prove it follows them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_async_pp.runtime import updates
from lightning_async_pp.runtime.stage import StageRuntime
from lightning_async_pp.runtime.ties import Tie, TiedGradients
from lightning_async_pp.schedule import (
    FLUSH,
    SCHEDULES,
    PlanEntry,
    UpdatePlan,
    check_transfers,
    drain_actions,
    evaluation_actions,
    host_program,
    step_actions,
)

# Two runs with a validation pass between them, then a resumed run (a new process starting at step 7).
RUNS = [(0, 3), (3, 5)]
RESUMED = (7, 9)


def segments(kind: str, P: int, M: int, stage: int, runs, evaluations: int = 2, sync_each_step: bool = False):
    out = []
    for start, end in runs:
        for step in range(start, end):
            out.append(step_actions(kind, P, M, stage, step, run_start=start))
            if sync_each_step:
                out.append(FLUSH)
        out += [drain_actions(kind, P, M, stage, end - 1, run_start=start), FLUSH]
        # Evaluation batches of M micro-batches, then of one (a last batch that M does not divide).
        out += [evaluation_actions(P, stage, index, M if index % 2 == 0 else 1) for index in range(evaluations)]
    return out


def programs(kind: str, P: int, M: int, eager: bool = False, runs=(*RUNS, RESUMED), collectives=None, sync=False):
    """Every rank's program; ``collectives``: the update's plan, or one per replica."""
    plans = [collectives] if not isinstance(collectives, (list, tuple)) else list(collectives)
    plans *= (plans[0].replicas if plans[0] is not None else 1) // len(plans)
    return [
        host_program(segments(kind, P, M, s, runs, sync_each_step=sync), eager, plan, replica)
        for replica, plan in enumerate(plans)
        for s in range(P)
    ]


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
@pytest.mark.parametrize("P", [2, 3, 4])
def test_runs_of_other_micro_batch_counts_never_deadlock(kind, P):
    """Gradient accumulation: steps of k x M micro-batches, a short last window of an epoch (M), then k x M again;
    the runtime drains before a step whose count differs from its run's, so each count is a run of its own."""
    M, k = P, 3
    runs = [(0, 3, k * M), (3, 4, M), (4, 6, k * M), (6, 7, 2 * M)]
    progs = []
    for s in range(P):
        segs = []
        for start, end, count in runs:
            segs += [step_actions(kind, P, count, s, step, run_start=start) for step in range(start, end)]
            segs += [drain_actions(kind, P, count, s, end - 1, run_start=start), FLUSH]
        progs.append(host_program(segs))
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


def pending_collectives(P: int) -> dict[str, UpdatePlan]:
    """The runtime's configurations whose all-reduces stay pending across segments."""
    # A tie whose lowest holder is not stage 0 makes that holder wait for the tie's sum at its update.
    middle = ((1, P - 1),) if P > 2 else ()
    return {
        "clipping": UpdatePlan(P, clip=True),
        "ties": UpdatePlan(P, ties=((0, P - 1), (0, 1))),
        "ties, clipping": UpdatePlan(P, clip=True, ties=((0, P - 1), (0, 1), *middle)),
        "middle tie, clipping": UpdatePlan(P, clip=True, ties=middle or ((0, 1),)),
        "replicas": UpdatePlan(P, replicas=2),
        "replicas, clipping": UpdatePlan(P, replicas=2, clip=True),
        "replicas, ties": UpdatePlan(P, replicas=2, ties=((0, P - 1),)),
        "replicas, ties, clipping": UpdatePlan(P, replicas=2, clip=True, ties=((0, P - 1), *middle)),
    }


@pytest.mark.parametrize("kind", SCHEDULES)
@pytest.mark.parametrize("P", [2, 3, 4, 5, *(pytest.param(P, marks=pytest.mark.slow) for P in range(6, 13))])
def test_pending_collectives_never_deadlock_under_nccl_semantics(kind, P):
    """The clipping norm's, the tied gradients' and the replicas' all-reduces, each on its own communicator,
    posted at UPDATE (stage 0's norm with a tie it holds lowest: where its version is needed) and waited when
    their version is first needed or at the drain (as UpdateDriver does)."""
    for collectives in pending_collectives(P).values():
        for M in (P, 2 * P):
            progs = programs(kind, P, M, collectives=collectives)
            for per_link in (True, False):
                check_transfers(progs, rendezvous=True, per_link=per_link)
            check_transfers(progs, rendezvous=False)


@pytest.mark.parametrize("P", [2, 3, 4])
def test_waiting_for_a_pending_all_reduce_too_early_deadlocks_2bw(P):
    """What the runtime avoids, and what a user must not add (docs/troubleshooting.md): waiting for the norm
    right after posting it (a synchronous clipping), a device-wide synchronization after each step while it
    is pending (``torch.cuda.synchronize`` in a callback, ``torch.cuda.empty_cache``), and one hardware
    queue per device (``CUDA_DEVICE_MAX_CONNECTIONS=1``). 2BW's last stage updates before the first stage
    has sent it the next step's activations; 1F1B needs the new version at once, so waiting costs it nothing."""
    clipping, ties = UpdatePlan(P, clip=True), UpdatePlan(P, ties=((0, P - 1),))
    bad = {
        "synchronous clipping": (programs("2bw", P, P, collectives=UpdatePlan(P, clip=True, deferred=False)), {}),
        "synchronous ties": (programs("2bw", P, P, collectives=UpdatePlan(P, ties=((0, P - 1),), deferred=False)), {}),
        "synchronize after each step": (programs("2bw", P, P, collectives=clipping, sync=True), {}),
        "one hardware queue": (programs("2bw", P, P, collectives=ties), {"one_queue": True}),
    }
    for name, (progs, options) in bad.items():
        try:
            check_transfers(progs, rendezvous=True, **options)
        except AssertionError as error:
            assert "transfers deadlock" in str(error), name
        else:
            pytest.fail(f"the model found no deadlock with {name}")
        check_transfers(progs, rendezvous=False, **options)  # the rendezvous is what hangs: sends wait
    for options in (
        {"collectives": UpdatePlan(P, clip=True, deferred=False)},
        {"collectives": clipping, "sync": True},
    ):
        check_transfers(programs("1f1b", P, P, **options), rendezvous=True)


@dataclass(frozen=True)
class NormPostedWhereNeeded(UpdatePlan):
    """Clipping with ties where every lowest holder of a tie, not only stage 0, posts the norm only where its
    version is needed (after waiting for the tie's sum there)."""

    def entries(self, stage):
        entries = super().entries(stage)
        chain = [e for e in entries["update"] if (e.action == "wait" and e.name == "tie") or e.name == "norm"]
        if not any(e.action == "wait" for e in chain):
            return entries
        update = tuple(e for e in entries["update"] if e not in chain)
        return {**entries, "update": update, "needed": (*chain, *entries["needed"])}


@pytest.mark.parametrize("kind", SCHEDULES)
@pytest.mark.parametrize("P", [3, 4])
def test_norm_of_a_tie_held_lowest_after_stage_0_must_be_posted_at_update(kind, P):
    """Why a lowest holder other than stage 0 waits for its tie's sum at UPDATE: posting the norm where the
    version is needed deadlocks, as stage 0 then waits for it before it sends that step's activations."""
    progs = programs(kind, P, P, collectives=NormPostedWhereNeeded(P, clip=True, ties=((1, P - 1),)))
    with pytest.raises(AssertionError, match="transfers deadlock"):
        check_transfers(progs, rendezvous=True)
    check_transfers(programs(kind, P, P, collectives=UpdatePlan(P, clip=True, ties=((1, P - 1),))), rendezvous=True)


def sharded_collectives(P: int, D: int) -> dict[str, UpdatePlan]:
    """The runtime's configurations with the optimizer state sharded over ``D`` replicas."""
    ties = ((0, P - 1),)
    return {
        "in flight": UpdatePlan(P, replicas=D, shard=True),
        "hook": UpdatePlan(P, replicas=D, shard=True, hook=True),
        "clipping": UpdatePlan(P, replicas=D, clip=True, shard=True),
        "ties": UpdatePlan(P, replicas=D, ties=ties, shard=True),
        "ties, clipping": UpdatePlan(P, replicas=D, clip=True, ties=ties, shard=True),
        "two ties, clipping": UpdatePlan(P, replicas=D, clip=True, ties=(*ties, (1, P - 1)), shard=True),
    }


@pytest.mark.parametrize("kind", SCHEDULES)
@pytest.mark.parametrize("P", [2, 3, 4])
@pytest.mark.parametrize("D", [2, 3])
def test_sharded_optimizer_state_never_deadlocks_under_nccl_semantics(kind, P, D):
    """Sharded state: the reduce-scatter posted at UPDATE, waited for at the next backward (which posts the
    all-gather) or, with clipping or ties, at once; the all-gather waited for where the version is needed. Every
    operation on the replicas' communicator shares its queue, and each replica posts them in the same order."""
    for name, collectives in sharded_collectives(P, D).items():
        for M in (P, 2 * P):
            progs = programs(kind, P, M, collectives=collectives)
            for per_link in (True, False):
                check_transfers(progs, rendezvous=True, per_link=per_link)
            check_transfers(progs, rendezvous=False)
    # In flight, with nothing pending across the pipeline, even one hardware queue per device is safe.
    for name in ("in flight", "hook"):
        check_transfers(programs(kind, P, P, collectives=sharded_collectives(P, D)[name]), one_queue=True)


def test_where_a_sharded_update_waits_and_posts():
    """The entries of one update, in flight and with clipping and ties (stage 0 of P = 2), and where the
    programs of replica 1 of two run them."""

    def post(name, index=0):
        return PlanEntry("post", name, index)

    def wait(name, index=0):
        return PlanEntry("wait", name, index)

    scatter = ("C", ("data", (0, 2)), ("reduce-scatter", 3, 0))
    in_flight = UpdatePlan(2, replicas=2, shard=True)
    assert in_flight.entries(0) == {
        "update": (post("reduce-scatter"),),
        "backward": (wait("reduce-scatter"), PlanEntry("run", "step"), post("all-gather")),
        "settle": (),
        "needed": (wait("all-gather"),),
    }
    clipped = UpdatePlan(2, replicas=2, clip=True, ties=((0, 1),), shard=True)
    assert clipped.entries(0) == {
        "update": (
            post("reduce-scatter"),
            post("tied average"),
            wait("tied average"),
            wait("reduce-scatter"),
            PlanEntry("run", "local norm"),
            post("norms"),
            wait("norms"),
            post("tie", 0),
        ),
        "backward": (),
        "settle": (wait("tie", 0), post("norm"), wait("norm"), PlanEntry("run", "step"), post("all-gather")),
        "needed": (wait("all-gather"),),
    }
    # With clipping (no tie), stage 1 of 2BW settles UPDATE(t) at its forward of micro-batch P - 1 = 1 of t + 1.
    program = host_program(
        segments("2bw", 2, 2, 1, [(0, 3)], evaluations=0),
        updates=UpdatePlan(2, replicas=2, clip=True, shard=True),
        replica=1,
    )
    marks = [(k, op[2][0], op[2][1]) for k, arg in program for op in ((arg,) if k == "wait" else arg) if op[0] == "C"]
    settled = marks.index(("wait", "norm", 0))
    assert marks[settled + 1] == ("post", "all-gather", 0)
    assert marks[settled + 2 :][:1] == [("wait", "all-gather", 0)]  # at the next UPDATE, before its reduce-scatter
    forward = program.index(("wait", ("R", (2, 3), ("F", 1, 1))))  # stage 1 receives F(1, 1) before it runs it
    assert program.index(("wait", ("C", ("norm", (2, 3)), ("norm", 0, 0)))) > forward
    # Stage 0 of 2BW (0F2 0SF2 0RB1 0B1 0U0 0F3 0SF3 0RB2 0B2 | 0F4 ... 0U1 ... 0B4 | drain: 0RB5 0B5 0U2).
    program = host_program(segments("2bw", 2, 2, 0, [(0, 3)], evaluations=0), updates=in_flight, replica=1)
    data = [(k, op[2][0], op[2][1]) for k, arg in program for op in ((arg,) if k == "wait" else arg) if op[0] == "C"]
    assert data == [
        ("post", "reduce-scatter", 0),  # 0U0
        ("wait", "reduce-scatter", 0),  # 0B2, the next backward
        ("post", "all-gather", 0),
        ("wait", "all-gather", 0),  # 0F4, the first forward on version 1
        ("post", "reduce-scatter", 1),  # 0U1
        ("wait", "reduce-scatter", 1),  # 0B4
        ("post", "all-gather", 1),
        ("wait", "all-gather", 1),  # 0U2, which reuses the buffers, before its reduce-scatter
        ("post", "reduce-scatter", 2),
        ("wait", "reduce-scatter", 2),  # the flush: no backward came after 0U2
        ("post", "all-gather", 2),
        ("wait", "all-gather", 2),
    ]
    backward = program.index(("wait", scatter[:2] + (("reduce-scatter", 0, 0),)))
    assert program[backward - 1] == ("wait", ("R", (2, 3), ("B", 1, 0)))  # the gradient 0B2 needs


@pytest.mark.parametrize("P", [2, 3, 4])
def test_sharded_step_at_update_deadlocks_2bw(P):
    """Stepping (and all-gathering) at UPDATE with clipping or ties, to overlap the all-gather, needs the
    pipeline's norm and the tied sums there: a synchronous clipping, which deadlocks 2BW (its last stage updates
    before the first stage has sent it the next step's activations). 1F1B needs the version at once."""
    for options in ({"clip": True}, {"ties": ((0, P - 1),)}):
        collectives = UpdatePlan(P, replicas=2, shard=True, deferred=False, **options)
        with pytest.raises(AssertionError, match="transfers deadlock"):
            check_transfers(programs("2bw", P, P, collectives=collectives), rendezvous=True)
        check_transfers(programs("1f1b", P, P, collectives=collectives), rendezvous=True)


@dataclass(frozen=True)
class SkipsGather(UpdatePlan):
    """Sharded state where a replica owning no tensor posts no all-gather (``ReplicaShards.gather`` posts one for
    every replica, with an empty segment if need be)."""

    def entries(self, stage):
        entries = super().entries(stage)
        return {point: tuple(e for e in items if e.name != "all-gather") for point, items in entries.items()}


@pytest.mark.parametrize("kind", SCHEDULES)
@pytest.mark.parametrize("clip", [False, True])
def test_every_replica_must_post_the_all_gather(kind, clip):
    plans = [UpdatePlan(3, replicas=2, clip=clip, shard=True), SkipsGather(3, replicas=2, clip=clip, shard=True)]
    with pytest.raises(AssertionError, match="transfers deadlock"):
        check_transfers(programs(kind, 3, 3, collectives=plans), rendezvous=False)
    check_transfers(programs(kind, 3, 3, collectives=plans[:1]), rendezvous=False)


class RecordingChannel:
    """Stands in for :class:`Channel` and records what the runtime posts and waits for."""

    def __init__(self, side: str, log: list, shape) -> None:
        self.side, self.log, self.shape, self.posted = side, log, shape, False

    def send(self, tensors, post_recv: bool = False, tag=None) -> None:
        assert isinstance(tensors, list) and all(isinstance(t, torch.Tensor) for t in tensors)
        ops = [("S", self.side)]
        if post_recv and not self.posted:
            ops.append(("R", self.side))
            self.posted = True
        self.log.append(("post", tuple(ops)))

    def peer_received(self, through) -> None:
        """Waits only for sends whose receives have matched: it never blocks, so the model leaves it out."""

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

    def wait_sends(self, through=None) -> None:
        pass


class RecordingCollectives:
    """Stands in for ``torch.distributed``'s all-reduce; records each posted collective by its group's name."""

    def __init__(self, log: list) -> None:
        self.log = log

    def all_reduce(self, tensor, op=None, group=None, async_op=False):
        self.log.append(("post", (("C", group),)))
        work = SimpleNamespace(wait=lambda: self.log.append(("wait", ("C", group))))
        if not async_op:
            work.wait()  # a blocking all-reduce: on NCCL the compute stream waits for it
        return work if async_op else None

    def reduce_scatter_single(self, output, input, op=None, group=None, async_op=False):
        return self.all_reduce(output, op, group, async_op)

    def all_gather_single(self, output, input, group=None, async_op=False):
        return self.all_reduce(output, None, group, async_op)


def project(items, stage: int):
    """The model's items as (role, side) per transfer, (role, group name) per collective, as the recorders log."""

    def side(op):
        if op[0] == "C":
            return op[1][0]
        return "prev" if op[1][0] < stage else "next"

    out = []
    for kind, arg in items:
        if kind == "post":
            if arg:
                out.append(("post", tuple((op[0], side(op)) for op in arg)))
        else:
            out.append(("wait", (arg[0], side(arg))))
    return out


MODES = [
    "none",
    "clipping",
    "ties",
    "ties, clipping",
    "replicas",
    "replicas, clipping",
    "replicas, ties, clipping",
    "shard",
    "shard, clipping",
    "shard, ties",
    "shard, ties, clipping",
    "shard, hook",
    "replicas, hook",
]


def mode_plan(P: int, mode: str) -> UpdatePlan | None:
    """The update's plan of a mode, built from its settings here (independently of the runtime)."""
    if mode == "none":
        return None
    shard = "shard" in mode
    return UpdatePlan(
        P,
        replicas=2 if "replicas" in mode or shard else 1,
        clip="clipping" in mode,
        ties=tie_stages(P) if "ties" in mode else (),
        shard=shard,
        hook="hook" in mode,
    )


def tie_stages(P: int):
    return ((0, P - 1), (1, P - 1)) if P > 2 else ((0, P - 1),)


def run_recorded(kind: str, P: int, M: int, settings: UpdatePlan, monkeypatch, plan: UpdatePlan | None = None):
    """Run each stage's :class:`StageRuntime` over :data:`RUNS` (steps, drains, evaluations) with its channels and
    collectives recorded, configured as ``settings`` says; per stage, the log and the plan its updates executed.
    ``plan`` replaces the plan the runtime built."""
    torch.manual_seed(0)
    width, rows = 4, 2
    log: list = []
    recorder = RecordingCollectives(log)
    for name in ("all_reduce", "reduce_scatter_single", "all_gather_single"):
        monkeypatch.setattr(updates.dist, name, getattr(recorder, name))
    monkeypatch.setattr(updates.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(updates.dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(updates.dist, "get_backend", lambda group=None: "gloo")
    # The first tie is a weight, the second a bias (of the one linear layer each stage has).
    shapes = ((width, width), (width,))
    tie_list = [
        Tie({s: f"0.{kind_}" for s in stages}, stages, shape, torch.float32, True)
        for stages, kind_, shape in zip(settings.ties, ("weight", "bias"), shapes)
    ]
    out = []
    for stage in range(P):
        log.clear()
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
            clip_grad_norm=1.0 if settings.clip else None,
            norm_group="norm",
            data_group="data" if settings.replicas > 1 else None,
            shard_optimizer=settings.shard,
            before_update=(lambda: None) if settings.hook else None,
            ties=TiedGradients(
                tie_list, stage, [f"tie {i}" if stage in t.names else None for i, t in enumerate(tie_list)]
            )
            if settings.ties
            else None,
        )
        if plan is not None:
            runtime.updates.plan = plan
        if runtime.prev is not None:
            runtime.prev = RecordingChannel("prev", log, (rows, width))
        if runtime.next is not None:
            runtime.next = RecordingChannel("next", log, (rows, width))
        for start, end in RUNS:
            for step in range(start, end):
                runtime.run_step(step, torch.randn(rows * M, width))
            runtime.drain()
            # As `segments` has them: a batch of M micro-batches, then one of a prime size above M (not split).
            for size in (rows * M, next(n for n in itertools.count(M + 1) if all(n % d for d in range(2, n)))):
                runtime.evaluate(torch.randn(size, width))
        out.append((list(log), runtime.updates.plan))
    return out


def planned(kind: str, P: int, M: int, stage: int, plan: UpdatePlan | None):
    """What ``stage`` posts and waits for under ``plan``, as the recorders log it."""
    return project(host_program(segments(kind, P, M, stage, RUNS), updates=plan), stage)


@pytest.mark.parametrize("kind", SCHEDULES)
@pytest.mark.parametrize("P,M", [(2, 2), (3, 6), (4, 4)])
@pytest.mark.parametrize("mode", MODES)
def test_runtime_executes_the_plan_the_model_checks(kind, P, M, mode, monkeypatch):
    """The runtime builds the plan its settings call for, and posts and waits for exactly what that plan says
    where :func:`host_program` (the deadlock model's reading of it) says."""
    settings = mode_plan(P, mode) or UpdatePlan(P)
    for stage, (log, plan) in enumerate(run_recorded(kind, P, M, settings, monkeypatch)):
        assert plan == settings, f"stage {stage}"
        assert log == planned(kind, P, M, stage, plan), f"stage {stage}"


OPERATIONS = dict(updates.UpdateDriver.OPERATIONS)  # the runtime's own, before any test plants one


def norm_waited_at_once(driver, pending, index):
    """A runtime that does other than its plan's entry: it waits for the norm where it posts it."""
    OPERATIONS["post", "norm"](driver, pending, index)
    pending.posted["norm", 0].wait()


def scatter_waited_at_once(driver, pending, index):
    """Another: it waits for the reduce-scatter where it posts it."""
    OPERATIONS["post", "reduce-scatter"](driver, pending, index)
    owned = pending.posted["reduce-scatter", 0]()
    pending.posted["reduce-scatter", 0] = lambda: owned


@pytest.mark.parametrize(
    ("mode", "planted"),
    [
        ("clipping", {("post", "norm"): norm_waited_at_once}),
        ("shard", {("post", "reduce-scatter"): scatter_waited_at_once}),
        ("shard", "advance"),
    ],
)
def test_the_recording_catches_a_runtime_that_leaves_its_plan(mode, planted, monkeypatch):
    """Planted: an operation that waits at once for what its entry only posts, or a runtime that skips the
    ``"backward"`` point (its entries then run where the version is needed)."""
    if planted == "advance":
        monkeypatch.setattr(updates.UpdateDriver, "advance", lambda self: None)
    else:
        monkeypatch.setattr(updates.UpdateDriver, "OPERATIONS", {**OPERATIONS, **planted})
    runs = run_recorded("2bw", 2, 2, mode_plan(2, mode), monkeypatch)
    assert any(log != planned("2bw", 2, 2, stage, plan) for stage, (log, plan) in enumerate(runs))


@pytest.mark.parametrize(
    "plan",
    [
        UpdatePlan(3, clip=True, deferred=False),
        NormPostedWhereNeeded(3, clip=True, ties=((1, 2),)),
        UpdatePlan(3, replicas=2, clip=True, shard=True, deferred=False),
    ],
)
def test_a_reordered_plan_runs_as_planned_and_the_model_finds_its_deadlock(plan, monkeypatch):
    """The runtime executes whatever plan it holds (here one whose order deadlocks 2BW on NCCL: a synchronous
    update, or a norm posted where the version is needed), and the deadlock model, reading the same plan, fails
    it; the plan the runtime builds for the same settings passes."""
    settings = UpdatePlan(3, replicas=plan.replicas, clip=plan.clip, ties=plan.ties, shard=plan.shard)
    for stage, (log, executed) in enumerate(run_recorded("2bw", 3, 3, settings, monkeypatch, plan=plan)):
        assert executed is plan and log == planned("2bw", 3, 3, stage, plan), f"stage {stage}"
    with pytest.raises(AssertionError, match="transfers deadlock"):
        check_transfers(programs("2bw", 3, 3, collectives=plan), rendezvous=True)
    built = run_recorded("2bw", 3, 3, settings, monkeypatch)[0][1]
    assert built == settings and built.entries(1) != plan.entries(1)
    check_transfers(programs("2bw", 3, 3, collectives=built), rendezvous=True)
