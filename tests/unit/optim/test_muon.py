"""`lightning_async_pp.optim.Muon` against `torch.optim.Muon` + `torch.optim.AdamW` run side by side."""

from __future__ import annotations

import copy
import io
import math
import pickle

import pytest
import torch

from lightning_async_pp.optim import Muon
from lightning_async_pp.optim.muon import newton_schulz_dtype


@pytest.fixture(autouse=True)
def torch_precision():
    # These tests check the plumbing against torch.optim.Muon, whose Newton-Schulz runs in bfloat16; Muon's
    # "auto" picks float32 on CPU (tests/unit/optim/test_muon_precision.py).
    with newton_schulz_dtype("bfloat16"):
        yield


MUON_KWARGS = {"lr": 0.02, "weight_decay": 0.05, "momentum": 0.9, "nesterov": True, "ns_steps": 5}
ADAMW_KWARGS = {"lr": 3e-3, "betas": (0.8, 0.9), "eps": 1e-6, "weight_decay": 0.02}


def ours_kwargs(**overrides):
    adamw = {f"adamw_{k}": v for k, v in ADAMW_KWARGS.items()}
    return {**MUON_KWARGS, **adamw, **overrides}


def tiny_params(seed: int = 0) -> dict[str, torch.nn.Parameter]:
    """A GPT-like set: embedding and head (2-D, AdamW by name), hidden matrices, norms and biases."""
    generator = torch.Generator().manual_seed(seed)
    shapes = {
        "embed.weight": (11, 8),
        "blocks.0.attn.qkv.weight": (24, 8),
        "blocks.0.attn.qkv.bias": (24,),
        "blocks.0.ln.weight": (8,),
        "blocks.0.mlp.fc.weight": (8, 16),
        "blocks.0.mlp.proj.weight": (16, 8),
        "lm_head.weight": (11, 8),
    }
    return {name: torch.nn.Parameter(torch.randn(shape, generator=generator) * 0.3) for name, shape in shapes.items()}


def is_hidden(name: str, param: torch.Tensor) -> bool:
    return param.ndim == 2 and not any(key in name for key in ("embed", "lm_head"))


def set_grads(params, step: int, seed: int = 1) -> None:
    """Deterministic gradients that depend on the weights, so a wrong update changes later gradients."""
    generator = torch.Generator().manual_seed(seed * 1000 + step)
    for param in params:
        noise = torch.randn(param.shape, generator=generator)
        param.grad = (param.detach() * 0.5 + noise).to(param.dtype)


def reference_parts(params: dict[str, torch.nn.Parameter], muon_kwargs=MUON_KWARGS, adamw_kwargs=ADAMW_KWARGS):
    hidden = [p for n, p in params.items() if is_hidden(n, p)]
    others = [p for n, p in params.items() if not is_hidden(n, p)]
    return torch.optim.Muon(hidden, **muon_kwargs), torch.optim.AdamW(others, **adamw_kwargs)


def clone_params(params: dict[str, torch.nn.Parameter]) -> dict[str, torch.nn.Parameter]:
    return {name: torch.nn.Parameter(p.detach().clone()) for name, p in params.items()}


@pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw"])
def test_parts_match_torch_muon_and_adamw(adjust_lr_fn):
    ours_params = tiny_params()
    ref_params = clone_params(ours_params)
    ours = Muon(ours_params.items(), **ours_kwargs(adjust_lr_fn=adjust_lr_fn))
    ref_muon, ref_adamw = reference_parts(ref_params, {**MUON_KWARGS, "adjust_lr_fn": adjust_lr_fn})

    for step in range(10):
        set_grads(ours_params.values(), step)
        set_grads(ref_params.values(), step)
        ours.step()
        ref_muon.step()
        ref_adamw.step()

    for name in ours_params:
        torch.testing.assert_close(ours_params[name], ref_params[name], atol=1e-6, rtol=0, msg=name)
        assert not torch.equal(ours_params[name], tiny_params()[name]), f"{name} was not updated"


def test_routing_by_shape_for_plain_tensors():
    params = tiny_params()
    optimizer = Muon(params.values())
    by_group = {g["use_muon"]: g["params"] for g in optimizer.param_groups}
    # Without names, embedding and head are 2-D matrices like any other.
    assert by_group[True] == [p for p in params.values() if p.ndim == 2]
    assert by_group[False] == [p for p in params.values() if p.ndim != 2]


def test_routing_by_name_sends_embedding_and_head_to_adamw():
    params = tiny_params()
    optimizer = Muon(params.items())
    names = {g["use_muon"]: g["param_names"] for g in optimizer.param_groups}
    assert names[True] == ["blocks.0.attn.qkv.weight", "blocks.0.mlp.fc.weight", "blocks.0.mlp.proj.weight"]
    assert names[False] == ["embed.weight", "blocks.0.attn.qkv.bias", "blocks.0.ln.weight", "lm_head.weight"]


def test_routing_with_custom_patterns():
    params = tiny_params()
    optimizer = Muon(params.items(), adamw_patterns=["*mlp*"])
    names = {g["use_muon"]: g["param_names"] for g in optimizer.param_groups}
    assert names[True] == ["embed.weight", "blocks.0.attn.qkv.weight", "lm_head.weight"]
    assert "blocks.0.mlp.fc.weight" in names[False]


def test_default_patterns_cover_the_demo_gpt_names():
    layers = {
        "layers.0.tok.weight": (11, 8),
        "layers.0.pos.weight": (6, 8),
        "layers.1.attn.qkv.weight": (24, 8),
        "layers.1.mlp.0.weight": (32, 8),
        "layers.2.lm_head.weight": (11, 8),
        "transformer.wte.weight": (11, 8),
        "model.embed_tokens.weight": (11, 8),
        "head.weight": (3, 8),
    }
    optimizer = Muon([(name, torch.nn.Parameter(torch.zeros(shape))) for name, shape in layers.items()])
    names = {g["use_muon"]: g["param_names"] for g in optimizer.param_groups}
    assert names[True] == ["layers.1.attn.qkv.weight", "layers.1.mlp.0.weight"]


def test_routing_by_use_muon_key_and_group_options():
    params = tiny_params()
    optimizer = Muon(
        [
            {"params": [params["embed.weight"], params["lm_head.weight"]], "use_muon": False, "lr": 1e-2},
            {"params": [params["blocks.0.attn.qkv.weight"]], "use_muon": True, "momentum": 0.5},
            # No key: split by shape; the group's option reaches both resulting groups.
            {"params": [params["blocks.0.mlp.fc.weight"], params["blocks.0.ln.weight"]], "weight_decay": 0.0},
        ],
        **ours_kwargs(),
    )
    groups = optimizer.param_groups
    assert [g["use_muon"] for g in groups] == [False, True, True, False]
    assert groups[0]["params"] == [params["embed.weight"], params["lm_head.weight"]]
    assert groups[0]["lr"] == 1e-2 and groups[0]["betas"] == ADAMW_KWARGS["betas"]
    assert groups[1]["momentum"] == 0.5 and groups[1]["lr"] == MUON_KWARGS["lr"]
    assert groups[2]["params"] == [params["blocks.0.mlp.fc.weight"]] and groups[2]["weight_decay"] == 0.0
    assert groups[3]["params"] == [params["blocks.0.ln.weight"]] and groups[3]["weight_decay"] == 0.0
    assert optimizer._muon.param_groups == [groups[1], groups[2]]
    assert optimizer._adamw.param_groups == [groups[0], groups[3]]
    for step in range(2):
        set_grads([p for g in groups for p in g["params"]], step)
        optimizer.step()


def test_forcing_muon_on_a_non_matrix_raises_with_the_name():
    params = tiny_params()
    with pytest.raises(ValueError, match=r"'blocks.0.ln.weight'.*shape \(8,\).*use_muon=False"):
        Muon([{"params": [("blocks.0.ln.weight", params["blocks.0.ln.weight"])], "use_muon": True}])
    with pytest.raises(ValueError, match=r"index 1 .*shape \(5,\)"):
        Muon([{"params": [params["embed.weight"], torch.nn.Parameter(torch.zeros(5))], "use_muon": True}])
    # A kernel may be forced onto Muon: it is updated as its matrix.
    Muon([{"params": [torch.nn.Parameter(torch.zeros(2, 3, 4))], "use_muon": True}])


def test_empty_muon_part_still_steps_like_adamw():
    params = tiny_params()
    stage = {n: p for n, p in params.items() if not is_hidden(n, p)}
    ref = clone_params(stage)
    ours = Muon(stage.items(), **ours_kwargs())
    reference = torch.optim.AdamW(ref.values(), **ADAMW_KWARGS)
    assert [g["use_muon"] for g in ours.param_groups] == [False]
    for step in range(3):
        set_grads(stage.values(), step)
        set_grads(ref.values(), step)
        ours.step()
        reference.step()
    for name in stage:
        torch.testing.assert_close(stage[name], ref[name], atol=1e-6, rtol=0)


def test_empty_adamw_part_still_steps_like_muon():
    params = tiny_params()
    stage = {n: p for n, p in params.items() if is_hidden(n, p)}
    ref = clone_params(stage)
    ours = Muon(stage.items(), **ours_kwargs())
    reference = torch.optim.Muon(ref.values(), **MUON_KWARGS)
    assert [g["use_muon"] for g in ours.param_groups] == [True]
    for step in range(3):
        set_grads(stage.values(), step)
        set_grads(ref.values(), step)
        ours.step()
        reference.step()
    for name in stage:
        torch.testing.assert_close(stage[name], ref[name], atol=1e-6, rtol=0)


def test_invalid_hyperparameters_are_refused():
    params = list(tiny_params().values())
    with pytest.raises(ValueError, match="Learning rate"):
        Muon(params, lr=-1.0)
    with pytest.raises(ValueError, match="beta"):
        Muon(params, adamw_betas=(1.5, 0.9))
    with pytest.raises(ValueError, match="not supported"):
        Muon(params, adjust_lr_fn="nope")
    with pytest.raises(ValueError, match="empty parameter list"):
        Muon([])
    with pytest.raises(ValueError, match="more than one parameter group"):
        Muon([{"params": params[:2]}, {"params": params[1:3]}])


def test_closure_is_called_once_and_its_result_returned():
    params = tiny_params()
    optimizer = Muon(params.items())
    calls = []

    def closure():
        calls.append(1)
        set_grads(params.values(), 0)
        return torch.tensor(3.0)

    assert optimizer.step(closure) == 3.0
    assert len(calls) == 1


def cosine(step: int, base: float, t_max: int = 4, eta_min: float = 0.0) -> float:
    return eta_min + (base - eta_min) * (1 + math.cos(math.pi * step / t_max)) / 2


@pytest.mark.parametrize("schedule", ["lambda", "cosine"])
def test_lr_scheduler_drives_both_parts(schedule):
    ours_params = tiny_params()
    ref_params = clone_params(ours_params)
    ours = Muon(ours_params.items(), **ours_kwargs())
    if schedule == "lambda":
        scheduler = torch.optim.lr_scheduler.LambdaLR(ours, lambda step: 1.0 / (1 + step) ** 2)

        def lr_at(step, base):
            return base / (1 + step) ** 2
    else:
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(ours, T_max=4)
        lr_at = cosine
    ref_muon, ref_adamw = reference_parts(ref_params)

    for step in range(5):
        ref_muon.param_groups[0]["lr"] = lr_at(step, MUON_KWARGS["lr"])
        ref_adamw.param_groups[0]["lr"] = lr_at(step, ADAMW_KWARGS["lr"])
        set_grads(ours_params.values(), step)
        set_grads(ref_params.values(), step)
        ours.step()
        ref_muon.step()
        ref_adamw.step()
        scheduler.step()

    for name in ours_params:
        torch.testing.assert_close(ours_params[name], ref_params[name], atol=1e-6, rtol=0, msg=name)


def run(params, optimizer, steps: range) -> None:
    for step in steps:
        set_grads(params.values(), step)
        optimizer.step()


def test_state_dict_round_trip_continues_bitwise():
    params = tiny_params()
    optimizer = Muon(params.items(), **ours_kwargs())
    run(params, optimizer, range(3))

    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    resumed_params = clone_params(params)
    resumed = Muon(resumed_params.items(), **ours_kwargs(lr=0.5, adamw_lr=0.5))  # overwritten by the load
    buffer.seek(0)
    resumed.load_state_dict(torch.load(buffer))

    run(params, optimizer, range(3, 7))
    run(resumed_params, resumed, range(3, 7))
    for name in params:
        assert torch.equal(params[name], resumed_params[name]), name
    assert resumed._muon.state is resumed.state and resumed._adamw.state is resumed.state
    assert resumed._muon.param_groups[0] is resumed.param_groups[0]


def test_load_state_dict_refuses_differently_routed_groups():
    params = tiny_params()
    saved = Muon(params.items()).state_dict()
    other = Muon(params.items())
    saved["param_groups"] = saved["param_groups"][::-1]
    with pytest.raises(ValueError, match="same parameters"):
        other.load_state_dict(saved)


@pytest.mark.parametrize("clone", [copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o))])
def test_copies_keep_both_parts_wired(clone):
    params = tiny_params()
    optimizer = Muon(params.items(), **ours_kwargs())
    run(params, optimizer, range(2))
    copied = clone(optimizer)
    assert copied._muon.state is copied.state
    assert all(a is b for a, b in zip(copied._adamw.param_groups, copied.param_groups[1:]))
    copied.param_groups[0]["lr"] = 0.0
    assert copied._muon.param_groups[0]["lr"] == 0.0


def test_add_param_group_routes_new_parameters():
    params = tiny_params()
    names = list(params)
    optimizer = Muon([(n, params[n]) for n in names[:2]])
    optimizer.add_param_group({"params": [(n, params[n]) for n in names[2:]], "lr": 1e-3})
    assert [g["use_muon"] for g in optimizer.param_groups] == [True, False, True, False]
    assert optimizer._muon.param_groups == optimizer.param_groups[0::2]
    run(params, optimizer, range(1))
    assert len(optimizer.state) == len(params)


# --- convolution kernels -------------------------------------------------------------------------------------


def conv_params(seed: int = 0) -> dict[str, torch.nn.Parameter]:
    """A Conv1d and a Conv2d kernel (with biases) and a head matrix."""
    generator = torch.Generator().manual_seed(seed)
    shapes = {
        "conv1.weight": (6, 3, 5),
        "conv1.bias": (6,),
        "conv2.weight": (4, 6, 3, 3),
        "conv2.bias": (4,),
        "fc.weight": (3, 4),
    }
    return {name: torch.nn.Parameter(torch.randn(shape, generator=generator) * 0.3) for name, shape in shapes.items()}


@pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw"])
def test_conv_kernels_get_muon_on_their_flattened_matrix(adjust_lr_fn):
    """Each kernel follows torch.optim.Muon run on the (out_channels, in_channels x kernel) matrix."""
    params = conv_params()
    ours = Muon(params.items(), **ours_kwargs(adjust_lr_fn=adjust_lr_fn))
    routed = {g["use_muon"]: g["param_names"] for g in ours.param_groups}
    assert routed[True] == ["conv1.weight", "conv2.weight", "fc.weight"]
    matrices = {
        n: torch.nn.Parameter(p.detach().reshape(p.shape[0], -1).clone()) for n, p in params.items() if p.ndim >= 2
    }
    reference = torch.optim.Muon(matrices.values(), **MUON_KWARGS, adjust_lr_fn=adjust_lr_fn)
    for step in range(4):
        set_grads(params.values(), step)
        for name, matrix in matrices.items():
            matrix.grad = params[name].grad.reshape(matrix.shape).clone()
        before = {n: params[n].detach().clone() for n in matrices}
        ours.step()
        reference.step()
        for name, matrix in matrices.items():
            kernel = params[name]
            assert kernel.shape != matrix.shape or kernel.ndim == 2
            torch.testing.assert_close(kernel.detach().reshape(matrix.shape), matrix.detach(), atol=1e-6, rtol=0)
            # The update, weight decay taken out, is orthogonalized: singular values near 1 (Newton-Schulz
            # with these coefficients lands in about [0.5, 1.5]), not those of the raw momentum.
            lr = MUON_KWARGS["lr"]
            decayed = before[name] * (1 - lr * MUON_KWARGS["weight_decay"])
            update = (decayed - kernel.detach()).reshape(matrix.shape)
            singular = torch.linalg.svdvals(update / update.norm() * min(update.shape) ** 0.5)
            assert singular.min() > 0.4 and singular.max() < 1.6, (name, singular)
    assert ours.state[params["conv2.weight"]]["momentum_buffer"].shape == params["conv2.weight"].shape


def test_channels_last_kernels_match_contiguous_ones():
    contiguous, channels_last = conv_params(), conv_params()
    kernel = channels_last["conv2.weight"]
    kernel.data = kernel.data.contiguous(memory_format=torch.channels_last)
    assert not kernel.is_contiguous()
    first, second = Muon(contiguous.items(), **ours_kwargs()), Muon(channels_last.items(), **ours_kwargs())
    for step in range(3):
        set_grads(contiguous.values(), step)
        set_grads(channels_last.values(), step)
        first.step()
        second.step()
    for name in contiguous:
        torch.testing.assert_close(channels_last[name], contiguous[name], atol=1e-6, rtol=0)
    assert not torch.equal(contiguous["conv2.weight"], conv_params()["conv2.weight"])


def test_muon_kernels_false_keeps_kernels_on_adamw():
    params = conv_params()
    ours = Muon(params.items(), **ours_kwargs(muon_kernels=False))
    routed = {g["use_muon"]: g["param_names"] for g in ours.param_groups}
    assert routed[True] == ["fc.weight"]
    ref = clone_params(params)
    reference = torch.optim.AdamW([p for n, p in ref.items() if n != "fc.weight"], **ADAMW_KWARGS)
    for step in range(3):
        set_grads([p for n, p in params.items()], step)
        set_grads([p for n, p in ref.items()], step)
        ours.step()
        reference.step()
    for name in ("conv1.weight", "conv2.weight", "conv1.bias"):
        torch.testing.assert_close(params[name], ref[name], atol=1e-6, rtol=0)


def test_tokens_of_more_than_two_dims_with_one_row_stay_on_adamw():
    # A ViT's cls_token (1, 1, D) or pos_embed (1, N, D) is not a kernel, even without a matching name.
    params = [
        ("cls", torch.nn.Parameter(torch.zeros(1, 1, 8))),
        ("conv.weight", torch.nn.Parameter(torch.zeros(4, 2, 3))),
    ]
    names = {g["use_muon"]: g["param_names"] for g in Muon(params).param_groups}
    assert names == {True: ["conv.weight"], False: ["cls"]}


def test_kernel_state_dict_round_trip_continues_bitwise():
    params = conv_params()
    optimizer = Muon(params.items(), **ours_kwargs())
    run(params, optimizer, range(2))
    saved_params = {n: p.detach().clone() for n, p in params.items()}
    state = copy.deepcopy(optimizer.state_dict())
    run(params, optimizer, range(2, 4))
    restored = {n: torch.nn.Parameter(p.clone()) for n, p in saved_params.items()}
    again = Muon(restored.items(), **ours_kwargs())
    again.load_state_dict(state)
    run(restored, again, range(2, 4))
    for name in params:
        assert torch.equal(params[name], restored[name]), name


# --- routing by module type, and what the routing says -------------------------------------------------------


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(10, 8)
        self.blocks = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Conv1d(8, 8, 3), torch.nn.LayerNorm(8))
        self.classifier = torch.nn.Linear(8, 3)


def test_routing_by_module_type_and_name():
    net = _Net()
    for modules in ([torch.nn.Embedding], ["torch.nn.Embedding"], "torch.nn.Embedding"):
        optimizer = Muon(net, adamw_modules=modules, adamw_patterns=["classifier.*"])
        names = {g["use_muon"]: g["param_names"] for g in optimizer.param_groups}
        assert names[True] == ["blocks.0.weight", "blocks.1.weight"]
        assert names[False][:1] == ["tok.weight"] and "classifier.weight" in names[False]
    # Without the type rule the embedding's name does not match a default pattern ("tok" only as "*tok.*").
    assert "tok.weight" in Muon(net, adamw_patterns=[]).param_groups[0]["param_names"]


def test_routing_by_module_type_needs_the_module():
    net = _Net()
    with pytest.raises(TypeError, match=r"Muon\(model, \.\.\.\)"):
        Muon(net.named_parameters(), adamw_modules=[torch.nn.Embedding])
    with pytest.raises(TypeError, match="cannot be imported"):
        Muon(net, adamw_modules=["torch.nn.Embeding"])
    with pytest.raises(TypeError, match="nn.Module classes"):
        Muon(net, adamw_modules=["torch.optim.AdamW"])


def test_describe_routing_counts_both_parts_and_names_matrices_on_adamw():
    net = _Net()
    optimizer = Muon(net, adamw_modules=[torch.nn.Embedding], adamw_patterns=["classifier.*"])
    routing = optimizer.routing()
    muon_numel = net.blocks[0].weight.numel() + net.blocks[1].weight.numel()
    assert routing["muon_tensors"] == 2 and routing["muon_numel"] == muon_numel and routing["muon_kernels"] == 1
    assert routing["adamw_numel"] == sum(p.numel() for p in net.parameters()) - muon_numel
    assert routing["adamw_matrices"] == ["tok.weight", "classifier.weight"]
    line = optimizer.describe_routing()
    assert line.startswith(
        f"Muon 2 tensors ({muon_numel:,} parameters, 1 conv kernels as matrices; Newton-Schulz in bfloat16, batched"
        " in 2 groups), AdamW"
    )
    assert line.endswith("matrices on AdamW: tok.weight, classifier.weight")
    # Unnamed tensors are numbered over all of the optimizer's parameters.
    plain = Muon([torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3, 3))], muon_kernels=False)
    assert plain.routing()["muon_tensors"] == 1
    forced = Muon([{"params": [torch.nn.Parameter(torch.zeros(3, 3))], "use_muon": False}])
    assert forced.routing()["adamw_matrices"] == ["#0"]
