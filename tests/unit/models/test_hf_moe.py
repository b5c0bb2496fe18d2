"""Hugging Face mixtures of experts through the pipeline: the routers' loss against transformers' own."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM  # noqa: E402

from lightning_async_pp import AsyncPipelineStrategy  # noqa: E402
from lightning_async_pp.models import CausalLM  # noqa: E402
from lightning_async_pp.runtime.contract import run_layers  # noqa: E402
from tests.fixtures.helpers import fit  # noqa: E402
from tests.fixtures.hf_models import (  # noqa: E402
    CONFIGS,
    MOE_FAMILIES,
    adamw,
    plain_hf_training,
    sgd,
    tiny_causal_lm,
    token_batches,  # noqa: E402
)
from tests.unit.models.test_hf import (  # noqa: E402
    assert_same_weights,
    hf_twin,
    materialized,
    run_pipeline,
    single_device,
)


def router_weights(model) -> list[torch.nn.Parameter]:
    return [p for name, p in model.named_parameters() if name.endswith("mlp.gate.weight")]


@pytest.mark.parametrize("padding", [False, True], ids=["dense", "padded"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_loss_routers_loss_and_gradients_equal_the_hf_models_own(family, padding):
    """The adapter's loss is the language-model loss, and its backward adds ``router_aux_loss_coef`` times the
    routers' loss, as transformers' ``.loss`` (with ``output_router_logits=True``) does."""
    model = materialized(family)
    twin = hf_twin(model)
    batch = token_batches(1, batch_size=3, seq=20, seed=3, padding=padding)[0]
    output = run_layers(model.layers, batch["input_ids"], batch)
    loss = model.pipeline_loss(output, batch)
    theirs = twin(**{"labels": batch["input_ids"], **batch})
    coefficient = CONFIGS[family]["router_aux_loss_coef"]
    # The routers' loss moves the routers' gradients by more than the tolerance: leaving it out would fail below.
    aux_grads = torch.autograd.grad(coefficient * theirs.aux_loss, router_weights(twin), retain_graph=True)
    assert max(float(g.abs().max()) for g in aux_grads) > 1e-3
    loss.backward()
    theirs.loss.backward()

    torch.testing.assert_close(loss + coefficient * model.router_loss(output[1:]), theirs.loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(model.router_loss(output[1:]), theirs.aux_loss, rtol=0, atol=1e-6)
    expected = dict(twin.named_parameters())
    for name, param in model.named_parameters():
        hf_name = model.hf_name(name)
        torch.testing.assert_close(
            param.grad, expected[hf_name].grad, rtol=0, atol=1e-6, msg=lambda m: f"{hf_name}: {m}"
        )
    torch.testing.assert_close(model(batch), theirs.logits, rtol=0, atol=1e-6)  # forward() gives the logits alone


def test_one_device_1f1b_equals_plain_hf_training_and_logs_the_routers_loss():
    steps, microbatches = 6, 2
    batches = token_batches(steps, padding=True)
    model = tiny_causal_lm("qwen2_moe", optimizer=adamw)
    twin = hf_twin(materialized("qwen2_moe"))
    losses = fit(model, batches, strategy=AsyncPipelineStrategy(schedule="1f1b", num_microbatches=microbatches))
    aux: list[float] = []
    expected = plain_hf_training(twin, batches, microbatches, aux_losses=aux)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    logged = model.trainer.callback_metrics["train/aux_loss"]  # the last step's mean over micro-batches
    torch.testing.assert_close(float(logged), aux[-1], rtol=1e-5, atol=1e-6)
    final = twin.state_dict()
    for name, value in model.hf_state_dict().items():
        torch.testing.assert_close(value, final[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_without_the_strategy_training_step_trains_the_routers_loss_scaled_for_accumulation():
    """Plain Lightning (``training_step``, two batches accumulated) equals transformers' loop on their union."""
    steps = 6
    batches = token_batches(steps * 2, batch_size=4, padding=True)
    model = tiny_causal_lm("mixtral", optimizer=adamw)
    twin = hf_twin(materialized("mixtral"))
    fit(model, batches, max_steps=steps, accumulate_grad_batches=2)
    union = [{k: torch.cat([a[k], b[k]]) for k in a} for a, b in zip(batches[::2], batches[1::2])]
    plain_hf_training(twin, union, microbatches=2)
    final = twin.state_dict()
    for name, value in model.hf_state_dict().items():
        torch.testing.assert_close(value, final[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert "train/aux_loss" in model.trainer.callback_metrics


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_a_stage_reads_its_stacked_experts_from_the_per_expert_tensors_save_pretrained_writes(tmp_path, family):
    source = hf_twin(materialized(family))
    for parameter in source.parameters():  # weights unlike any fresh initialisation
        parameter.data.add_(torch.randn_like(parameter) * 0.05)
    source.save_pretrained(tmp_path)
    stage = CausalLM(pretrained=str(tmp_path))
    stage.layers[2].to_empty(device="cpu")  # a stage that holds decoder layer 1 only
    stage.reset_pipeline_layer(2, stage.layers[2])

    loaded = stage.hf_state_dict()
    assert any(name.endswith("experts.gate_up_proj") for name in loaded)
    expected = source.state_dict()
    for name, value in loaded.items():
        assert name.startswith("model.layers.1."), name
        assert torch.equal(value, expected[name]), name
    read = stage.checkpoint.read
    assert read and all(".layers.1." in key for key in read) and len(read) == len(set(read))


def test_a_checkpoint_written_as_a_save_pretrained_folder_loads_in_transformers_and_back(tmp_path):
    from lightning_async_pp.models.hf import save_pretrained

    model = materialized("qwen2_moe")
    checkpoint = {"state_dict": model.state_dict()}
    model.on_save_checkpoint(checkpoint)
    save_pretrained(checkpoint, tmp_path)
    expected = model.hf_state_dict()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    again = CausalLM(pretrained=str(tmp_path))
    again.configure_model()
    assert again.router_loss is not None  # output_router_logits is part of the saved configuration
    for name, value in expected.items():
        assert torch.equal(loaded[name], value) and torch.equal(again.hf_state_dict()[name], value), name


def test_mixture_of_experts_settings_the_adapter_cannot_train_are_refused():
    with pytest.raises(ValueError, match="no sparse layer"):
        CausalLM(model_type="qwen2_moe", config=dict(CONFIGS["qwen2_moe"], mlp_only_layers=[0, 1, 2]))
    model = materialized("mixtral")
    batch = {"input_ids": torch.zeros(2, 4, dtype=torch.long), "attention_mask": torch.zeros(2, 1, 4, 4)}
    with pytest.raises(ValueError, match="2D padding mask"):
        model.pipeline_loss(run_layers(model.layers, batch["input_ids"], batch), batch)


def test_without_output_router_logits_it_trains_the_language_model_loss_alone():
    """transformers leaves the routers' loss out of ``.loss`` then; so does the adapter (no totals travel)."""
    with pytest.warns(UserWarning, match="set output_router_logits=True"):
        model = CausalLM(model_type="mixtral", config=dict(CONFIGS["mixtral"], output_router_logits=False))
    model.configure_model()
    assert model.router_loss is None
    twin = AutoModelForCausalLM.from_config(model.hf_config)
    twin.load_state_dict(model.hf_state_dict())
    batch = token_batches(1, batch_size=2, seq=12)[0]
    output = run_layers(model.layers, batch["input_ids"], batch)
    assert isinstance(output, tuple) and len(output) == 2  # the logits and the routing statistics, no totals
    torch.testing.assert_close(
        model.pipeline_loss(output, batch), twin(**batch, labels=batch["input_ids"]).loss, rtol=0, atol=1e-6
    )


# --- multi-process pipelines ------------------------------------------------------------------------------


@pytest.mark.multiprocess
def test_1f1b_three_stages_with_padding_and_clipping_equals_plain_hf_training(tmp_path):
    """Qwen2-MoE on stages [embedding, sparse layer 0], [dense layer 1], [sparse layer 2, head]: the routers'
    totals cross both boundaries forward, through a stage that only hands them on, and the gradient of their
    loss crosses them backward to the first router."""
    steps, microbatches, clip = 6, 2, 0.5
    args = ["--family", "qwen2_moe", "--devices", "3", "--schedule", "1f1b", "--microbatches", str(microbatches)]
    result, weights, _ = run_pipeline(tmp_path, *args, "--steps", str(steps), "--padding", "--clip", str(clip))
    twin = hf_twin(materialized("qwen2_moe"))
    aux: list[float] = []
    expected = plain_hf_training(twin, token_batches(steps, padding=True), microbatches, aux_losses=aux, clip=clip)
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(result["aux_losses"]), torch.tensor(aux), rtol=1e-5, atol=1e-6)
    final = twin.state_dict()
    assert sorted(weights) == sorted(final)
    # AdamW divides by sqrt(v): for an element whose gradient is near zero (a k_proj bias), the last-bit difference
    # of a sum taken across three stages instead of one process grows to about 1.5e-6 in 6 steps.
    assert_same_weights(weights, final, atol=2e-6)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_2bw_two_stages_with_clipping_equals_the_single_device_delayed_path(tmp_path):
    """Qwen3-MoE on stages [embedding, dense layer 0, sparse layer 1], [dense layer 2, head]."""
    steps, microbatches = 6, 4
    args = ["--family", "qwen3_moe", "--devices", "2", "--schedule", "2bw", "--microbatches", str(microbatches)]
    extra = ["--steps", str(steps), "--clip", "0.5", "--optimizer", "corrected_muon"]
    result, weights, _ = run_pipeline(tmp_path, *args, *extra)
    losses, model = single_device("qwen3_moe", "2bw", microbatches, token_batches(steps), gradient_clip_val=0.5)
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(losses), rtol=1e-5, atol=1e-6)
    assert len(result["aux_losses"]) == steps
    assert_same_weights(weights, model.hf_state_dict())


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_replicas_with_sharded_optimizer_state_equal_plain_hf_training_on_their_union(tmp_path):
    """Each replica keeps the optimizer state of part of the tensors, stacked experts included; the replicas'
    mean gradient is the one of the union of their batches. (SGD: with AdamW, whose first steps divide each gradient
    by its own magnitude, one expert weight of 16384 differed by 1.2e-6, just above the tolerance.)"""
    from torch.utils.data import DistributedSampler

    steps, microbatches, replicas = 4, 2, 2
    args = ["--family", "mixtral", "--devices", str(replicas), "--pipeline-size", "1", "--shard-optimizer"]
    args += ["--optimizer", "sgd"]
    _, weights, _ = run_pipeline(tmp_path, *args, "--microbatches", str(microbatches), "--steps", str(steps))
    items = token_batches(steps * replicas)
    shards = [list(DistributedSampler(items, replicas, rank, shuffle=True, seed=0)) for rank in range(replicas)]
    union = [{k: torch.cat([items[s[t]][k] for s in shards]) for k in items[0]} for t in range(steps)]
    twin = hf_twin(materialized("mixtral"))
    plain_hf_training(twin, union, microbatches * replicas, make_optimizer=sgd)
    assert_same_weights(weights, twin.state_dict())
