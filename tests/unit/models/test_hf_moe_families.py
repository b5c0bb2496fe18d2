"""Mixtures of experts accepted by their structure: each family's objective and gradients against transformers'
own ``.loss``, the proof's refusal of an objective that differs, and where Muon sends experts and routers."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from lightning_async_pp.models import CausalLM, hf_moe, hf_structure  # noqa: E402
from lightning_async_pp.optim import Muon  # noqa: E402
from lightning_async_pp.runtime.contract import run_layers  # noqa: E402
from tests.fixtures.hf_models import MOE_CONFIGS, tiny_causal_lm, token_batches  # noqa: E402
from tests.unit.models.test_hf import hf_twin, materialized  # noqa: E402

WITHOUT_ROUTER_TERMS = ("deepseek_v3", "glm4_moe", "hunyuan_v1_moe")
"""Families whose ``.loss`` in transformers 5.24 is the language-model loss alone (no load-balancing term)."""


def _objective_and_gradients(family: str, padding: bool):
    model = materialized(family)
    twin = hf_twin(model).train()
    batch = token_batches(1, batch_size=3, seq=20, seed=3, padding=padding)[0]
    labels = batch.get("labels", batch["input_ids"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)  # PhiMoE's router jitter draws the same numbers on both sides
        output = run_layers(model.layers, batch["input_ids"], batch)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        theirs = twin(**{**batch, "labels": labels})
    return model, twin, batch, output, theirs


@pytest.mark.parametrize("family", sorted(MOE_CONFIGS))
def test_objective_and_gradients_equal_the_hf_models_own_loss(family, padding=True):
    """The pipeline layers in order, with the family's router terms, give transformers' ``.loss`` and gradients."""
    model, twin, batch, output, theirs = _objective_and_gradients(family, padding)
    if family in WITHOUT_ROUTER_TERMS:
        assert model.router_loss is None and getattr(theirs, "aux_loss", None) is None
    else:
        assert model.router_loss is not None
        # The routers' loss moves the gradients by more than the tolerance: leaving it out would fail below.
        weight = model.router_loss.coefficient
        trained = [p for p in twin.parameters() if p.requires_grad]
        moved = torch.autograd.grad(weight * theirs.aux_loss, trained, retain_graph=True, allow_unused=True)
        assert max(float(g.abs().max()) for g in moved if g is not None) > 1e-3
        torch.testing.assert_close(model.router_loss(output[1:]), theirs.aux_loss, rtol=0, atol=1e-6)
    labels = batch.get("labels", batch["input_ids"])
    torch.testing.assert_close(model.objective.value(output, labels), theirs.loss, rtol=0, atol=1e-6)
    model.pipeline_loss(output, batch).backward()
    theirs.loss.backward()
    expected = dict(twin.named_parameters())
    for name, param in model.named_parameters():
        if not param.requires_grad:  # ERNIE's score-correction bias
            continue
        hf_name = model.hf_name(name)
        torch.testing.assert_close(
            param.grad, expected[hf_name].grad, rtol=0, atol=1e-6, msg=lambda m: f"{hf_name}: {m}"
        )


class _Halved(hf_moe.RouterLoss):
    def attach(self, loss, totals):
        return hf_moe.attach_auxiliary_loss(loss, self(totals), weight=self.coefficient / 2)


@pytest.mark.parametrize("planted", ["value", "gradient"])
def test_the_proof_refuses_a_family_whose_objective_differs_with_what_differs(monkeypatch, planted):
    """A router term left out of the objective, or one whose gradient is not the objective's, is refused when the
    model is built, naming what differed."""
    found = hf_moe.load_balancing

    def planted_loss(model):
        loss = found(model)
        return None if planted == "value" else _Halved(loss.num_experts, loss.top_k, loss.coefficient)

    monkeypatch.setattr(hf_moe, "load_balancing", planted_loss)
    monkeypatch.setattr(hf_structure, "_PROVEN", {})
    message = "the pipeline's objective is .* and transformers' .loss" if planted == "value" else "the gradient of "
    with pytest.raises(ValueError, match=f"cannot prove its cut of model_type='olmoe'.*{message}"):
        tiny_causal_lm("olmoe")


def test_a_stage_without_any_sparse_layer_hands_the_hidden_states_or_the_totals_on():
    """ERNIE-4.5-MoE's first layer is dense: it sends the hidden states alone; later layers send the totals."""
    model = materialized("ernie4_5_moe")
    ids = token_batches(1, batch_size=2, seq=8)[0]["input_ids"]
    hidden = model.layers[1](model.layers[0](ids), {"input_ids": ids})
    assert isinstance(hidden, torch.Tensor)  # dense layer 0, before any sparse one
    assert isinstance(model.layers[2](hidden, {"input_ids": ids}), tuple)


def test_mixture_of_experts_configurations_are_not_refused_by_name():
    model = CausalLM(model_type="olmoe", config=MOE_CONFIGS["olmoe"])
    assert model.router_loss is not None and model.router_loss.num_experts == 4


MUON_EXPERTS = sorted(set(MOE_CONFIGS) - {"dbrx"})
"""DBRX keeps each expert's matrices flattened into one (experts x inner, hidden) matrix, which Muon cannot tell
from a dense one: train it with AdamW (docs/user-guide.md section 11)."""


@pytest.mark.parametrize("family", MUON_EXPERTS)
def test_muon_takes_routed_and_shared_experts_as_matrices_and_leaves_routers_to_adamw(family):
    model = tiny_causal_lm(family)
    optimizer = Muon(model, lr=0.02)
    routing = optimizer.routing()
    sparse = [m for m in model.layers if isinstance(m, hf_moe.RoutedDecoderLayer) and m.sparse]
    experts = model.hf_config.to_dict().get("ffn_config", {}).get("moe_num_experts") or 4
    experts = 8 if family in ("deepseek_v3", "glm4_moe") else experts
    assert routing["experts"] == [experts]
    router_names = [  # (experts, hidden) matrices that are not an experts module's own (GPT-OSS's biases)
        name
        for name, p in model.named_parameters()
        if tuple(p.shape) == (experts, 32) and "." in name.rpartition(".experts.")[2]
    ]
    assert router_names and sorted(routing["routers"]["adamw"]) == sorted(router_names)
    assert not routing["routers"]["muon"]
    assert sparse or family in WITHOUT_ROUTER_TERMS


def test_routing_statistics_count_the_experts_the_family_routes_to():
    """DeepSeek-V3 routes by grouped sigmoid scores and a bias, not by the top-k of a softmax: the logged counts are
    the experts its gates chose (read here from the gates of transformers' own model), padding excluded."""
    model = materialized("deepseek_v3")
    twin = hf_twin(model)
    with torch.no_grad():  # a score-correction bias that changes the choice, on both models
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.linspace(-1.0, 1.0, buffer.numel()))
    twin.load_state_dict(model.hf_state_dict())
    batch = token_batches(1, batch_size=4, seq=12, seed=7, padding=True)[0]
    model.train()
    model.pipeline_loss(run_layers(model.layers, batch["input_ids"], batch), batch)
    logged = model.router_statistics.metrics()
    chosen, logits = {}, {}

    def record(index):
        def hook(module, args, output) -> None:  # the gate returns (logits, weights, indices)
            logits[index], chosen[index] = output[0], output[2]

        return hook

    for index, layer in enumerate(twin.model.layers):
        if hasattr(layer.mlp, "experts"):
            layer.mlp.gate.register_forward_hook(record(index))
    twin(**batch)
    kept = batch["attention_mask"].reshape(-1).double()
    assert sorted(chosen) == [1, 2]  # the first layer is dense
    for layer, indices in chosen.items():
        counts = (torch.nn.functional.one_hot(indices, 8).sum(1).double() * kept[:, None]).sum(0)
        probability = (logits[layer].double().softmax(-1) * kept[:, None]).sum(0)
        tokens = float(kept.sum())
        expected = {
            "max_share": float(counts.max() / counts.sum()),
            "idle_experts": float((counts == 0).sum()),
            "balance_loss": float(8 * (counts / tokens * probability / tokens).sum()),
            "z_loss": float((logits[layer].double().logsumexp(-1) ** 2 * kept).sum() / tokens),
        }
        for key, value in expected.items():
            assert float(logged[f"moe/layer{layer}/{key}"]) == pytest.approx(value, abs=1e-5), (layer, key)
    assert model.router_statistics.metrics() == {}  # a step's sums are logged once
