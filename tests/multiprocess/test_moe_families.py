"""Mixtures of experts accepted by their structure, trained on 2 stages under 2BW from a save_pretrained folder:
transformers' own loop on the delayed weights."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM  # noqa: E402

from tests.fixtures.hf_models import adamw, plain_hf_training, token_batches  # noqa: E402
from tests.unit.models.test_hf import assert_same_weights, hf_twin, materialized, run_pipeline  # noqa: E402

pytestmark = pytest.mark.multiprocess


def router_metrics(microbatches: list, top_k: int) -> dict[str, float]:
    """Per sparse layer, what its routing did over a step's micro-batches, from transformers' router logits (GPT-OSS
    routes each token to the top-k of its logits)."""
    out = {}
    for layer in range(len(microbatches[0][0])):
        counts = probability = 0.0
        z = tokens = 0.0
        for layer_logits, mask in microbatches:
            logits = layer_logits[layer].double()
            kept = mask.reshape(-1).double()
            chosen = torch.nn.functional.one_hot(logits.topk(top_k).indices, logits.shape[-1]).sum(1)
            counts = counts + (chosen * kept[:, None]).sum(0)
            probability = probability + (logits.softmax(-1) * kept[:, None]).sum(0)
            z, tokens = z + float((logits.logsumexp(-1) ** 2 * kept).sum()), tokens + float(kept.sum())
        experts = counts.shape[0]
        out[f"moe/layer{layer}/max_share"] = float(counts.max() / counts.sum())
        out[f"moe/layer{layer}/idle_experts"] = float((counts == 0).sum())
        out[f"moe/layer{layer}/balance_loss"] = float(experts * ((counts / tokens) * (probability / tokens)).sum())
        out[f"moe/layer{layer}/z_loss"] = z / tokens
    return out


@pytest.mark.parametrize(
    "family, attention",
    # GPT-OSS: router loss, attention sinks, sliding windows, expert biases. DeepSeek-V3: a dense first layer,
    # shared experts, grouped sigmoid routing with its score-correction bias (a buffer, read from the folder), no
    # router term; save_pretrained writes its experts one by one.
    [("gpt_oss", "eager"), ("deepseek_v3", "sdpa")],
)
def test_2bw_two_stages_equal_transformers_own_loop_on_delayed_weights(tmp_path, family, attention):
    steps, microbatches = 6, 2
    twin = hf_twin(materialized(family))
    with torch.no_grad():  # weights unlike any fresh initialisation
        for parameter in twin.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
        for name, buffer in twin.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.linspace(-0.5, 0.5, buffer.numel()))
    twin.save_pretrained(tmp_path / "folder")
    twin = AutoModelForCausalLM.from_pretrained(tmp_path / "folder", attn_implementation=attention)
    args = ["--devices", "2", "--schedule", "2bw", "--microbatches", str(microbatches), "--steps", str(steps)]
    args += ["--pretrained", str(tmp_path / "folder"), "--attn-implementation", attention]
    result, weights, _ = run_pipeline(tmp_path / "run", *args, "--padding", "--log-metrics")
    aux: list[float] = []
    batches, logits = token_batches(steps, padding=True), []
    expected = plain_hf_training(
        twin, batches, microbatches, make_optimizer=adamw, aux_losses=aux, delayed=True, router_logits=logits
    )
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(expected), rtol=0, atol=2e-4)
    if family == "gpt_oss":  # the routers' loss, summed over the stages, is the one transformers adds
        assert len(result["aux_losses"]) == steps
        torch.testing.assert_close(torch.tensor(result["aux_losses"]), torch.tensor(aux), rtol=0, atol=2e-4)
        # What each layer's routing did, logged from the last stage, against transformers' own router logits.
        for step, microbatch_logits in enumerate(logits):
            logged = result["logged"][str(step)]
            for name, value in router_metrics(microbatch_logits, top_k=2).items():
                assert logged[name] == pytest.approx(value, abs=2e-4), (step, name)
    else:  # no router term; the routing statistics of its sparse layers (1 and 2) are logged all the same
        assert {f"moe/layer{d}/max_share" for d in (1, 2)} <= set(result["logged"][str(steps - 1)])
        assert "moe/layer0/max_share" not in result["logged"][str(steps - 1)]
    assert_same_weights(weights, twin.state_dict(), rtol=1e-4, atol=1e-4)  # AdamW's first steps magnify rounding
