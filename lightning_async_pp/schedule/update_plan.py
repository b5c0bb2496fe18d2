"""One plan of an optimizer update: which collectives it posts at which point, and where it waits for each.

``UPDATE(t)`` turns step ``t``'s gradient into weight version ``t + 1``. What it needs from other processes
(the average over data-parallel replicas, the sums of tied gradients, the clipping norm) it posts as
non-blocking collectives, and it waits for each as late as it may without letting another process wait for it.
An :class:`UpdatePlan` spells that out once, as entries at four points of the stage's actions:

- ``"update"``: at ``UPDATE(t)`` itself;
- ``"backward"``: at the stage's first backward after ``UPDATE(t)``;
- ``"settle"``: at the forward of micro-batch ``P - 1`` of step ``t + 1``, which every stage runs after every
  stage's ``UPDATE(t)`` (:func:`~lightning_async_pp.schedule.updates_settled_by`);
- ``"needed"``: where version ``t + 1`` is first needed (a forward on it, the next ``UPDATE`` when
  :attr:`UpdatePlan.completes_at_update`, or the drain). The entries of an earlier point that has not come yet
  run first there, point after point.

An entry (:class:`PlanEntry`) posts a collective, waits for one, or runs a local part of the update (the
``before_update`` hook, the local norm, the optimizer step). An update whose entries all sit at ``"update"`` is
applied at once; otherwise it is published once its ``"needed"`` entries have run.

Two readers execute the same entries: :class:`~lightning_async_pp.runtime.updates.UpdateDriver` dispatches each
to the runtime's operation for it, and :func:`~lightning_async_pp.schedule.transfers.host_program` turns each
collective into an operation of the model that :func:`~lightning_async_pp.schedule.transfers.check_transfers`
proves free of deadlock. A new update mode is a change of :meth:`UpdatePlan.entries` (and, for a new kind of
entry, an operation of the runtime and a communicator of the model).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["COLLECTIVES", "LOCAL_WORK", "POINTS", "PlanEntry", "UpdatePlan"]

POINTS = ("update", "backward", "settle", "needed")
"""Where an update's entries run, in the order they come (see the module docstring)."""

COLLECTIVES = {
    "average": "the gradient's all-reduce over the stage's replicas (in buckets), divided by their number",
    "reduce-scatter": "sharded state: the gradient averaged over the replicas, each tensor to its owner",
    "all-gather": "sharded state: the owners' new weights to every replica",
    "tied average": "sharded state: the tied gradients' all-reduce over the replicas (every replica sums ties)",
    "norms": "sharded state and clipping: the per-tensor norms over the replicas, each from its owner",
    "tie": "one tie's gradient summed over the stages holding it (``index``: the tie)",
    "norm": "clipping: the squared norms over the pipeline's stages (and of the ties' sums, each once)",
}
"""What each collective an entry names posts; all but ``tie`` and ``norm`` run over the stage's replicas."""

LOCAL_WORK = {
    "hook": "the ``before_update`` hook, on the complete (averaged) gradient",
    "local norm": "clipping: this stage's squared norm of its untied gradients (its owned tensors' norms)",
    "step": "the optimizer step on the (clipped) gradient into version ``t + 1``'s buffer",
}
"""What each local entry runs."""


class PlanEntry(NamedTuple):
    """One entry of an update's plan.

    Args:
        action: ``"post"`` or ``"wait"`` (a collective of :data:`COLLECTIVES`), or ``"run"`` (:data:`LOCAL_WORK`).
        name: The collective or the local work.
        index: The tie, for ``"tie"``; 0 otherwise.
    """

    action: str
    name: str
    index: int = 0

    def __str__(self) -> str:
        return f"{self.action} {self.name}" + (f" {self.index}" if self.name == "tie" else "")


def _post(name: str, index: int = 0) -> PlanEntry:
    return PlanEntry("post", name, index)


def _wait(name: str, index: int = 0) -> PlanEntry:
    return PlanEntry("wait", name, index)


def _run(name: str) -> PlanEntry:
    return PlanEntry("run", name)


@dataclass(frozen=True)
class UpdatePlan:
    """What each stage's ``UPDATE`` posts and waits for, from the update's settings.

    The order, per mode (``U``/``B``/``S``/``N``: the points ``"update"``, ``"backward"``, ``"settle"``,
    ``"needed"``):

    - nothing to exchange: ``U`` runs the hook and steps (applied at once);
    - replicas alone: ``U`` posts the average, ``N`` waits for it and steps; the next ``UPDATE`` completes the
      update first (it reuses the buckets). With a hook, ``U`` waits for the average at once.
    - clipping, ties (with or without replicas, whose average ``U`` then waits for at once): ``U`` computes the
      local norm, posts each held tie's sum and the norm; ``N`` waits for them and steps. A stage that is the
      lowest holder of a tie adds the squared norm of the tie's sum to the norm, so it waits for that sum before
      posting the norm: stage 0 at ``N`` (it is the first to need the version, at a forward that waits for no
      other stage), a later stage at ``U`` (every other holder has posted the sum at its own update).
    - sharded state alone: ``U`` posts the reduce-scatter (and with a hook waits for it and runs the hook); ``B``
      waits for it, steps and posts the all-gather; ``N`` waits for the all-gather.
    - sharded state with clipping or ties: ``U`` posts the reduce-scatter, averages the held ties over the
      replicas, waits for the reduce-scatter, runs the hook, exchanges the owned tensors' norms over the
      replicas and posts the ties' sums and the norm as without sharding; ``S`` waits for those, steps and posts
      the all-gather, which overlaps the rest of step ``t + 1``; ``N`` waits for the all-gather.

    Args:
        num_stages: Stages per pipeline.
        replicas: Data-parallel replicas of each stage.
        clip: Gradient clipping by the global norm.
        ties: Per trained tied parameter, the stages holding a copy.
        shard: The optimizer state is sharded over the replicas (only with ``replicas > 1``).
        hook: A ``before_update`` hook, which needs the complete gradient at ``UPDATE``.
        deferred: ``False``: every entry at ``"update"`` (a synchronous update, to show with the deadlock model
            why the runtime defers).
    """

    num_stages: int
    replicas: int = 1
    clip: bool = False
    ties: tuple[tuple[int, ...], ...] = ()
    shard: bool = False
    hook: bool = False
    deferred: bool = True

    @property
    def sharded(self) -> bool:
        """Whether the optimizer state is split over several replicas."""
        return self.shard and self.replicas > 1

    @property
    def completes_at_update(self) -> bool:
        """Whether ``UPDATE(t)`` first completes the pending updates of versions up to ``t``: they hold the
        replicas' buffers, which it reuses."""
        return self.replicas > 1 and (self.sharded or (not self.clip and not self.ties))

    def entries(self, stage: int) -> dict[str, tuple[PlanEntry, ...]]:
        """The entries of ``stage``'s update at each of :data:`POINTS`, in the order they run."""
        at: dict[str, list[PlanEntry]] = {point: [] for point in POINTS}
        alone = not self.clip and not self.ties  # nothing exchanged over the pipeline
        if self.sharded and alone:
            at["update"].append(_post("reduce-scatter"))
            if self.hook:
                at["update"] += [_wait("reduce-scatter"), _run("hook")]
            else:
                at["backward"].append(_wait("reduce-scatter"))
            at["backward"] += [_run("step"), _post("all-gather")]
            at["needed"].append(_wait("all-gather"))
        elif self.replicas > 1 and not self.sharded and alone and not self.hook:
            at["update"].append(_post("average"))
            at["needed"] += [_wait("average"), _run("step")]
        else:
            self._exchange(stage, at)
        if not self.deferred:
            return {point: tuple(e for p in POINTS for e in at[p]) if point == "update" else () for point in POINTS}
        return {point: tuple(entries) for point, entries in at.items()}

    def _exchange(self, stage: int, at: dict[str, list[PlanEntry]]) -> None:
        """The update that needs the complete gradient at ``UPDATE``: a hook, clipping, ties."""
        now = at["update"]
        held = [index for index, holders in enumerate(self.ties) if stage in holders]
        if self.sharded:
            now.append(_post("reduce-scatter"))
            if held:
                now += [_post("tied average"), _wait("tied average")]
            now.append(_wait("reduce-scatter"))
        elif self.replicas > 1:
            now += [_post("average"), _wait("average")]
        if self.hook:
            now.append(_run("hook"))
        if not (self.clip or self.ties or self.sharded):
            now.append(_run("step"))
            return
        later = at["settle"] if self.sharded else at["needed"]
        if self.clip:
            now.append(_run("local norm"))
            if self.sharded:
                now += [_post("norms"), _wait("norms")]
        now += [_post("tie", index) for index in held]
        if not self.clip:
            later += [_wait("tie", index) for index in held]
        elif self.num_stages > 1:
            lowest = [index for index in held if min(self.ties[index]) == stage]
            chain = [*(_wait("tie", index) for index in lowest), _post("norm")]
            (later if lowest and stage == 0 else now).extend(chain)
            later += [_wait("tie", index) for index in held if index not in lowest] + [_wait("norm")]
        later.append(_run("step"))
        if self.sharded:
            later.append(_post("all-gather"))
            at["needed"].append(_wait("all-gather"))
