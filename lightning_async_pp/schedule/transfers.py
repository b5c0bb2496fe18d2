"""Transfer ordering under NCCL's point-to-point semantics.

:func:`posting_plan` says when :class:`~lightning_async_pp.runtime.stage.StageRuntime` posts the
receives of one segment of actions (the sends are posted at their action), :func:`host_program` spells
out what one stage's host then does, segment after segment, and :func:`check_transfers` runs the
stages' programs against each other under a model of NCCL's queues to show they cannot deadlock.

Besides its transfers, a stage's ``UPDATE`` may post collectives (:class:`Collectives`): the all-reduce of
the gradient over the stage's replicas, the tied gradients' and the clipping norm's all-reduces, which stay
pending across segments until the weight version they produce is first needed. With the optimizer state
sharded over the replicas (``Collectives.shard``), the all-reduce over the replicas becomes a reduce-scatter
and an all-gather, the latter posted at the stage's next backward (or where the version is needed). The
model checks those too, each on its own communicator (its own queue), or with every operation of a stage on
one queue, as ``CUDA_DEVICE_MAX_CONNECTIONS=1`` serialises a device's streams (``one_queue``).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from lightning_async_pp.schedule.ir import Action, Op

__all__ = ["FLUSH", "Collectives", "PostingPlan", "check_transfers", "host_program", "posting_plan"]

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
# What an UPDATE left for later: (version produced, where its early items go: the next backward (None) or the
# forward of a (step, micro-batch), those items, the items where the version is needed).
_Pending = tuple[int, tuple[int, int] | None, list[tuple], list[tuple]]

FLUSH = "flush"
"""An item of :func:`host_program`'s segments: the stage waits for every pending collective, as
:meth:`StageRuntime.drain <lightning_async_pp.runtime.stage.StageRuntime.drain>` does after its actions."""


@dataclass(frozen=True)
class Collectives:
    """The collectives a stage's ``UPDATE`` posts besides its transfers (``runtime.updates.UpdateDriver``).

    In the model, stage ``s`` of replica ``r`` is rank ``r * num_stages + s``. An all-reduce posted at an
    ``UPDATE`` and left pending is waited for when the version the update produces is first needed (a forward
    on it) or the pipeline drains (:data:`FLUSH`).

    With ``shard``, the replicas' all-reduce is a reduce-scatter (``RS``) and an all-gather (``AG``) on the same
    communicator of the stage's replicas ("data"), which also carries, in posting order, the tied gradients'
    average and the per-tensor norms. ``UPDATE(t)`` first completes every pending update of a version ``<= t``
    (the flat buffers are reused; by then that update has been stepped, so this waits for its ``AG``). Without
    clipping or ties it then posts ``RS(t)``; the stage's next backward waits for it and posts ``AG(t)``
    (:meth:`at_backward`), which is waited for where version ``t + 1`` is first needed (after waiting for
    ``RS(t)`` and posting ``AG(t)`` there if no backward came first). With clipping or ties, ``UPDATE(t)`` posts
    ``RS(t)``, posts and waits for the tied gradients' average, waits for ``RS(t)``, posts and waits for the
    per-tensor norms (clipping), then posts the ties' and the norm's all-reduces as without sharding; the
    forward of micro-batch ``P - 1`` of step ``t + 1`` waits for those, steps and posts ``AG(t)``
    (:meth:`at_settle`), which is waited for where the version is needed (1F1B: all of it there). With a
    ``before_update`` hook alone, ``UPDATE(t)`` posts ``RS(t)`` and waits for it at once (the hook needs the
    gradient); the next backward posts ``AG(t)``.

    Args:
        num_stages: Stages per pipeline.
        replicas: Data-parallel replicas. With more than one, each update all-reduces the gradient over the
            stage's replicas. Alone, that all-reduce stays pending (until its version is needed, or the next
            ``UPDATE``, which reuses its buffers); with clipping or ties the stage's compute waits for it at once.
        clip: Gradient clipping: each update posts one all-reduce of scalars over its pipeline's stages (the
            squared norms). A stage that is the lowest holder of a tie adds the squared norm of the tie's
            summed gradient, so it waits for the tie's sum first: stage 0 where the version is needed (it
            posts the norm there), a later stage at once.
        ties: Per tied parameter, the stages holding a copy. A holder's update posts one all-reduce per tie over
            its replica's holders (a communicator per tie), pending.
        deferred: ``False``: wait for those all-reduces right after posting them (a synchronous clipping;
            with ``shard``, stepping and all-gathering at ``UPDATE``), to test the model.
        shard: The optimizer state is sharded over the replicas (``UpdateDriver(shard=True)``; only with
            ``replicas > 1``).
        hook: A ``before_update`` hook, which needs the replicas' average at ``UPDATE``.
    """

    num_stages: int
    replicas: int = 1
    clip: bool = False
    ties: tuple[tuple[int, ...], ...] = ()
    deferred: bool = True
    shard: bool = False
    hook: bool = False

    @property
    def average_pending(self) -> bool:
        """Whether the replicas' all-reduce (or reduce-scatter) stays pending after ``UPDATE`` (and is waited at
        the next at the latest)."""
        return self.completes_at_update and not self.hook

    @property
    def completes_at_update(self) -> bool:
        """Whether ``UPDATE`` first completes the pending updates of versions up to its step (which reuse the
        replicas' buffers; with a hook alone, without sharding, nothing is pending there)."""
        return self.replicas > 1 and (self.sharded or (not self.clip and not self.ties))

    @property
    def in_flight(self) -> bool:
        """Whether the sharded update needs the stage's replicas alone (no clipping, no ties): it is stepped at
        the stage's next backward (:meth:`at_backward`), otherwise where it settles (:meth:`at_settle`)."""
        return self.sharded and not self.clip and not self.ties

    @property
    def sharded(self) -> bool:
        """Whether the optimizer state is split over several replicas."""
        return self.shard and self.replicas > 1

    def _data(self, stage: int, name: str, step: int) -> tuple:
        """An operation on the communicator of ``stage``'s replicas."""
        return ("C", ("data", tuple(r * self.num_stages + stage for r in range(self.replicas))), (name, step, 0))

    def at_update(self, stage: int, step: int, replica: int) -> tuple[list[tuple], list[tuple]]:
        """What ``UPDATE(step)`` of ``stage`` does: the items of :func:`host_program` at the update, and those
        left for where the version it produces is first needed (``("post", op)`` or ``("wait", op)`` each)."""
        now, settle, later = self._plan(stage, step, replica)
        if not self.deferred:
            return now + self.at_backward(stage, step, replica, deferred=True) + settle + later, []
        return now, later

    def at_settle(self, stage: int, step: int, replica: int) -> list[tuple]:
        """What the forward of micro-batch ``num_stages - 1`` of step ``step + 1`` does for ``UPDATE(step)``
        (``UpdateDriver.settle``, :func:`~lightning_async_pp.schedule.updates_settled_by`): with sharded state
        and clipping or ties, wait for the tied sums and the norm, step, and post the all-gather. Where the
        version is needed first (1F1B), these items come first there."""
        return self._plan(stage, step, replica)[1] if self.deferred else []

    def _plan(self, stage: int, step: int, replica: int) -> tuple[list[tuple], list[tuple], list[tuple]]:
        base = replica * self.num_stages
        now: list[tuple] = []
        later: list[tuple] = []
        owned = [index for index, holders in enumerate(self.ties) if stage in holders]
        if self.sharded:
            scatter, gather = self._data(stage, "reduce-scatter", step), self._data(stage, "all-gather", step)
            now.append(("post", scatter))
            if self.in_flight:
                # Waited for at the next backward (`at_backward`, at once with a hook), which posts the all-gather.
                now += [("wait", scatter)] if self.hook else []
                later.append(("wait", gather))
            else:
                if owned:
                    tied = self._data(stage, "tied average", step)
                    now += [("post", tied), ("wait", tied)]
                now.append(("wait", scatter))
                if self.clip:
                    norms = self._data(stage, "norms", step)
                    now += [("post", norms), ("wait", norms)]
        elif self.replicas > 1:
            data = self._data(stage, "data", step)
            now.append(("post", data))
            (later if self.average_pending else now).append(("wait", data))
        tie = {i: ("C", (f"tie {i}", tuple(base + s for s in self.ties[i])), ("tie", step, i)) for i in owned}
        now += [("post", tie[i]) for i in owned]
        if not self.clip:
            later += [("wait", tie[i]) for i in owned]
        elif self.num_stages > 1:
            norm = ("C", ("norm", tuple(base + s for s in range(self.num_stages))), ("norm", step, 0))
            lowest = [i for i in owned if min(self.ties[i]) == stage]
            chain = [("wait", tie[i]) for i in lowest] + [("post", norm)]
            (later if lowest and stage == 0 else now).extend(chain)
            later += [("wait", tie[i]) for i in owned if i not in lowest] + [("wait", norm)]
        if self.sharded and not self.in_flight:
            # The owner steps once the sums and the norm are in (where the update settles); the all-gather
            # overlaps the rest of the step.
            return now, later + [("post", gather)], [("wait", gather)]
        return now, [], later

    def at_backward(self, stage: int, step: int, replica: int, deferred: bool | None = None) -> list[tuple]:
        """What the stage's first backward after ``UPDATE(step)`` does for it (``UpdateDriver.advance``): with
        sharded state in flight, wait for the reduce-scatter, step, and post the all-gather. Where the version is
        needed before any backward came, these items come first there."""
        if not self.in_flight or not (self.deferred if deferred is None else deferred):
            return []
        wait = [] if self.hook else [("wait", self._data(stage, "reduce-scatter", step))]
        return [*wait, ("post", self._data(stage, "all-gather", step))]


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
    collectives: Collectives | None = None,
    replica: int = 0,
) -> list[tuple]:
    """What one stage's host does with transfers, segment after segment, under :func:`posting_plan`.

    Items are ``("post", ops)`` (one :func:`torch.distributed.batch_isend_irecv` call, or one collective) and
    ``("wait", op)`` (waiting for a receive or a collective before the compute that needs it). What an
    ``UPDATE`` leaves pending is done where its version is first needed (a forward on it; the next ``UPDATE``
    when :attr:`Collectives.completes_at_update`) or at :data:`FLUSH`; what :meth:`Collectives.at_backward`
    gives at the stage's next backward and what :meth:`Collectives.at_settle` gives at the forward of
    micro-batch ``P - 1`` of the next step, if those come first. A wait on NCCL
    does not block the host but orders the compute stream behind the operation, and every later send or
    receive is ordered behind that compute, so blocking the host at the wait models the same dependencies.

    Args:
        segments: the segments of one stage, in the order it executes them; :data:`FLUSH` where it drains.
        eager: use the eager plan (see :func:`posting_plan`).
        collectives: what each ``UPDATE`` posts besides transfers (``None``: nothing).
        replica: the stage's replica (its rank in the model is ``replica * num_stages + stage``).
    """
    offset = replica * collectives.num_stages if collectives is not None else 0
    items: list[tuple] = []
    pending: list[_Pending] = []
    for actions in segments:
        if isinstance(actions, str):
            assert actions == FLUSH, actions
            items += _release(pending, None)
            continue
        plan = posting_plan(actions, eager)
        queued = {op: [a for a in actions if a.op is op] for op in _RECEIVES}
        posted: dict[Op, _TransferOp] = {}

        def next_receive(op: Op) -> list[_TransferOp]:
            if op in posted or not queued[op]:
                return []
            posted[op] = _transfer_op(queued[op].pop(0), offset=offset)
            return [posted[op]]

        for op in sorted(plan.start):
            items.append(("post", tuple(next_receive(op))))
        for k, a in enumerate(actions):
            items += _collectives_at(a, pending, collectives, replica)
            if not a.is_comm:
                continue
            receive_op = Op.RECV_F if a.op in _PREV_LINK else Op.RECV_B
            if a.op in _RECEIVES:
                if a.op not in posted:
                    items.append(("post", tuple(next_receive(a.op))))
                expected = _transfer_op(a, offset=offset)
                if posted.pop(a.op) != expected:
                    raise AssertionError(f"stage {a.stage}: receives posted out of order at {a}")
                items.append(("wait", expected))
                if plan.post_next[k] and (more := next_receive(receive_op)):
                    items.append(("post", tuple(more)))
            else:
                batch = [_transfer_op(a, offset=offset)]
                if plan.post_next[k]:
                    batch += next_receive(receive_op)
                items.append(("post", tuple(batch)))
        if posted:
            raise AssertionError(f"receives {sorted(posted.values())} stay posted after the segment")
    return items + _release(pending, None)


def _collectives_at(
    a: Action,
    pending: list[_Pending],
    collectives: Collectives | None,
    replica: int,
) -> list[tuple]:
    """What action ``a`` does with the collectives of the updates: release what waited for it, and for an
    ``UPDATE`` post its own (leaving the rest in ``pending``)."""
    items = _early(pending, (a.step, a.microbatch)) if a.op is Op.FORWARD else []
    needed = None
    if a.op is Op.UPDATE and collectives is not None and collectives.completes_at_update:
        needed = a.version - 1
    elif a.op is Op.FORWARD:
        needed = a.version
    if needed is not None:
        items += _release(pending, needed)
    if a.op is Op.UPDATE and collectives is not None:
        now, later = collectives.at_update(a.stage, a.step, replica)
        advance = collectives.at_backward(a.stage, a.step, replica)
        settle = collectives.at_settle(a.stage, a.step, replica)
        at = (a.step + 1, collectives.num_stages - 1) if settle else None
        items += _items(now)
        pending.append((a.version, at, _items(advance or settle), _items(later)))
    if a.op is Op.BACKWARD:
        items += _early(pending, None)
    return items


def _items(pairs: Iterable[tuple[str, _TransferOp]]) -> list[tuple]:
    """:meth:`Collectives.at_update`'s pairs as :func:`host_program`'s items (a post is a batch of one)."""
    return [(kind, (op,) if kind == "post" else op) for kind, op in pairs]


def _early(pending: list[_Pending], at: tuple[int, int] | None) -> list[tuple]:
    """The early items of the pending updates that go at ``at`` (a forward's (step, micro-batch); ``None``: a
    backward), taken out of ``pending``."""
    items = []
    for _, where, early, _ in pending:
        if where == at:
            items += early
            early.clear()
    return items


def _release(pending: list[_Pending], needed: int | None) -> list[tuple]:
    """Remove the pending updates producing a version ``<= needed`` (all if ``None``) and return their items,
    update after update, what the next backward would have done first."""
    done = [entry for entry in pending if needed is None or entry[0] <= needed]
    del pending[: len(done)]  # in order of the versions they produce
    return [item for _, _, early, later in done for item in early + later]


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
