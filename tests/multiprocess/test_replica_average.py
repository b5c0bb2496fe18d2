"""The average over data-parallel replicas, in buckets and in flight across an update, on real gloo groups.

Each replica has different gradients; :class:`ReplicaAverage` (several buckets, reused step after step, some
in another dtype than some of their gradients) must give exactly what a blocking all-reduce of each bucket's
concatenated gradients followed by the division gives. With two replicas that is also exactly what one
all-reduce of the whole concatenated gradient gave (a sum of two values has one order); with three, gloo's ring
sums an element in an order that depends on its position in the buffer, so the bucketed result is the same
up to that order. :class:`UpdateDriver` must leave the all-reduces in flight after ``UPDATE`` and apply the same
update as the blocking path where the version is needed.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lightning_async_pp.runtime.replicas import ReplicaAverage
from lightning_async_pp.runtime.updates import UpdateDriver
from lightning_async_pp.runtime.weights import WeightVersions

pytestmark = pytest.mark.multiprocess

SHAPES = [(33, 7), (5,), (128,), (3, 3, 3), (1,), (200,)]


def blocking_average(grads: dict[str, torch.Tensor], group, dtype: torch.dtype | None = None) -> None:
    """The average as one blocking all-reduce of the concatenated gradient (what the runtime did before)."""
    tensors = list(grads.values())
    flat = torch.cat([g.reshape(-1).to(dtype or g.dtype) for g in tensors])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    offset = 0
    for g in tensors:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def random_grads(rank: int, step: int, dtypes) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return {
        f"p{i}": (torch.randn(shape, generator=generator) * 10 ** (i - 2)).to(dtype)
        for i, (shape, dtype) in enumerate(zip(SHAPES, dtypes))
    }


def _replica(rank: int, world: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    group = dist.new_group(list(range(world)))
    report: dict = {"mismatches": [], "whole": [], "buckets": [], "pending_after_update": [], "driver_mismatches": []}
    for dtypes in ([torch.float32] * len(SHAPES), [torch.float32, torch.bfloat16] * (len(SHAPES) // 2)):
        average = ReplicaAverage(group, bucket_bytes=512)  # several buckets of 128 float32 elements at most
        for step in range(3):  # the buckets are reused
            grads, expected, whole = (random_grads(rank, step, dtypes) for _ in range(3))
            finish = average.start(grads)
            for bucket in average._buckets:
                names = [name for name, _, _, _ in bucket.entries]
                blocking_average({n: expected[n] for n in names}, group, dtype=bucket.flat.dtype)
            blocking_average(whole, group)
            finish()
            report["mismatches"] += [f"{n} step {step}" for n in grads if not torch.equal(grads[n], expected[n])]
            report["mismatches"] += [f"{n} dtype" for n in grads if grads[n].dtype != expected[n].dtype]
            # Relative to the gradient's largest entry (a rounding of a three-term sum is an ulp of its size).
            report["whole"].append(
                max(
                    ((grads[n].float() - whole[n].float()).abs().max() / whole[n].float().abs().max()).item()
                    for n in grads
                )
            )
        report["buckets"].append(len(average._buckets))
    _compare_drivers(rank, group, report)
    Path(out, f"{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def _compare_drivers(rank: int, group, report: dict) -> None:
    """An UpdateDriver with the average in flight against the blocking average, over a few 2BW steps."""

    def driver(deferred: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
        params = dict(model.named_parameters())
        weights = WeightVersions(params, num_buffers=2)
        optimizer = torch.optim.AdamW(params.values(), lr=1e-2)
        if deferred:
            updates = UpdateDriver(optimizer, weights, "2bw", 1, torch.device("cpu"), data_group=group)
            updates.replicas.bucket_bytes = 256
        else:  # the blocking path: no replicas for the driver, the average in a hook

            def hook() -> None:
                blocking_average({n: p.grad for n, p in params.items()}, group)

            updates = UpdateDriver(optimizer, weights, "2bw", 1, torch.device("cpu"), before_update=hook)
        return model, weights, updates

    runs = {deferred: driver(deferred) for deferred in (True, False)}
    for step in range(5):
        for deferred, (model, weights, updates) in runs.items():
            updates.complete(up_to_version=step - 1)  # the forward of step `step` needs version `step - 1`
            buffer = weights.pin(step, step - 1)
            generator = torch.Generator().manual_seed(100 * step + rank)
            x = torch.randn(8, 16, generator=generator)
            out = torch.func.functional_call(model, buffer, (x,))
            out.pow(2).mean().backward()
            posted = updates.replicas.posted if deferred else 0
            updates.start(step)
            if deferred:
                report["pending_after_update"].append([len(updates.pending), updates.replicas.posted - posted])
    for updates in (runs[True][2], runs[False][2]):
        updates.complete(up_to_version=None)
    for name, value in runs[True][1].params.items():
        if not torch.equal(value, runs[False][1].params[name]):
            report["driver_mismatches"].append(name)


@pytest.mark.parametrize("world", [2, 3])
def test_bucketed_average_in_flight_equals_the_blocking_one(world):
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_replica, args=(world, str(Path(tmp, "init")), tmp), nprocs=world, start_method="spawn")
        reports = [json.loads(Path(tmp, f"{rank}.json").read_text()) for rank in range(world)]
    for rank, report in enumerate(reports):
        assert report["mismatches"] == [], f"rank {rank}"
        print(f"rank {rank}: max |bucketed - one all-reduce| / max |average| {max(report['whole']):.2e}")
        if world == 2:
            assert max(report["whole"]) == 0.0
        else:
            assert max(report["whole"]) < 4 * torch.finfo(torch.float32).eps
        # 33*7 = 231 elements alone, then 5 + 128 > 128, ...: more than one bucket per dtype layout.
        assert all(n >= 4 for n in report["buckets"]), report["buckets"]
        # After each UPDATE the step's update is pending with its buckets' all-reduces posted (several).
        assert all(pending >= 1 and posted >= 2 for pending, posted in report["pending_after_update"]), report
        if world == 2:
            assert report["driver_mismatches"] == [], f"rank {rank}"
