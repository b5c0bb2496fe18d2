"""Transfer ordering under NCCL's point-to-point semantics.

:func:`posting_plan` says when :class:`~lightning_async_pp.runtime.stage.StageRuntime` posts the
receives of one segment of actions (the sends are posted at their action), :func:`host_program` spells
out what one stage's host then does, segment after segment, and :func:`check_transfers` runs the
stages' programs against each other under a model of NCCL's queues to show they cannot deadlock.

Besides its transfers, a stage's ``UPDATE`` may post collectives: the all-reduce of the gradient over the
stage's replicas (or, with the optimizer state sharded, a reduce-scatter and an all-gather), the tied
gradients' and the clipping norm's all-reduces, which stay pending across segments until the weight version
they produce is first needed. Where each is posted and waited for is the update's plan
(:class:`~lightning_async_pp.schedule.update_plan.UpdatePlan`), the one the runtime executes;
:func:`host_program` reads it. The model checks those collectives too, each on its own
communicator (its own queue), or with every operation of a stage on one queue, as
``CUDA_DEVICE_MAX_CONNECTIONS=1`` serialises a device's streams (``one_queue``).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from lightning_async_pp.schedule.ir import Action, Op
from lightning_async_pp.schedule.update_plan import POINTS, PlanEntry, UpdatePlan

__all__ = ["FLUSH", "PostingPlan", "check_transfers", "host_program", "posting_plan"]

_PREV_LINK = (Op.RECV_F, Op.SEND_B)  # operations on the link with stage - 1
_NEXT_LINK = (Op.SEND_F, Op.RECV_B)  # operations on the link with stage + 1
_RECEIVES = (Op.RECV_F, Op.RECV_B)


@dataclass(frozen=True)
class PostingPlan:
    """When a stage posts the receives of one segment of actions (sends are posted at their action).

    Args:
        start: receive ops (``RECV_F`` for the link with the previous stage, ``RECV_B`` for the next one)
            whose link's first receive is posted when the segment starts.
        post_next: per action: post the next receive of the action's link with it, batched with the send
            (a ``SEND_*``) or right after the receive completed (a ``RECV_*``).
    """

    start: frozenset[Op]
    post_next: tuple[bool, ...]


def posting_plan(actions: Sequence[Action], eager: bool = False) -> PostingPlan:
    """How :class:`~lightning_async_pp.runtime.stage.StageRuntime` posts the transfers of ``actions``.

    Each receive is posted as early as possible without overtaking an earlier operation of its link: at
    the segment start when it is its link's first operation, batched with the send right before it on
    its link, or right after the receive right before it on its link completed. Per link, operations are
    therefore posted in the schedule's order, and the transfer overlaps the compute in between.

    Args:
        actions: one segment of one stage (:func:`step_actions`, :func:`drain_actions` or an evaluation).
        eager: the plan before transfers were batched: each link's first receive posted at the segment
            start and each next one as soon as the previous one completed, ahead of sends. On NCCL it
            deadlocks (:func:`check_transfers` shows it); kept to test the model.
    """
    post_next = [False] * len(actions)
    start: set[Op] = set()
    for link in (_PREV_LINK, _NEXT_LINK):
        positions = [k for k, a in enumerate(actions) if a.op in link]
        receives = [k for k in positions if actions[k].op in _RECEIVES]
        if not receives:
            continue
        start.add(actions[receives[0]].op)
        if eager:
            for k in receives[:-1]:
                post_next[k] = True
            continue
        if receives[0] != positions[0]:
            start.discard(actions[receives[0]].op)
        for before, k in zip(positions, positions[1:]):
            if actions[k].op in _RECEIVES:
                post_next[before] = True
    return PostingPlan(frozenset(start), tuple(post_next))


# An operation in the model: (role, group, message). A transfer: role "S"/"R", group its link (lower rank,
# upper rank), message (direction "F"/"B", step, micro-batch). A collective: role "C", group (communicator
# name, its ranks), message (name, step, index); every participant posts the same tuple.
_TransferOp = tuple[str, tuple, tuple[str, int, int]]

FLUSH = "flush"
"""An item of :func:`host_program`'s segments: the stage waits for every pending collective, as
:meth:`StageRuntime.drain <lightning_async_pp.runtime.stage.StageRuntime.drain>` does after its actions."""


@dataclass
class _Pending:
    """What an ``UPDATE`` left for later: the version it produces, the forward (step, micro-batch) where it
    settles, and the model's items at each later point of its plan."""

    version: int
    settles_at: tuple[int, int]
    items: dict[str, list[tuple]]


def _collective(plan: UpdatePlan, stage: int, replica: int, step: int, entry: PlanEntry) -> _TransferOp:
    """The model's operation for a collective of ``plan``: stage ``s`` of replica ``r`` is rank
    ``r * num_stages + s``; a tie and the norm have a communicator each over the replica's stages, every other
    collective runs on the communicator of the stage's replicas ("data"), in posting order."""
    base = replica * plan.num_stages
    if entry.name == "tie":
        holders = tuple(base + s for s in plan.ties[entry.index])
        return ("C", (f"tie {entry.index}", holders), ("tie", step, entry.index))
    if entry.name == "norm":
        return ("C", ("norm", tuple(base + s for s in range(plan.num_stages))), ("norm", step, 0))
    return ("C", ("data", tuple(r * plan.num_stages + stage for r in range(plan.replicas))), (entry.name, step, 0))


def _plan_items(plan: UpdatePlan, stage: int, replica: int, step: int, entries: Iterable[PlanEntry]) -> list[tuple]:
    """The model's items for ``entries`` of ``UPDATE(step)`` (a post is a batch of one; local work is left out:
    it orders nothing the model sees)."""
    items: list[tuple] = []
    for entry in entries:
        if entry.action != "run":
            op = _collective(plan, stage, replica, step, entry)
            items.append(("post", (op,)) if entry.action == "post" else ("wait", op))
    return items


def _transfer_op(a: Action, role: str | None = None, offset: int = 0) -> _TransferOp:
    peer = a.peer
    assert peer is not None
    forward = a.op in (Op.SEND_F, Op.RECV_F)
    if role is None:
        role = "S" if a.op in (Op.SEND_F, Op.SEND_B) else "R"
    link = (min(a.stage, peer) + offset, max(a.stage, peer) + offset)
    return (role, link, ("F" if forward else "B", a.step, a.microbatch))


def host_program(
    segments: Iterable[Sequence[Action] | str],
    eager: bool = False,
    updates: UpdatePlan | None = None,
    replica: int = 0,
) -> list[tuple]:
    """What one stage's host does with transfers, segment after segment, under :func:`posting_plan`.

    Items are ``("post", ops)`` (one :func:`torch.distributed.batch_isend_irecv` call, or one collective) and
    ``("wait", op)`` (waiting for a receive or a collective before the compute that needs it). An ``UPDATE``
    runs its plan's entries (:class:`~lightning_async_pp.schedule.update_plan.UpdatePlan`) as the runtime does:
    its ``"update"`` entries there, its ``"backward"`` ones at the stage's next backward, its ``"settle"`` ones
    at the forward of micro-batch ``P - 1`` of the next step, and what is left where its version is first needed
    (a forward on it; the next ``UPDATE`` when :attr:`UpdatePlan.completes_at_update`) or at :data:`FLUSH`,
    earlier points first. A wait on NCCL
    does not block the host but orders the compute stream behind the operation, and every later send or
    receive is ordered behind that compute, so blocking the host at the wait models the same dependencies.

    Args:
        segments: the segments of one stage, in the order it executes them; :data:`FLUSH` where it drains.
        eager: use the eager plan (see :func:`posting_plan`).
        updates: the plan of each ``UPDATE``'s collectives (``None``: none).
        replica: the stage's replica (its rank in the model is ``replica * num_stages + stage``).
    """
    offset = replica * updates.num_stages if updates is not None else 0
    items: list[tuple] = []
    pending: list[_Pending] = []
    for actions in segments:
        if isinstance(actions, str):
            assert actions == FLUSH, actions
            items += _release(pending, None)
            continue
        plan = posting_plan(actions, eager)
        receives = _SegmentReceives(actions, offset)
        for op in sorted(plan.start):
            items.append(("post", tuple(receives.post(op))))
        for k, a in enumerate(actions):
            items += _collectives_at(a, pending, updates, replica)
            if not a.is_comm:
                continue
            receive_op = Op.RECV_F if a.op in _PREV_LINK else Op.RECV_B
            if a.op in _RECEIVES:
                items += receives.wait(a)
                if plan.post_next[k] and (more := receives.post(receive_op)):
                    items.append(("post", tuple(more)))
            else:
                batch = [_transfer_op(a, offset=offset)]
                if plan.post_next[k]:
                    batch += receives.post(receive_op)
                items.append(("post", tuple(batch)))
        receives.check_none_left()
    return items + _release(pending, None)


class _SegmentReceives:
    """The receives of one segment: queued in action order, at most one posted per direction at a time."""

    def __init__(self, actions: Sequence[Action], offset: int) -> None:
        self.offset = offset
        self.queued = {op: [a for a in actions if a.op is op] for op in _RECEIVES}
        self.posted: dict[Op, _TransferOp] = {}

    def post(self, op: Op) -> list[_TransferOp]:
        """The next receive of ``op`` to post (none while one is posted, or when none is left)."""
        if op in self.posted or not self.queued[op]:
            return []
        self.posted[op] = _transfer_op(self.queued[op].pop(0), offset=self.offset)
        return [self.posted[op]]

    def wait(self, a: Action) -> list[tuple]:
        """The items of receive action ``a``: its post if it was not posted yet, then its wait."""
        items = [] if a.op in self.posted else [("post", tuple(self.post(a.op)))]
        expected = _transfer_op(a, offset=self.offset)
        if self.posted.pop(a.op) != expected:
            raise AssertionError(f"stage {a.stage}: receives posted out of order at {a}")
        return [*items, ("wait", expected)]

    def check_none_left(self) -> None:
        if self.posted:
            raise AssertionError(f"receives {sorted(self.posted.values())} stay posted after the segment")


def _collectives_at(a: Action, pending: list[_Pending], plan: UpdatePlan | None, replica: int) -> list[tuple]:
    """What action ``a`` does with the collectives of the updates: release what waited for it, and for an
    ``UPDATE`` run its plan's ``"update"`` entries (leaving the rest in ``pending``)."""
    items = _early(pending, "settle", (a.step, a.microbatch)) if a.op is Op.FORWARD else []
    needed = None
    if a.op is Op.UPDATE and plan is not None and plan.completes_at_update:
        needed = a.version - 1
    elif a.op is Op.FORWARD:
        needed = a.version
    if needed is not None:
        items += _release(pending, needed)
    if a.op is Op.UPDATE and plan is not None:
        entries = plan.entries(a.stage)
        items += _plan_items(plan, a.stage, replica, a.step, entries["update"])
        later = {point: _plan_items(plan, a.stage, replica, a.step, entries[point]) for point in POINTS[1:]}
        pending.append(_Pending(a.version, (a.step + 1, plan.num_stages - 1), later))
    if a.op is Op.BACKWARD:
        items += _early(pending, "backward")
    return items


def _early(pending: list[_Pending], point: str, at: tuple[int, int] | None = None) -> list[tuple]:
    """The items of the pending updates at ``point`` (``"backward"``, or ``"settle"`` at the forward ``at``),
    taken out of ``pending``."""
    items = []
    for update in pending:
        if point == "backward" or update.settles_at == at:
            items += update.items[point]
            update.items[point] = []
    return items


def _release(pending: list[_Pending], needed: int | None) -> list[tuple]:
    """Remove the pending updates producing a version ``<= needed`` (all if ``None``) and return their items,
    update after update, what their earlier points would have done first."""
    done = [update for update in pending if needed is None or update.version <= needed]
    del pending[: len(done)]  # in order of the versions they produce
    return [item for update in done for point in POINTS[1:] for item in update.items[point]]


def check_transfers(
    programs: Sequence[Sequence[tuple]], rendezvous: bool = True, per_link: bool = True, one_queue: bool = False
) -> None:
    """Run the stages' :func:`host_program` against each other under NCCL's point-to-point semantics.

    Model: each stage posts batches on a queue per link (``per_link=False``: one queue per stage, as
    when all links share one communicator) and a queue per collective's communicator; a queue starts its
    next batch only once the previous one has completed, and a batch completes when each of its operations
    has. A receive completes once the peer's matching send has started (its batch is at the head of the
    peer's queue); with ``rendezvous`` a send also waits for the matching receive to start (large NCCL
    messages do), otherwise it completes as soon as it starts. A collective completes once every
    participant's has started. A stage's host blocks at a wait until the operation's batch has completed.

    Args:
        programs: one :func:`host_program` per rank, in rank order.
        rendezvous: whether a send waits for its receive to start.
        per_link: one queue per link and stage (separate communicators) rather than one per stage.
        one_queue: every operation of a stage, transfers and collectives, on one queue in posting order:
            with ``CUDA_DEVICE_MAX_CONNECTIONS=1`` a device's streams share one hardware queue, so work
            issued after an operation that waits for a peer waits too.

    Raises:
        AssertionError: naming where each stage is stuck if the programs deadlock, or if anything is left
            posted at the end.
    """
    model = _NcclModel(rendezvous, per_link, one_queue)
    pc = [0] * len(programs)
    progress = True
    while progress:
        progress = False
        for s, program in enumerate(programs):
            start = pc[s]
            pc[s] = model.run_host(s, program, start)
            progress |= pc[s] != start
        progress |= model.complete_batches()
    stuck = [f"stage {s} waits at {programs[s][pc[s]]}" for s in range(len(programs)) if pc[s] < len(programs[s])]
    left = [f"stage {b[1]} has {b[2]} posted" for q in model.queues.values() for b in q]
    if stuck or left:
        raise AssertionError("transfers deadlock: " + "; ".join((stuck + left)[:6]))


@dataclass
class _NcclModel:
    """The state of :func:`check_transfers`: the posted batches per queue and what has completed.

    A batch is ``(id, stage, ops)``; the id tells apart equal batches posted at different points.
    """

    rendezvous: bool
    per_link: bool
    one_queue: bool = False
    queues: dict[tuple, collections.deque] = field(default_factory=lambda: collections.defaultdict(collections.deque))
    where: dict[tuple, tuple] = field(default_factory=dict)  # (stage, op) -> its batch
    done: set[tuple] = field(default_factory=set)  # (stage, op) completed
    finished: set[int] = field(default_factory=set)  # ids of completed batches

    def queue_of(self, stage: int, op: _TransferOp) -> tuple:
        if self.one_queue:
            return (stage,)
        return (stage, op[1]) if self.per_link or op[0] == "C" else (stage,)

    def started(self, stage: int, op: _TransferOp) -> bool:
        batch = self.where.get((stage, op))
        return batch is not None and (self.queues[self.queue_of(stage, op)] or [None])[0] is batch

    def run_host(self, s: int, program: Sequence[tuple], pc: int) -> int:
        """Advance stage ``s``'s host from item ``pc`` until it blocks at a wait; return where it stopped."""
        while pc < len(program):
            kind, arg = program[pc]
            if kind == "post":
                if arg:
                    self.post(s, arg)
            elif id(self.where[(s, arg)]) not in self.finished:
                break
            pc += 1
        return pc

    def post(self, s: int, ops: tuple) -> None:
        batch = (id(ops), s, ops)
        keys = {self.queue_of(s, op) for op in ops}
        if len(keys) != 1:
            raise AssertionError(f"stage {s}: one batch spans several queues: {ops}")
        self.queues[keys.pop()].append(batch)
        for op in ops:
            self.where[(s, op)] = batch

    def complete_batches(self) -> bool:
        """Complete what the peers' posted operations allow, head of each queue first; whether any did."""
        progress = False
        for queue in list(self.queues.values()):
            while queue:
                batch = queue[0]
                s, ops = batch[1], batch[2]
                for op in ops:
                    if (s, op) not in self.done and self.can_complete(s, op):
                        self.done.add((s, op))
                if not all((s, op) in self.done for op in ops):
                    break
                queue.popleft()
                self.finished.add(id(batch))
                progress = True
        return progress

    def can_complete(self, s: int, op: _TransferOp) -> bool:
        """Whether ``op``, started on ``s``, completes: its peers have started (or finished) their side."""
        if op[0] == "C":
            return all(self.started(p, op) or (p, op) in self.done for p in op[1][1] if p != s)
        if op[0] == "S" and not self.rendezvous:
            return True
        peer, match = _peer_of(s, op)
        return self.started(peer, match) or (peer, match) in self.done


def _peer_of(stage: int, op: _TransferOp) -> tuple[int, _TransferOp]:
    """The peer of ``op`` and the operation it posts to match it."""
    low, high = op[1]
    return (high if stage == low else low), ("R" if op[0] == "S" else "S", op[1], op[2])
