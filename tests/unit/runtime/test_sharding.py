"""Sharding a stage's optimizer state by whole tensors: the owners' plan, the optimizer that keeps only its part,
which optimizers may be split, and when the strategy lets the replicas' collectives stay in flight."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch import Callback, LightningModule
from torch import nn
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter

from lightning_async_pp.checkpoint.layout import load_stage, stage_shard
from lightning_async_pp.checkpoint.safe import read_index
from lightning_async_pp.optim import PER_PARAMETER_OPTIMIZERS, DelayCorrected, Muon, updates_per_parameter
from lightning_async_pp.runtime.sharding import keep_owned, plan_owners
from lightning_async_pp.schedule import Op, step_actions, updates_settled_by
from lightning_async_pp.strategy.lifecycle import before_optimizer_step
from lightning_async_pp.strategy.stage_runtime import check_shardable


@pytest.mark.parametrize("replicas", [1, 2, 3, 8])
def test_plan_owners_balances_whole_tensors(replicas):
    generator = torch.Generator().manual_seed(replicas)
    sizes = {f"t{i}": int(s) for i, s in enumerate(torch.randint(1, 10_000, (40,), generator=generator))}
    owners = plan_owners(sizes, replicas)
    assert list(owners) == list(sizes) and set(owners.values()) <= set(range(replicas))
    load = [sum(sizes[n] for n, r in owners.items() if r == replica) for replica in range(replicas)]
    # Largest first to the lightest replica: the heaviest holds at most one tensor more than an even split.
    assert max(load) <= sum(sizes.values()) / replicas + max(sizes.values())
    assert plan_owners(dict(reversed(sizes.items())), replicas) == owners  # the same plan in any order
    if replicas > 1:
        assert min(load) > 0


def test_plan_owners_breaks_ties_by_the_stage_order():
    assert plan_owners({"a": 4, "b": 4, "c": 4, "d": 4}, 2) == {"a": 0, "b": 1, "c": 0, "d": 1}
    assert plan_owners({"big": 10, "x": 3, "y": 3, "z": 3}, 2) == {"big": 0, "x": 1, "y": 1, "z": 1}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 4))


class _Experts(nn.Module):
    """Four experts' weights stacked, as transformers 5 stores a mixture-of-experts layer."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(4, 32, 16) * 0.2)
        self.down_proj = nn.Parameter(torch.randn(4, 16, 16) * 0.2)


def _moe_model() -> nn.Module:
    torch.manual_seed(0)
    moe = nn.ModuleDict({"gate": nn.Linear(16, 4, bias=False), "experts": _Experts()})
    return nn.ModuleDict({"proj": nn.Linear(8, 16), "moe": moe, "norm": nn.LayerNorm(16)})


MODELS = {"mlp": _model, "moe": _moe_model}


@pytest.fixture
def one_thread():
    # A batch of a dozen tiny matrices makes `bmm` fan out to the intra-op threads, which stall (a step took
    # 0.3 s instead of 1 ms) when other processes keep the cores busy.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "muon": lambda params: Muon(params, lr=0.02, adamw_lr=1e-2, ns_dtype="float32"),
    "corrected": lambda params: DelayCorrected(torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)),
    "corrected_auto": lambda params: DelayCorrected(torch.optim.AdamW(params, lr=1e-2), coefficient="auto"),
}


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_an_optimizer_that_keeps_part_of_the_parameters_steps_them_as_the_whole_one(name, kind, one_thread):
    """The whole optimizer is the reference: each part, stepped on the same gradients, gives the same bits (a
    stack of expert matrices is one tensor with one owner, orthogonalized there expert by expert)."""
    build_model = MODELS[kind]
    whole_model, part_models = build_model(), [build_model(), build_model()]
    whole = OPTIMIZERS[name](list(whole_model.named_parameters()))
    parts = [OPTIMIZERS[name](list(m.named_parameters())) for m in part_models]
    names = [n for n, _ in whole_model.named_parameters()]
    owners = plan_owners({n: p.numel() for n, p in whole_model.named_parameters()}, 2)
    for replica, (model, optimizer) in enumerate(zip(part_models, parts)):
        groups = len(optimizer.param_groups)
        keep_owned(optimizer, [p for n, p in model.named_parameters() if owners[n] == replica])
        assert len(optimizer.param_groups) == groups  # schedulers index the groups
        kept = sum(len(g["params"]) for g in optimizer.param_groups)
        assert kept == sum(1 for r in owners.values() if r == replica)
    generator = torch.Generator().manual_seed(1)
    for _ in range(4):
        grads = {n: torch.randn(p.shape, generator=generator) for n, p in whole_model.named_parameters()}
        for model in (whole_model, *part_models):
            for n, p in model.named_parameters():
                p.grad = grads[n].clone()
        whole.step()
        for optimizer in parts:
            optimizer.step()
    for n, p in whole_model.named_parameters():
        owner = dict(part_models[owners[n]].named_parameters())[n]
        assert torch.equal(owner, p), n
        other = dict(part_models[1 - owners[n]].named_parameters())[n]
        assert not torch.equal(other, p), n  # the other replica's optimizer left it alone
    for replica, optimizer in enumerate(parts):
        held = {id(p) for p in optimizer.state}
        mine = {id(p) for n, p in part_models[replica].named_parameters() if owners[n] == replica}
        assert held == mine  # state only for its own tensors
    assert names  # the model has parameters


def _step_moe(models_and_optimizers, steps: range) -> None:
    for step in steps:
        generator = torch.Generator().manual_seed(10 + step)
        grads = {n: torch.randn(p.shape, generator=generator) for n, p in _moe_model().named_parameters()}
        for model, optimizer in models_and_optimizers:
            for n, p in model.named_parameters():
                p.grad = grads[n].clone()
            optimizer.step()


def _sharded_moe(owners: dict[str, int]) -> list[tuple[nn.Module, Muon]]:
    replicas = []
    for replica in range(2):
        model = _moe_model()
        optimizer = Muon(model.named_parameters(), lr=0.02, adamw_lr=1e-2, ns_dtype="float32")
        keep_owned(optimizer, [p for n, p in model.named_parameters() if owners[n] == replica])
        replicas.append((model, optimizer))
    return replicas


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_sharded_muon_state_of_expert_stacks_resumes_through_the_checkpoint_on_any_replica_count(
    tmp_path, one_thread
):
    """Two replicas write their parts of the state (the stacks' momentum, whole, by name), as a sharded stage
    does; one unsharded optimizer and two new replicas read them, and both continue the uninterrupted run."""
    owners = plan_owners({n: p.numel() for n, p in _moe_model().named_parameters()}, 2)
    assert len({owners["moe.experts.gate_up_proj"], owners["moe.experts.down_proj"]}) == 2
    straight_model = _moe_model()
    straight = Muon(straight_model.named_parameters(), lr=0.02, adamw_lr=1e-2, ns_dtype="float32")
    assert straight.routing()["muon_expert_stacks"] == 2
    writers = _sharded_moe(owners)
    _step_moe([(straight_model, straight), *writers], range(2))
    with torch.no_grad():  # the all-gather: every replica gets the owners' new weights
        for n, p in writers[0][0].named_parameters():
            p.copy_(dict(writers[owners[n]][0].named_parameters())[n])
    shard = {}
    for replica, (model, optimizer) in enumerate(writers):
        state_dict = {n: t.detach() for n, t in model.state_dict().items()}
        shard.update(stage_shard(state_dict, optimizer, model, None, stage=0, optimizer_only=replica == 1))
    planner = DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    dcp.save(shard, storage_writer=FileSystemWriter(tmp_path), planner=planner, no_dist=True)
    index = read_index(tmp_path)
    assert tuple(index.state_dict_metadata["optimizer.state.moe.experts.gate_up_proj.momentum_buffer"].size) == (
        4,
        32,
        16,
    )

    whole_model = _moe_model()
    whole = Muon(whole_model.named_parameters(), lr=0.02, adamw_lr=1e-2, ns_dtype="float32")
    readers = _sharded_moe({n: 1 - r for n, r in owners.items()})  # the other replica owns each tensor now
    for model, optimizer in [(whole_model, whole), *readers]:
        state_dict = {n: t.detach() for n, t in model.state_dict().items()}
        load_stage(tmp_path, index, state_dict=state_dict, module=model, optimizer=optimizer, previous=None, stage=0)
    _step_moe([(straight_model, straight), (whole_model, whole), *readers], range(2, 4))
    for n, p in straight_model.named_parameters():
        assert torch.equal(dict(whole_model.named_parameters())[n], p), n
        assert torch.equal(dict(readers[1 - owners[n]][0].named_parameters())[n], p), n


def test_keep_owned_drops_the_state_and_names_of_the_others():
    model = _model()
    optimizer = torch.optim.AdamW(
        [{"params": list(model.parameters()), "param_names": [n for n, _ in model.named_parameters()]}]
    )
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    keep = [model[0].weight, model[4].bias]
    keep_owned(optimizer, keep)
    assert optimizer.param_groups[0]["params"] == keep
    assert optimizer.param_groups[0]["param_names"] == ["0.weight", "4.bias"]
    assert set(map(id, optimizer.state)) == set(map(id, keep))


class _Declared(torch.optim.SGD):
    per_parameter = True


class _Undeclared(torch.optim.SGD):
    pass


def test_which_optimizers_may_be_split_by_tensor():
    params = list(_model().parameters())
    assert torch.optim.AdamW in PER_PARAMETER_OPTIMIZERS and torch.optim.LBFGS not in PER_PARAMETER_OPTIMIZERS
    assert updates_per_parameter(torch.optim.AdamW(params))
    assert updates_per_parameter(Muon(params))
    assert updates_per_parameter(DelayCorrected(torch.optim.AdamW(params), coefficient="auto"))
    assert updates_per_parameter(_Declared(params, lr=0.1))
    assert not updates_per_parameter(_Undeclared(params, lr=0.1))  # a subclass may change the update
    assert not updates_per_parameter(DelayCorrected(_Undeclared(params, lr=0.1)))
    with pytest.raises(ValueError, match=r"`LBFGS.per_parameter = True`.*`shard_optimizer=False`"):
        check_shardable(torch.optim.LBFGS(params))
    check_shardable(DelayCorrected(Muon(params)))


class _Hooked(Callback):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        pass


class _HookedModule(LightningModule):
    def on_before_optimizer_step(self, optimizer):
        pass


@pytest.mark.parametrize(
    ("callbacks", "module", "runs"),
    [([Callback()], LightningModule(), False), ([_Hooked()], LightningModule(), True), ([], _HookedModule(), True)],
)
def test_the_before_update_hook_is_only_run_when_someone_overrides_it(callbacks, module, runs):
    trainer = types.SimpleNamespace(callbacks=callbacks, lightning_module=module)
    hook = before_optimizer_step(trainer, torch.optim.SGD(_model().parameters(), lr=0.1))
    assert (hook is not None) == runs


@pytest.mark.parametrize("num_stages", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("extra", [0, 1, 3])
def test_updates_settle_at_the_first_forward_stage_0_runs_after_its_update(num_stages, extra):
    """Read off the action lists: stage 0's first forward after UPDATE(t) is micro-batch P-1 of step t+1, and on
    every stage UPDATE(t) comes before that forward (which needs the activations stage 0 sent after its update)."""
    M = num_stages + extra
    settle = updates_settled_by("2bw", num_stages)
    assert updates_settled_by("1f1b", num_stages) is None
    for run_start in (0, 2):
        for stage in range(num_stages):
            actions = [
                a
                for t in range(run_start, run_start + 6)
                for a in step_actions("2bw", num_stages, M, stage, t, run_start)
            ]
            compute = [a for a in actions if a.op in (Op.FORWARD, Op.UPDATE)]
            for t in range(run_start, run_start + 4):
                update = next(k for k, a in enumerate(compute) if a.op is Op.UPDATE and a.step == t)
                forward = next(
                    k for k, a in enumerate(compute) if a.op is Op.FORWARD and (a.step, a.microbatch) == (t + 1, settle)
                )
                assert update < forward, (stage, t)
                if stage == 0:
                    first = next(a for a in compute[update:] if a.op is Op.FORWARD)
                    assert (first.step, first.microbatch) == (t + 1, settle)
