"""Muon on mixture-of-experts layers: a stack of expert matrices is orthogonalized expert by expert (a fused gate
and up projection as two matrices), against torch.optim.Muon on each slice; routers go to AdamW."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from lightning_async_pp.optim import DelayCorrected, Muon
from lightning_async_pp.optim.newton_schulz import newton_schulz_dtype

EXPERTS, HIDDEN, INNER = 3, 16, 24  # each matrix has at least 16 rows as iterated (see test_muon_batched)
HYPERPARAMETERS = dict(lr=0.02, weight_decay=0.05, momentum=0.9, nesterov=True)


class Experts(nn.Module):
    """Stacked expert weights as transformers 5 stores them: ``[gate; up]`` rows of ``(2I, H)`` matrices and
    ``(H, I)`` down projections, or transposed (``(H, 2I)``, ``(I, H)``) with gate and up columns interleaved,
    which the module says with transformers' ``is_transposed`` / ``is_concatenated``."""

    def __init__(self, experts: int, transposed: bool = False, bias: bool = False) -> None:
        super().__init__()
        self.num_experts = experts
        self.is_transposed, self.is_concatenated = transposed, not transposed
        up = (experts, HIDDEN, 2 * INNER) if transposed else (experts, 2 * INNER, HIDDEN)
        down = (experts, INNER, HIDDEN) if transposed else (experts, HIDDEN, INNER)
        self.gate_up_proj = nn.Parameter(torch.randn(up) * 0.2)
        self.down_proj = nn.Parameter(torch.randn(down) * 0.2)
        if bias:
            self.gate_up_proj_bias = nn.Parameter(torch.zeros(experts, 2 * INNER))


class Block(nn.Module):
    def __init__(self, experts: int = EXPERTS, **kwargs) -> None:
        super().__init__()
        self.attn = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.gate = nn.Linear(HIDDEN, experts, bias=False)  # the router, as a plain Linear
        self.experts = Experts(experts, **kwargs)
        self.norm = nn.LayerNorm(HIDDEN)


def _net(dtype=torch.float32, **kwargs) -> nn.Module:
    torch.manual_seed(0)
    return nn.ModuleDict({"embed": nn.Embedding(32, HIDDEN), "mlp": Block(**kwargs)}).to(dtype)


def _set_grads(module: nn.Module, step: int) -> None:
    generator = torch.Generator().manual_seed(100 + step)
    for p in module.parameters():
        p.grad = (p.detach().float() * 0.5 + torch.randn(p.shape, generator=generator)).to(p.dtype)


def _expert_matrices(experts: Experts, tensor_of) -> dict[str, list[torch.Tensor]]:
    """Independent of the optimizer's cutting: per expert, gate, up and down as plain indexing gives them."""
    gate_up, down = tensor_of(experts.gate_up_proj), tensor_of(experts.down_proj)
    out = {}
    for e in range(gate_up.shape[0]):
        if experts.is_transposed:  # (H, 2I), gate and up columns interleaved
            out[f"gate{e}"], out[f"up{e}"] = gate_up[e][:, 0::2], gate_up[e][:, 1::2]
        else:
            out[f"gate{e}"], out[f"up{e}"] = gate_up[e][:INNER], gate_up[e][INNER:]
        out[f"down{e}"] = down[e]
    return out


@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
@pytest.mark.parametrize("layout", ["concatenated", "transposed-interleaved"])
@pytest.mark.parametrize("batched", [True, False], ids=["batched", "per-matrix"])
@pytest.mark.parametrize(
    ("ns_dtype", "dtype"),
    [("float32", torch.float32), ("bfloat16", torch.float32), ("float32", torch.bfloat16)],
    ids=["float32", "ns-bfloat16", "bf16-weights"],
)
def test_each_expert_matrix_is_updated_as_torch_muon_updates_it(ns_dtype, dtype, batched, layout, adjust_lr_fn):
    net = _net(dtype, transposed=layout != "concatenated")
    experts = net["mlp"].experts
    optimizer = Muon(net, **HYPERPARAMETERS, adjust_lr_fn=adjust_lr_fn, ns_dtype=ns_dtype, batched=batched)
    # The reference: torch.optim.Muon on a separate parameter per expert matrix (its own learning-rate scale).
    reference = {name: nn.Parameter(m.detach().clone()) for name, m in _expert_matrices(experts, lambda p: p).items()}
    torch_muon = torch.optim.Muon(list(reference.values()), **HYPERPARAMETERS, adjust_lr_fn=adjust_lr_fn)
    for step in range(3):
        _set_grads(net, step)
        grads = _expert_matrices(experts, lambda p: p.grad)
        for name, param in reference.items():
            param.grad = grads[name].clone()
        before = {name: m.detach().clone() for name, m in _expert_matrices(experts, lambda p: p).items()}
        optimizer.step()
        with newton_schulz_dtype(ns_dtype):
            torch_muon.step()
        for name, ours in _expert_matrices(experts, lambda p: p.detach()).items():
            theirs = reference[name].detach()
            assert not torch.equal(theirs, before[name]), name
            if layout == "concatenated":
                assert torch.equal(ours, theirs), (name, step)  # the same bits
            elif dtype == torch.bfloat16:
                # Strided views (interleaved columns) sum the norm in another order: an element of the bfloat16
                # update, and of the weight, can round one step (2**-7 relative at most) the other way.
                update, difference = theirs.float() - before[name].float(), ours.float() - theirs.float()
                assert (difference.abs() <= 2**-7 * (theirs.float().abs() + update.abs())).all(), (name, step)
            else:
                torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7, msg=name)
            ours.copy_(theirs)  # compare each update from the same weights


def test_the_routing_names_the_stacks_and_the_router():
    net = _net(bias=True)
    optimizer = Muon(net, ns_dtype="float32")
    routing = optimizer.routing()
    assert routing["muon_expert_stacks"] == 2 and routing["experts"] == [EXPERTS]
    assert routing["muon_expert_matrices"] == 3 * EXPERTS  # gate, up and down per expert
    assert routing["routers"] == {"adamw": ["mlp.gate.weight"], "muon": []}
    assert routing["muon_kernels"] == 0
    assert routing["adamw_matrices"] == ["embed.weight"]  # neither the router nor the experts' biases
    muon = {n for g in optimizer.param_groups if g["use_muon"] for n in g["param_names"]}
    assert muon == {"mlp.attn.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
    line = optimizer.describe_routing()
    assert "2 expert stacks as 9 matrices (3 experts)" in line
    assert "routers on AdamW: mlp.gate.weight; matrices on AdamW: embed.weight" in line
    # Gate and up (16 x 24 as iterated) join down's group (16 x 24) and the attention matrix has its own.
    assert routing["ns_groups"] == 2


def test_names_alone_route_as_the_module_does():
    net = _net()
    by_module, by_name = Muon(net), Muon(net.named_parameters())
    assert by_module.routing() == by_name.routing()
    cuts = [by_module._muon.expert_stacks[p] for p in net["mlp"].experts.parameters()]
    assert cuts == [by_name._muon.expert_stacks[p] for p in net["mlp"].experts.parameters()]
    assert cuts[0].split and not cuts[1].split


def test_a_module_with_num_experts_holds_experts_whatever_its_name():
    torch.manual_seed(0)
    net = nn.ModuleDict({"moe": nn.ModuleDict({"router": nn.Linear(HIDDEN, 4), "ffn": Experts(4)})})
    net["moe"]["ffn"].register_parameter("scale", nn.Parameter(torch.ones(4, HIDDEN)))  # per-expert vectors
    routing = Muon(net).routing()
    assert routing["muon_expert_stacks"] == 2 and routing["routers"]["adamw"] == ["moe.router.weight"]
    assert routing["adamw_matrices"] == []
    named = Muon(net.named_parameters()).routing()  # by names: not an experts module, so kernels and matrices
    assert named["muon_expert_stacks"] == 0 and named["muon_kernels"] == 2 and named["routers"]["adamw"] == []
    assert Muon(net.named_parameters(), expert_patterns=["*ffn"]).routing()["routers"]["adamw"] == ["moe.router.weight"]


def test_a_conv1d_kernel_is_not_a_stack_of_experts():
    torch.manual_seed(0)
    net = nn.ModuleDict({"conv": nn.Conv1d(16, 24, 3), "mlp": Block()})
    optimizer = Muon(net)
    routing = optimizer.routing()
    assert routing["muon_kernels"] == 1 and routing["muon_expert_stacks"] == 2
    assert net["conv"].weight not in optimizer._muon.expert_stacks


def test_the_router_goes_to_muon_on_request_and_experts_to_adamw_by_name():
    net = _net()
    optimizer = Muon(net, muon_routers=True)
    assert optimizer.routing()["routers"] == {"adamw": [], "muon": ["mlp.gate.weight"]}
    assert "routers on Muon: mlp.gate.weight" in optimizer.describe_routing()
    adamw = Muon(net, adamw_patterns=["*embed*", "*experts.*"]).routing()
    assert adamw["muon_expert_stacks"] == 0 and adamw["muon_tensors"] == 1  # only the attention matrix
    assert adamw["adamw_matrices"] == ["embed.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def test_without_the_down_projection_a_fused_stack_of_unknown_layout_is_one_matrix_per_expert():
    net = _net()
    named = [(n, p) for n, p in net.named_parameters() if "down_proj" not in n]
    optimizer = Muon(named)
    assert not optimizer._muon.expert_stacks[net["mlp"].experts.gate_up_proj].split
    assert optimizer.routing()["muon_expert_matrices"] == EXPERTS


def test_a_tiny_hugging_face_mixtral_steps_each_expert_as_its_own_matrices():
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config)
    optimizer = Muon(model.named_parameters(), **HYPERPARAMETERS, ns_dtype="float32")
    routing = optimizer.routing()
    assert routing["muon_expert_stacks"] == 4 and routing["muon_expert_matrices"] == 2 * 4 * 3
    assert routing["routers"]["adamw"] == ["model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight"]
    assert routing["adamw_matrices"] == ["model.embed_tokens.weight", "lm_head.weight"]
    assert Muon(model).routing() == Muon(model.named_parameters()).routing()
    experts = model.model.layers[1].mlp.experts
    before = {k: v.detach().clone() for k, v in _expert_matrices(experts, lambda p: p).items()}
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    model(tokens, labels=tokens).loss.backward()
    grads = _expert_matrices(experts, lambda p: p.grad)
    reference = {k: nn.Parameter(v.clone()) for k, v in before.items()}
    for name, param in reference.items():
        param.grad = grads[name].clone()
    optimizer.step()
    with newton_schulz_dtype("float32"):
        torch.optim.Muon(list(reference.values()), **HYPERPARAMETERS).step()
    for name, ours in _expert_matrices(experts, lambda p: p.detach()).items():
        if grads[name].abs().sum() > 0:  # an expert no token chose has no gradient to orthogonalize
            assert not torch.equal(ours, before[name]), name
        assert torch.equal(ours, reference[name].detach()), name


@pytest.mark.parametrize("family", ["Qwen2Moe", "Qwen3Moe"])
def test_qwen_mixtures_of_experts_route_their_stacks_and_routers(family):
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, f"{family}Config")(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts=4,
        num_experts_per_tok=2,
    )
    model = getattr(transformers, f"{family}ForCausalLM")(config)
    routing = Muon(model.named_parameters()).routing()
    assert routing["muon_expert_stacks"] == 2 and routing["experts"] == [4]
    assert routing["routers"]["adamw"] == ["model.layers.0.mlp.gate.weight"]
    assert Muon(model).routing() == routing


@pytest.mark.parametrize("clone", [copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o))])
def test_copies_keep_the_stacks(clone):
    net = _net()
    optimizer = Muon(net, ns_dtype="float32")
    copied_net, copied = clone((net, optimizer))
    assert copied.routing() == optimizer.routing()
    assert copied._muon.expert_stacks[copied_net["mlp"].experts.gate_up_proj].split


@pytest.mark.parametrize("corrected", [False, True])
def test_a_resumed_state_dict_continues_the_trajectory(corrected):
    """The state dict is torch's: one momentum buffer per stack, shaped like it; resuming gives the same bits."""

    def build(net):
        muon = Muon(net, **HYPERPARAMETERS, ns_dtype="float32")
        return DelayCorrected(muon) if corrected else muon

    straight_net, resumed_net = _net(), _net()
    straight = build(straight_net)
    for step in range(2):
        _set_grads(straight_net, step)
        straight.step()
    saved = copy.deepcopy(straight.state_dict())
    names = [n for g in saved["param_groups"] for n in g["param_names"]]
    momentum = saved["state"][names.index("mlp.experts.gate_up_proj")]["momentum_buffer"]
    assert momentum.shape == straight_net["mlp"].experts.gate_up_proj.shape
    resumed_net.load_state_dict(straight_net.state_dict())
    resumed = build(resumed_net)
    resumed.load_state_dict(saved)
    for step in range(2, 4):
        for net, optimizer in ((straight_net, straight), (resumed_net, resumed)):
            _set_grads(net, step)
            optimizer.step()
    for (name, ours), theirs in zip(resumed_net.named_parameters(), straight_net.parameters()):
        assert torch.equal(ours, theirs), name


def test_experts_kept_as_a_list_of_modules_are_matrices_and_their_router_goes_to_adamw():
    """The layout of transformers 4 (Mixtral's `block_sparse_moe.experts.0.w1`), and of models that keep experts
    as an `nn.ModuleList`: each expert's weights are ordinary matrices; the router beside them is recognized."""
    torch.manual_seed(0)
    experts = nn.ModuleList(
        nn.ModuleDict({"w1": nn.Linear(HIDDEN, INNER), "w2": nn.Linear(INNER, HIDDEN)}) for _ in range(5)
    )
    moe = nn.ModuleDict({"gate": nn.Linear(HIDDEN, 5, bias=False), "experts": experts})
    net = nn.ModuleDict({"moe": moe, "other": nn.Linear(HIDDEN, 5, bias=False)})  # (5, 16) but not beside them
    routing = Muon(net.named_parameters()).routing()
    assert routing["routers"]["adamw"] == ["moe.gate.weight"]
    assert routing["muon_tensors"] == 2 * 5 + 1 and routing["muon_expert_stacks"] == 0
