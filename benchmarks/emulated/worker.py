"""One rank of a job: every schedule, micro-batch count and repetition of one ``P``, in one process group.

Starting ``P`` processes costs seconds of CPU each (torch, Lightning), so a job starts them once per ``P`` and
runs all of that ``P``'s cells in them, interleaved: repetition ``r`` runs every ``(M, schedule)`` once, the
schedules rotated by ``r``. Each cell starts behind a barrier on every rank, runs ``warmup + steps`` steps
and records on every rank: the end of each step (``time.perf_counter``), the emulated devices' busy time
(the layers' sleeps) and the process's CPU time inside the timed window, and the most micro-batches held
between their forward and their last backward part (weight gradient, where torch splits it).

Ours runs :class:`~lightning_async_pp.runtime.StageRuntime` built as the strategy builds it for training
(``strategy/stage_runtime.py``: ``check_finite=True``, the data-order fingerprints on, no trace) and
``run_step`` called once per step, as ``AsyncPipelineStrategy.training_step`` does; Lightning's loop around
it is not part of this benchmark. torch's schedules run on ``PipelineStage``s of the same layers with
``step(..., return_outputs=False)`` and ``SGD`` stepped after each step.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import grid
from .layers import CLOCK, build_layers, emulated_loss, tighten_timer_slack


class Stash:
    """Micro-batches whose forward ran and whose last backward part has not: now, and the most at once."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0

    def add(self, n: int) -> None:
        self.live += n
        self.peak = max(self.peak, self.live)


class Calls:
    """Seconds spent inside the compute calls, per kind: ``F`` forward, ``B`` backward (full, or input only where
    torch splits it), ``W`` weight gradient, ``U`` optimizer update. Less the layers' sleeps, what remains is the
    host work a runtime does around the emulated device's."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys("FBWU", 0.0)

    def add(self, kind: str, seconds: float) -> None:
        self.seconds[kind] += seconds

    def timed(self, kind: str, fn: Callable) -> Callable:
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[kind] += time.perf_counter() - start

        return call


class Runner:
    """One schedule at one ``M`` on this rank: ``step()`` runs a training step, ``finish()`` ends a run."""

    def __init__(self, step: Callable[[], None], finish: Callable[[], None], stash: Stash, calls: Calls) -> None:
        self.step, self.finish, self.stash, self.calls = step, finish, stash, calls


def _batch(num_microbatches: int, rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(num_microbatches * rows, width, generator=torch.Generator().manual_seed(0))
    return x, torch.full_like(x, 1e-3)


def _rank_layers(name: str, stage: int, rank_count: int, spec: dict[str, Any]) -> list[nn.Module]:
    costs = grid.Costs(**spec["costs"])
    layer_costs = costs.layers(rank_count, spec["layers_per_stage"])
    held = grid.stage_layers(name, stage, rank_count, spec["layers_per_stage"])
    return build_layers(spec["width"], [layer_costs[i] for i in held])


def ours_runner(name: str, rank: int, P: int, M: int, spec: dict[str, Any], groups: dict[str, Any]) -> Runner:
    """Our runtime for this rank's stage, as the strategy builds it for training."""
    from lightning_async_pp.runtime import StageRuntime
    from lightning_async_pp.schedule import Op

    layers = _rank_layers(name, rank, P, spec)
    optimizer = torch.optim.SGD([p for layer in layers for p in layer.parameters()], lr=1e-3)
    runtime = StageRuntime(
        kind=name.removeprefix("ours_"),
        stage=rank,
        num_stages=P,
        num_microbatches=M,
        layers=layers,
        optimizer=optimizer,
        inputs_fn=lambda mb: mb[0],
        loss_fn=lambda out, mb: emulated_loss(out, mb[1]),
        device=torch.device("cpu"),
        prev_rank=rank - 1 if rank > 0 else None,
        next_rank=rank + 1 if rank < P - 1 else None,
        p2p_group=groups["ours_p2p"],
        norm_group=groups["ours_norm"],
        order_group=groups["ours_order"],
        check_finite=True,
    )
    stash, calls = Stash(), Calls()
    delta = {Op.FORWARD: 1, Op.BACKWARD: -1}
    kinds = {Op.FORWARD: "F", Op.BACKWARD: "B", Op.UPDATE: "U"}

    def observe(action, begin: float, end: float) -> None:
        stash.add(delta.get(action.op, 0))
        if action.op in kinds:
            calls.add(kinds[action.op], end - begin)

    runtime.add_observer(observe)
    batch = _batch(M, spec["rows"], spec["width"])
    counter = iter(range(1 << 62))
    return Runner(lambda: runtime.run_step(next(counter), batch), runtime.drain, stash, calls)


def _counted(stage: Any, stash: Stash, calls: Calls) -> None:
    """Count on ``stash`` each forward of ``stage`` and the end of each micro-batch's backward; time them."""
    forward = calls.timed("F", stage.forward_one_chunk)
    backward = calls.timed("B", stage.backward_one_chunk)
    weight = calls.timed("W", stage.backward_weight_one_chunk)

    def forward_one_chunk(*args, **kwargs):
        out = forward(*args, **kwargs)
        stash.add(1)
        return out

    def backward_one_chunk(*args, **kwargs):
        backward(*args, **kwargs)
        if kwargs.get("full_backward", True):  # otherwise the micro-batch waits for its weight gradient
            stash.add(-1)

    def backward_weight_one_chunk(*args, **kwargs):
        weight(*args, **kwargs)
        stash.add(-1)

    stage.forward_one_chunk = forward_one_chunk
    stage.backward_one_chunk = backward_one_chunk
    stage.backward_weight_one_chunk = backward_weight_one_chunk


def torch_runner(name: str, rank: int, P: int, M: int, spec: dict[str, Any], groups: dict[str, Any]) -> Runner:
    """torch's schedule ``name`` over this rank's stages (raises torch's ValueError where it refuses ``M``)."""
    import torch.distributed.pipelining as pipelining

    num_stages = grid.num_model_stages(name, P)
    indices = grid.rank_stages(name, rank, P)
    stash, calls = Stash(), Calls()
    stages = []
    for index in indices:
        module = nn.Sequential(*_rank_layers(name, index, P, spec))
        stage = pipelining.PipelineStage(module, index, num_stages, torch.device("cpu"), group=groups["torch"])
        _counted(stage, stash, calls)
        stages.append(stage)
    kind = getattr(pipelining, grid.TORCH[name][0])
    schedule = kind(stages[0] if len(stages) == 1 else stages, M, loss_fn=emulated_loss)
    optimizer = torch.optim.SGD([p for s in stages for p in s.submod.parameters()], lr=1e-3)
    optimizer_step = calls.timed("U", optimizer.step)
    x, target = _batch(M, spec["rows"], spec["width"])
    first, last = 0 in indices, num_stages - 1 in indices

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        schedule.step(
            *((x,) if first else ()),
            target=target if last else None,
            losses=[] if last else None,
            return_outputs=False,
        )
        optimizer_step()

    return Runner(step, lambda: None, stash, calls)


def run_cell(runner: Runner, warmup: int, steps: int) -> dict[str, Any]:
    """``warmup`` untimed then ``steps`` timed steps; the timed window starts at the end of the last warm-up step."""
    ends: list[float] = []
    busy0, calls0, cpu0, peak_before = CLOCK.snapshot(), {}, time.process_time(), 0
    for t in range(warmup + steps):
        runner.step()
        ends.append(time.perf_counter())
        if t == warmup - 1:
            busy0, calls0, cpu0 = CLOCK.snapshot(), dict(runner.calls.seconds), time.process_time()
            peak_before, runner.stash.peak = runner.stash.peak, runner.stash.live
    busy1, calls1, cpu1 = CLOCK.snapshot(), dict(runner.calls.seconds), time.process_time()
    runner.finish()
    return {
        "step_ends": [e - ends[warmup - 1] for e in ends[warmup:]],
        "window_s": ends[-1] - ends[warmup - 1],
        "busy_s": {k: busy1[k] - busy0[k] for k in busy1},
        "calls_s": {k: calls1[k] - calls0[k] for k in calls1},
        "cpu_s": cpu1 - cpu0,
        "peak_stashed": runner.stash.peak,
        "peak_stashed_warmup": peak_before,
        "stashed_after": runner.stash.live,
    }


def _groups() -> dict[str, Any]:
    # Own groups for each kind of traffic: gloo numbers a group's collectives with the tags its
    # point-to-point messages use, and the barriers between cells run on the default group.
    return {name: dist.new_group() for name in ("torch", "ours_p2p", "ours_norm", "ours_order")}


def plan(spec: dict[str, Any]) -> list[tuple[int, int, str]]:
    """``(repetition, M, schedule)`` in the order every rank runs them."""
    names = list(spec["schedules"])
    out = []
    for rep in range(spec["repeats"]):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        out += [(rep, m, name) for m in spec["microbatch_counts"] for name in order]
    return out


def _make_runner(name: str, rank: int, P: int, M: int, spec: dict[str, Any], groups: dict[str, Any]) -> Runner:
    make = ours_runner if name in grid.OURS else torch_runner
    return make(name, rank, P, M, spec, groups)


def worker(spec: dict[str, Any], out_dir: Path) -> None:
    """Run this rank's share of the job described by ``spec``; one JSON line per cell in ``rank<r>.jsonl``."""
    torch.set_num_threads(1)
    tighten_timer_slack()
    dist.init_process_group("gloo")
    rank, P = dist.get_rank(), dist.get_world_size()
    groups = _groups()
    runners: dict[tuple[str, int], Runner | str] = {}
    with open(out_dir / f"rank{rank}.jsonl", "w") as out:
        for rep, M, name in plan(spec):
            dist.barrier()
            if (name, M) not in runners:
                try:
                    runners[(name, M)] = _make_runner(name, rank, P, M, spec, groups)
                except ValueError as refused:  # the same on every rank: a constraint on (P, M)
                    runners[(name, M)] = str(refused).replace("\n", " ")
            runner = runners[(name, M)]
            record: dict[str, Any] = {"rank": rank, "num_stages": P, "num_microbatches": M, "name": name, "rep": rep}
            if isinstance(runner, str):
                record["skipped"] = runner
            else:
                record.update(run_cell(runner, spec["warmup"], spec["steps"]))
            out.write(json.dumps(record) + "\n")
            out.flush()
    dist.barrier()
    dist.destroy_process_group()


def main_worker(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    worker(spec, Path(spec_path).parent)
