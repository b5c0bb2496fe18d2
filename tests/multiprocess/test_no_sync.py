"""No host-device synchronization and no copy from pageable host memory in the steady state: real gloo pipelines
count, during each step, the calls that would make the host wait for a GPU (reading a tensor's value on the host)
and the calls that would copy host data to a GPU (creating a tensor from Python or NumPy data, moving a host
tensor to a device).

On this CPU-only machine the stage's device is the CPU too, so a copy is recognised by its code path: a tensor
made from host data, ``.to(device)`` or ``.cuda()`` of an unpinned CPU tensor, and ``copy_`` from a tensor the
host made (without a device) into one it did not. On a GPU each would be a pageable host-to-device copy, which
waits for the host's data to be staged.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

from lightning_async_pp.runtime.stage import StageRuntime
from lightning_async_pp.runtime.ties import Tie, TiedGradients, broadcast_ties, new_tie_groups

pytestmark = pytest.mark.multiprocess

# On a CUDA tensor each of these copies to the host and waits for the device. (`Tensor.numpy` is refused
# for device tensors, so the runtime may read host memory with it.)
SYNCING = ("item", "cpu", "tolist", "__bool__", "__float__", "__int__", "__index__")
STEPS, STEADY_FROM = 6, 2
FROM_HOST_DATA = ("tensor", "as_tensor", "from_numpy")
# Factories that, without a `device`, allocate in host memory: a copy from what they make is a host copy.
HOST_FACTORIES = ("zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint", "linspace")


@contextlib.contextmanager
def count_syncs(counter: dict):
    saved = {name: getattr(torch.Tensor, name) for name in SYNCING}

    def wrap(name, fn):
        def counted(self, *args, **kwargs):
            counter[name] = counter.get(name, 0) + 1
            return fn(self, *args, **kwargs)

        return counted

    for name, fn in saved.items():
        setattr(torch.Tensor, name, wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def _pageable(t: Tensor) -> bool:
    return t.device.type == "cpu" and not t.is_pinned()


def _names_a_device(args, kwargs) -> bool:
    """Whether ``Tensor.to``'s arguments name a device (a dtype alone converts on the same device)."""
    if kwargs.get("device") is not None:
        return True
    return any(isinstance(a, (torch.device, str, int, Tensor)) and not isinstance(a, bool) for a in args)


@contextlib.contextmanager
def count_host_copies(counter: dict):
    """Count the calls that would copy host data to a GPU (see the module docstring) into ``counter``."""

    def count(name: str) -> None:
        counter[name] = counter.get(name, 0) + 1

    saved_torch = {name: getattr(torch, name) for name in (*FROM_HOST_DATA, *HOST_FACTORIES)}
    saved_tensor = {name: getattr(Tensor, name) for name in ("to", "cuda", "copy_", "new_tensor")}

    def from_host_data(name, fn):
        def counted(data, *args, **kwargs):
            if name != "as_tensor" or not isinstance(data, Tensor) or kwargs.get("device") is not None:
                count(f"torch.{name}")
            out = fn(data, *args, **kwargs)
            if not isinstance(data, Tensor):  # `as_tensor` may return `data` itself
                out._host_made = True
            return out

        return counted

    def host_factory(fn):
        def tagged(*args, **kwargs):
            out = fn(*args, **kwargs)
            if kwargs.get("device") is None:
                out._host_made = True
            return out

        return tagged

    def to(self, *args, **kwargs):
        if _pageable(self) and _names_a_device(args, kwargs):
            count("Tensor.to(device)")
        return saved_tensor["to"](self, *args, **kwargs)

    def cuda(self, *args, **kwargs):
        if _pageable(self):
            count("Tensor.cuda")
        return saved_tensor["cuda"](self, *args, **kwargs)

    def copy_(self, src, *args, **kwargs):
        if isinstance(src, Tensor) and _pageable(src):
            on_device = self.device.type != "cpu"
            if on_device or (getattr(src, "_host_made", False) and not getattr(self, "_host_made", False)):
                count("Tensor.copy_(host)")
        return saved_tensor["copy_"](self, src, *args, **kwargs)

    def new_tensor(self, *args, **kwargs):
        count("Tensor.new_tensor")
        return saved_tensor["new_tensor"](self, *args, **kwargs)

    for name, fn in saved_torch.items():
        setattr(torch, name, from_host_data(name, fn) if name in FROM_HOST_DATA else host_factory(fn))
    for name, fn in {"to": to, "cuda": cuda, "copy_": copy_, "new_tensor": new_tensor}.items():
        setattr(Tensor, name, fn)
    try:
        yield
    finally:
        for name, fn in saved_torch.items():
            setattr(torch, name, fn)
        for name, fn in saved_tensor.items():
            setattr(Tensor, name, fn)


@dataclass(frozen=True)
class Case:
    """One pipeline: ``stages`` x ``replicas`` processes (the lowest ranks; the others wait).

    Args:
        name: The test id.
        kind: The schedule.
        payload: What a stage sends on: ``"tensor"``, ``"tuple"`` (with an int64 tensor) or ``"dict"`` (with an
            int16 tensor, which travels widened).
        stages: Stages of a pipeline.
        replicas: Pipelines (data parallelism).
        tie: Tie the first stage's weight to the last stage's.
        shard: Shard the optimizer state over the replicas.
        clip: Clip the gradient by the global norm.
    """

    name: str
    kind: str
    payload: str = "tensor"
    stages: int = 3
    replicas: int = 1
    tie: bool = False
    shard: bool = False
    clip: bool = True


CASES = [
    Case("tensor-2bw", "2bw"),
    Case("tensor-1f1b", "1f1b"),
    Case("tuple-2bw", "2bw", payload="tuple"),
    Case("dict-int16-1f1b", "1f1b", payload="dict"),
    Case("replicas-2bw", "2bw", stages=2, replicas=2),
    Case("tied-clipped-2bw", "2bw", tie=True),
    Case("sharded-tied-clipped-2bw", "2bw", stages=2, replicas=2, tie=True, shard=True),
    Case("sharded-in-flight-2bw", "2bw", stages=2, replicas=2, shard=True, clip=False),
]
WORLD = max(case.stages * case.replicas for case in CASES)


class Layer(nn.Module):
    """``Linear(8, 8)`` and ``Tanh`` on the hidden states; passes on ``out``: the hidden states alone
    (``"tensor"``), or with integer ids and a mask (no gradient), as a ``"tuple"`` or a ``"dict"``."""

    def __init__(self, out: str, ids_dtype: torch.dtype) -> None:
        super().__init__()
        self.fc, self.out, self.ids_dtype = nn.Linear(8, 8), out, ids_dtype

    def forward(self, x):
        if isinstance(x, Tensor):
            with torch.no_grad():
                ids, mask = (x > 0).sum(-1).to(self.ids_dtype), (x > 0).float()
            h = x
        else:
            h, ids, mask = x if isinstance(x, tuple) else (x["h"], x["ids"], x["mask"])
        h = torch.tanh(self.fc(h)) * (0.5 + mask) + 0.01 * ids.unsqueeze(-1).float()
        if self.out == "tensor":
            return h
        return (h, ids, mask) if self.out == "tuple" else {"h": h, "ids": ids, "mask": mask}


def _build(rank: int, case: Case) -> StageRuntime | None:
    """Stage ``rank`` of ``case`` (``None`` for a rank outside it). A collective: every rank creates every group."""
    stages, replicas = case.stages, case.replicas
    rank_of = lambda s, d: d * stages + s  # noqa: E731
    member = rank < stages * replicas
    stage, replica = rank % stages, rank // stages
    p2p, order = dist.new_group(), dist.new_group()
    norm_groups = [dist.new_group([rank_of(s, d) for s in range(stages)]) for d in range(replicas)]
    data_groups = [dist.new_group([rank_of(s, d) for d in range(replicas)]) for s in range(stages)]
    ties = [Tie({0: "0.fc.weight", stages - 1: "0.fc.weight"}, (0, stages - 1), (8, 8), torch.float32, True)]
    ties = ties if case.tie else []
    tie_groups, sources = new_tie_groups(ties, rank_of, replicas, replica, stage if member else -1)
    if not member:
        return None
    torch.manual_seed(stage)
    ids_dtype = torch.int16 if case.payload == "dict" else torch.int64
    layer = Layer("tensor" if stage == stages - 1 else case.payload, ids_dtype)
    params = dict(nn.Sequential(layer).named_parameters())
    broadcast_ties(ties, stage, params, tie_groups, sources)
    return StageRuntime(
        kind=case.kind,
        stage=stage,
        num_stages=stages,
        num_microbatches=4,
        layers=[layer],
        optimizer=torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9),
        inputs_fn=lambda mb: mb,
        loss_fn=lambda output, mb: (output - mb).pow(2).mean(),
        device=torch.device("cpu"),
        prev_rank=rank_of(stage - 1, replica) if stage > 0 else None,
        next_rank=rank_of(stage + 1, replica) if stage < stages - 1 else None,
        clip_grad_norm=1.0 if case.clip else None,
        norm_group=norm_groups[replica],
        p2p_group=p2p,
        order_group=order,
        data_group=data_groups[stage] if replicas > 1 else None,
        ties=TiedGradients(ties, stage, tie_groups) if ties else None,
        shard_optimizer=case.shard,
    )


def _process(rank: int, world: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    results = {}
    for case in CASES:
        runtime = _build(rank, case)
        if runtime is not None:
            generator = torch.Generator().manual_seed(rank // case.stages)  # the same batches along a pipeline
            counts = []
            for step in range(STEPS):
                batch = torch.randn(16, 8, generator=generator)
                counter: dict = {}
                with count_syncs(counter), count_host_copies(counter):
                    loss, _ = runtime.run_step(step, batch)
                    if loss is not None:
                        loss.detach()  # what the strategy logs: a device tensor, read by the logger when it flushes
                counts.append(counter)
            runtime.drain()
            results[case.name] = counts
        dist.barrier()
    Path(out, f"{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def counts() -> dict[int, dict[str, list[dict[str, int]]]]:
    """Per rank and case, per step, the calls counted (one job runs every case, one after the other)."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_process, args=(WORLD, str(Path(tmp, "init")), tmp), nprocs=WORLD, start_method="spawn")
        return {rank: json.loads(Path(tmp, f"{rank}.json").read_text()) for rank in range(WORLD)}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_no_host_sync_or_host_copy_per_steady_state_step(counts, case):
    ranks = range(case.stages * case.replicas)
    per_rank = {rank: counts[rank][case.name] for rank in ranks}
    # The first step negotiates the layouts, which the counters see: a header read on the host by each receiver
    # and a header copied to the device by each sender.
    first = {rank: per_rank[rank][0] for rank in ranks}
    assert all("tolist" in first[r] for r in ranks if r % case.stages > 0), first
    assert all("Tensor.to(device)" in first[r] for r in ranks if r % case.stages < case.stages - 1), first
    for rank, per_step in per_rank.items():
        assert per_step[STEADY_FROM:] == [{}] * (STEPS - STEADY_FROM), f"{case.name}, rank {rank}: {per_step}"
