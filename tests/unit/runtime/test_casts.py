"""One cast per weight version (runtime/casts.py): the same bits as autocast's own casts, fewer copies."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_async_pp.runtime.casts import WeightCasts, autocast_dtype
from lightning_async_pp.runtime.recompute import checkpoint_layers
from lightning_async_pp.runtime.stage import StageRuntime
from lightning_async_pp.strategy.single_device import microbatch_losses

H, V = 8, 11


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, H)

    def forward(self, tokens):
        return self.emb(tokens)


class TiedPair(nn.Module):  # two Linear modules sharing one weight: one cast each
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(H, H, bias=False), nn.Linear(H, H, bias=False)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(F.gelu(self.a(x)))


class Scaled(nn.Linear):  # overrides forward: not cast
    def forward(self, x):
        return F.linear(x, self.weight * 0.5, self.bias)


class Head(nn.Module):  # tied to the embedding: not cast
    def __init__(self, emb: nn.Embedding) -> None:
        super().__init__()
        self.proj = nn.Linear(H, V, bias=False)
        self.proj.weight = emb.weight
        self.back = nn.Linear(V, H)

    def forward(self, x):
        return self.back(self.proj(x))


class Twice(nn.Module):  # one Linear called twice per forward: not cast (its gradients meet in float32)
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x)))


class Recomputed(nn.Module):  # checkpoints its Linear itself: cast, the recompute sees the float32 weight
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x):
        return checkpoint(self.lin, x, use_reentrant=False)


class Float32Router(nn.Module):  # a Linear run with autocast off: not cast
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x):
        with torch.autocast("cpu", enabled=False):
            return x + self.lin(x.float()).softmax(-1)


def stage_layers(seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    embed = Embed()
    return [
        embed,
        nn.Linear(H, H),
        TiedPair(),
        Scaled(H, H),
        Head(embed.emb),
        Twice(),
        Float32Router(),
        Recomputed(),
        nn.Linear(H, H),
    ]


CAST = 10  # weight and bias of three Linear and of the head's back projection; the tied pair's two places


class FakeNext:
    """The next stage: records what is sent, answers with seeded gradients."""

    def __init__(self) -> None:
        self.sent: list[torch.Tensor] = []
        self.gen = torch.Generator().manual_seed(1)

    def send(self, tensors, post_recv=False, tag=None):
        self.sent.append(tensors[0].detach().clone())

    def recv(self):
        return [torch.randn(3, 5, H, generator=self.gen)]

    def prefetch(self): ...
    def peer_received(self, through): ...
    def wait_sends(self, through=None): ...
    def forget_layout(self): ...


def bf16():
    return torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False)  # as Lightning's bf16-mixed


def run_first_stage(cast_weights: bool, recompute: list[int], steps: int = 3):
    layers = stage_layers()
    checkpoint_layers(layers, recompute)
    grads: list[dict[str, torch.Tensor]] = []
    runtime = StageRuntime(
        kind="2bw",
        stage=0,
        num_stages=2,
        num_microbatches=4,
        layers=layers,
        optimizer=torch.optim.SGD(nn.ModuleList(layers).parameters(), lr=0.5),
        inputs_fn=lambda mb: mb,
        loss_fn=lambda out, mb: out.sum(),
        device=torch.device("cpu"),
        next_rank=1,
        check_data_order=False,
        forward_context=bf16,
        cast_weights=cast_weights,
        before_update=lambda: grads.append({n: p.grad.clone() for n, p in runtime.params.items()}),
    )
    runtime.next = FakeNext()
    batches = torch.Generator().manual_seed(2)
    for step in range(steps):
        runtime.run_step(step, torch.randint(0, V, (12, 5), generator=batches))
    runtime.drain()
    return runtime, grads


@pytest.mark.parametrize("recompute", [[], [1, 2]], ids=["keep", "recompute"])
def test_cached_casts_give_the_bits_of_autocast(recompute):
    plain, plain_grads = run_first_stage(False, recompute)
    cached, cached_grads = run_first_stage(True, recompute)
    assert plain._casts.num_cast == 0
    assert cached._casts.num_cast == CAST - 2 * len(recompute)
    assert len(cached_grads) == 3  # three updates, over two weight versions in flight at once
    for a, b in zip(plain.next.sent, cached.next.sent, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(plain_grads, cached_grads, strict=True):
        for name in a:
            assert torch.equal(a[name], b[name]), name
    for name, p in plain.params.items():
        assert torch.equal(p, cached.params[name]), name


def saved_bfloat16_matrices(cast_weights: bool) -> int:
    """How many distinct bfloat16 8x8 tensors the graphs of a step's forwards save (weight casts, mostly)."""
    runtime, _ = run_first_stage(cast_weights, [], steps=1)
    seen: dict[int, torch.Tensor] = {}  # kept alive, so that no address is reused

    def pack(t):
        if t.dtype == torch.bfloat16 and t.shape == (H, H):
            seen[t.data_ptr()] = t
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        runtime.run_step(1, torch.randint(0, V, (12, 5)))
    runtime.drain()
    return len(seen)


def test_micro_batches_in_flight_share_one_cast_per_version():
    # A step's four micro-batches run on one version: the four cached 8x8 places (first Linear, the tied pair's
    # two, the last Linear) are cast once instead of four times; the others (Scaled, Twice) as before.
    shared, per_microbatch = saved_bfloat16_matrices(True), saved_bfloat16_matrices(False)
    assert per_microbatch - shared == 4 * (4 - 1)


def test_single_device_forwards_share_casts_and_keep_the_bits():
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(stage_layers())

        def pipeline_layers(self):
            return self.layers

        def pipeline_inputs(self, mb):
            return mb

        def pipeline_loss(self, out, mb):
            return out.float().square().mean()

    model = Model()
    other = copy.deepcopy(model)
    params = {n: p for n, p in model.named_parameters()}
    casts = WeightCasts(model, list(params), autocast_dtype(bf16, "cpu"), "cpu")
    batch = torch.randint(0, V, (8, 5))
    for step in range(2):  # the first step finds the modules to cast, the second casts
        with bf16():
            cached = microbatch_losses(model, batch, 4, lambda: casts(params, step))
            plain = microbatch_losses(other, batch, 4)
        for a, b in zip(cached, plain, strict=True):
            assert torch.equal(a, b)
            (a / 4).backward()
            (b / 4).backward()
        for name, p in other.named_parameters():
            assert torch.equal(params[name].grad, p.grad), name
    assert casts.num_cast == CAST


def test_compiled_modules_keep_their_float32_weights():
    compiled, eager = TiedPair(), nn.Linear(H, H)
    compiled.compile(backend="eager")  # lazy: nothing is traced here
    model = nn.Sequential(compiled, eager, torch.compile(nn.Linear(H, H), backend="eager"))
    casts = WeightCasts(model, [n for n, _ in model.named_parameters()], torch.bfloat16, "cpu")
    assert casts.num_cast == 2  # the eager Linear's weight and bias


def test_no_casts_without_autocast_or_gradients():
    layers = nn.Sequential(nn.Linear(H, H))
    assert autocast_dtype(lambda: torch.autocast("cpu", enabled=False), "cpu") is None
    casts = WeightCasts(layers, ["0.weight", "0.bias"], torch.bfloat16, "cpu")
    tensors = dict(layers.named_parameters())
    for key in range(2):
        with torch.no_grad(), casts(tensors, key):
            assert layers[0].weight is tensors["0.weight"]
    with bf16(), casts(tensors, 0):  # the first training forward only looks
        layers(torch.ones(1, H))
    with bf16(), casts(tensors, 0):
        assert layers[0].weight.dtype == torch.bfloat16
    assert layers[0].weight is tensors["0.weight"]
