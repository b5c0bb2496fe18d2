"""A ``save_pretrained`` folder read as ``transformers`` reads it: each family's key conversions, and back."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM  # noqa: E402

from lightning_async_pp.models import CausalLM  # noqa: E402
from lightning_async_pp.models.hf import save_pretrained  # noqa: E402
from tests.fixtures.hf_models import tiny_config, token_batches  # noqa: E402


def stored_keys(folder) -> set[str]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def hf_folder(folder, model_type: str, base: bool = False, **overrides):
    """A folder that ``save_pretrained`` of a tiny ``transformers`` model (``base``: its base model) wrote, with
    weights unlike any fresh initialisation."""
    config = AutoConfig.for_model(model_type, **{**tiny_config(model_type), **overrides})
    torch.manual_seed(0)
    model = (AutoModel if base else AutoModelForCausalLM).from_config(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    model.save_pretrained(folder)
    return folder


def assert_same_logits(ours: CausalLM, folder) -> None:
    theirs = AutoModelForCausalLM.from_pretrained(folder)
    batch = token_batches(1, batch_size=2, seq=12, seed=1)[0]
    torch.testing.assert_close(ours(batch), theirs(**batch).logits, rtol=0, atol=0)


def test_a_gpt_neox_folder_loads_trains_and_is_written_back_as_transformers_reads_it(tmp_path):
    folder = hf_folder(tmp_path / "pythia", "gpt_neox")
    assert "embed_out.weight" in stored_keys(folder)  # the head under GPT-NeoX's own name, not lm_head.weight
    model = CausalLM(pretrained=str(folder), lr_schedule="constant")
    model.configure_model()
    assert_same_logits(model, folder)

    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for batch in token_batches(2, batch_size=2, seq=12):
        model.pipeline_loss(model(batch), batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    checkpoint = {"state_dict": model.state_dict()}
    model.on_save_checkpoint(checkpoint)
    save_pretrained(checkpoint, tmp_path / "trained")
    assert "embed_out.weight" in stored_keys(tmp_path / "trained")
    reread = AutoModelForCausalLM.from_pretrained(tmp_path / "trained").state_dict()
    trained = model.hf_state_dict()
    assert sorted(reread) == sorted(trained)
    for name, value in trained.items():
        assert torch.equal(reread[name], value), name
    assert_same_logits(model, tmp_path / "trained")


def test_an_exaone_folder_under_its_older_names_loads_each_stage_reading_only_its_own_tensors(tmp_path):
    folder = hf_folder(tmp_path, "exaone")
    assert "transformer.h.1.attn.attention.q_proj.weight" in stored_keys(folder)
    model = CausalLM(pretrained=str(folder))
    model.configure_model()
    assert_same_logits(model, folder)

    stage = CausalLM(pretrained=str(folder))
    stage.layers[2].to_empty(device="cpu")  # a stage that holds decoder layer 1 only
    stage.reset_pipeline_layer(2, stage.layers[2])
    assert stage.checkpoint.read and all(key.startswith("transformer.h.1.") for key in stage.checkpoint.read)
    for name, value in stage.hf_state_dict().items():
        assert torch.equal(value, model.hf_state_dict()[name]), name


def test_a_base_model_folder_without_the_base_model_prefix_loads_with_its_tied_head(tmp_path):
    folder = hf_folder(tmp_path, "gpt2", base=True)  # GPT2Model: "h.0.attn...", no "transformer." and no head
    assert "h.0.attn.c_attn.weight" in stored_keys(folder)
    model = CausalLM(pretrained=str(folder))
    model.configure_model()
    assert model.tied
    assert_same_logits(model, folder)


def test_a_folder_missing_one_expert_is_refused_with_what_differs(tmp_path):
    folder = hf_folder(
        tmp_path / "full", "mixtral", num_local_experts=4, num_experts_per_tok=2, output_router_logits=True
    )
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        tensors = {key: f.get_tensor(key) for key in f.keys() if ".experts.3.w2." not in key}
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / "config.json").write_text((folder / "config.json").read_text())
    from safetensors.torch import save_file

    save_file(tensors, str(tmp_path / "partial" / "model.safetensors"))
    model = CausalLM(pretrained=str(tmp_path / "partial"))
    with pytest.raises(ValueError, match=r"experts\.down_proj \(from .*experts\.2\.w2\.weight\) in .* has shape"):
        model.configure_model()
