"""Hugging Face causal LMs through the pipeline: the adapter against transformers' own model and training."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, LlamaModel  # noqa: E402
from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402

import lightning_async_pp  # noqa: E402
from lightning_async_pp import AsyncPipelineStrategy  # noqa: E402
from lightning_async_pp.models import CausalLM, hf_structure  # noqa: E402
from lightning_async_pp.models.hf_structure import TRANSFORMS  # noqa: E402
from tests.fixtures.helpers import ROOT, fit, run_script  # noqa: E402
from tests.fixtures.hf_models import (  # noqa: E402
    ACCEPTED,
    CONFIGS,
    STRUCTURAL,
    adamw,
    plain_hf_training,
    sgd,
    tiny_causal_lm,
    tiny_config,
    token_batches,
)

RUNNER = "tests.multiprocess.scripts.hf_run"
TIMEOUT = 420


def hf_twin(model: CausalLM):
    """A plain ``transformers`` model holding the adapter's weights."""
    twin = AutoModelForCausalLM.from_config(model.hf_config)
    result = twin.load_state_dict(model.hf_state_dict(), strict=False)
    assert not result.unexpected_keys
    assert set(result.missing_keys) <= ({"lm_head.weight"} if model.tied else set())
    return twin


def materialized(family: str, **kwargs) -> CausalLM:
    model = tiny_causal_lm(family, **kwargs)
    model.configure_model()
    return model


@pytest.mark.parametrize("padding", [False, True], ids=["dense", "padded"])
@pytest.mark.parametrize("family", ["llama", "gpt2", "mistral", "qwen2", "qwen3", *STRUCTURAL])
def test_adapter_loss_equals_the_hf_models_own_loss(family, padding):
    model = materialized(family)
    assert model.tied == (family in ("gpt2", "gemma"))
    twin = hf_twin(model)
    batch = token_batches(1, batch_size=3, seq=20, seed=3, padding=padding)[0]
    ours = model.pipeline_loss(model(batch), batch)
    theirs = twin(**{"labels": batch["input_ids"], **batch}).loss
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


def test_tied_gpt2_shares_one_tensor_between_embedding_and_head():
    model = materialized("gpt2")
    embedding, head = model.layers[0], model.layers[-1]
    assert head.lm_head.weight is embedding.embed_tokens.weight
    untied = materialized("gpt2_untied")
    assert untied.layers[-1].lm_head.weight is not untied.layers[0].embed_tokens.weight


def test_layers_are_initialised_from_their_own_seed():
    """A stage that materialises one layer gets the weights the whole model has."""
    whole = materialized("llama")
    alone = tiny_causal_lm("llama")
    alone.layers[2].to_empty(device="cpu")
    alone.reset_pipeline_layer(2, alone.layers[2])
    for (name, a), b in zip(whole.layers[2].state_dict().items(), alone.layers[2].state_dict().values()):
        assert torch.equal(a, b), name
    assert not torch.equal(whole.layers[1].layer.mlp.up_proj.weight, whole.layers[2].layer.mlp.up_proj.weight)


def test_one_device_1f1b_equals_plain_hf_training():
    steps, microbatches = 10, 2
    batches = token_batches(steps)
    model = tiny_causal_lm("llama", optimizer=adamw)
    twin_source = materialized("llama")
    twin = hf_twin(twin_source)
    losses = fit(model, batches, strategy=AsyncPipelineStrategy(schedule="1f1b", num_microbatches=microbatches))
    expected = plain_hf_training(twin, batches, microbatches)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    final = twin.state_dict()
    for name, value in model.hf_state_dict().items():
        torch.testing.assert_close(value, final[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_import_never_needs_transformers():
    """Only the adapter module imports transformers at import time, and nothing imports the adapter eagerly.

    (torchmetrics imports transformers by itself when it is installed, so the check is on our modules.)
    """
    code = (
        "import sys, lightning_async_pp, lightning_async_pp.models, lightning_async_pp.cli\n"
        "assert 'lightning_async_pp.models.hf' not in sys.modules"
        " and 'lightning_async_pp.models.data' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    package = Path(lightning_async_pp.__file__).parent
    for path in package.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:  # module level only: imports inside functions run when used
            if isinstance(node, ast.Try):
                node = node.body[0]
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n.split(".")[0] in ("transformers", "safetensors") for n in names):
                assert path.name == "hf.py", f"{path} imports {names} at module level"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(model_type="qwen2_moe", config=dict(CONFIGS["qwen2_moe"], mlp_only_layers=[0, 1, 2])), "no sparse layer"),
        (dict(model_type="llava"), "multimodal"),
        (dict(model_type="gpt2", config=dict(add_cross_attention=True)), "cross-attention"),
        (dict(model_type="opt"), "cannot find the decoder-only structure of model_type='opt'"),
        (dict(model_type="biogpt"), "cannot prove its cut of model_type='biogpt' .* differ from transformers' own"),
        (dict(model_type="falcon"), "cannot prove its cut of model_type='falcon' .* failed \\(TypeError"),
        (dict(), "either `model_type`"),
    ],
    ids=["moe", "multimodal", "cross-attention", "no-structure", "extra-step", "other-layer-call", "nothing"],
)
def test_unsupported_models_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CausalLM(**kwargs)


@pytest.mark.parametrize("family", ACCEPTED)
def test_families_accepted_by_structure_give_the_hf_models_own_loss(family):
    """Beyond the families trained through pipelines: each one the docs list as accepted passes the proof at
    construction and, materialised at its own (tiny) size, gives transformers' loss with and without padding."""
    attn = "eager" if family == "gemma2" else "sdpa"  # transformers refuses sdpa for Gemma 2
    model = CausalLM(model_type=family, config=tiny_config(family), attn_implementation=attn, lr_schedule="constant")
    model.configure_model()
    twin = hf_twin(model)
    for padding in (False, True):
        batch = token_batches(1, batch_size=3, seq=20, seed=3, padding=padding)[0]
        ours = model.pipeline_loss(model(batch), batch)
        theirs = twin(**{"labels": batch["input_ids"], **batch}).loss
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


class _ScaledLlamaConfig(LlamaConfig):
    model_type = "scaled_llama_for_tests"


class _ScaledLlamaModel(LlamaModel):
    """A Llama whose forward doubles the embeddings: a step between the pieces that the structure does not show."""

    def forward(self, input_ids=None, inputs_embeds=None, **kwargs):
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids) * 2.0
        return super().forward(inputs_embeds=inputs_embeds, **kwargs)


class _ScaledLlamaForCausalLM(LlamaForCausalLM):
    config_class = _ScaledLlamaConfig

    def __init__(self, config):
        super().__init__(config)
        self.model = _ScaledLlamaModel(config)
        self.post_init()


def test_a_forward_step_the_structure_does_not_show_is_refused():
    if _ScaledLlamaConfig.model_type not in CONFIG_MAPPING:
        AutoConfig.register(_ScaledLlamaConfig.model_type, _ScaledLlamaConfig)
        AutoModelForCausalLM.register(_ScaledLlamaConfig, _ScaledLlamaForCausalLM)
    with pytest.raises(ValueError, match="cannot prove its cut of model_type='scaled_llama_for_tests'") as refused:
        CausalLM(model_type=_ScaledLlamaConfig.model_type, config=CONFIGS["llama"])
    assert "without padding, the pipeline's logits differ from transformers' own by up to" in str(refused.value)
    CausalLM(model_type="llama", config=CONFIGS["llama"])  # the same structure without the step is accepted


@pytest.mark.parametrize(
    ("family", "config", "attribute"),
    [
        ("gemma2", {}, "final_logit_softcapping"),
        ("cohere", {}, "logit_scale"),
        ("granite", dict(logits_scaling=8.0, embedding_multiplier=12.0), "logits_scaling"),
        ("granite", dict(logits_scaling=8.0, embedding_multiplier=12.0), "embedding_multiplier"),
    ],
)
def test_each_declared_step_is_confirmed_by_the_proof(family, config, attribute, monkeypatch):
    """With its declared step a family is accepted; without it, the proof sees the difference and refuses."""
    settings = {**tiny_config(family), **config}
    attn = "eager" if family == "gemma2" else "sdpa"
    assert CausalLM(model_type=family, config=settings, attn_implementation=attn).layers
    monkeypatch.setattr(hf_structure, "TRANSFORMS", tuple(t for t in TRANSFORMS if t.attribute != attribute))
    with pytest.raises(ValueError, match="logits differ from transformers' own by up to"):
        CausalLM(model_type=family, config=settings, attn_implementation=attn)


def test_the_proof_runs_once_per_configuration():
    config = {**CONFIGS["llama"], "vocab_size": 97}  # a configuration no other test proves
    first = CausalLM(model_type="llama", config=config)
    again = CausalLM(model_type="llama", config=config)
    assert first.proof_seconds > 0 and again.proof_seconds == 0


def test_a_pretrained_gemma_folder_computes_its_embedding_scale(tmp_path):
    """Gemma's sqrt(hidden_size) is a buffer that no checkpoint holds: loading a folder must compute it."""
    source = materialized("gemma")
    hf_twin(source).save_pretrained(tmp_path)
    loaded = CausalLM(pretrained=str(tmp_path), lr_schedule="constant")
    loaded.configure_model()
    assert float(loaded.layers[0].embed_tokens.embed_scale) == pytest.approx(CONFIGS["gemma"]["hidden_size"] ** 0.5)
    batch = token_batches(1, batch_size=3, seq=20, seed=3)[0]
    torch.testing.assert_close(loaded(batch), source(batch), rtol=0, atol=0)


# --- multi-process pipelines ------------------------------------------------------------------------------


def run_pipeline(out: Path, *args: str) -> tuple[dict, dict, list[dict]]:
    returncode, output = run_script([sys.executable, "-m", RUNNER, "--out", str(out), *args], TIMEOUT)
    assert returncode == 0, output[-6000:]
    result = json.loads((out / "result.json").read_text())
    devices = int(args[args.index("--devices") + 1])
    weights, reads = {}, []
    for rank in range(devices):
        weights.update(torch.load(out / f"weights_rank{rank}.pt"))
        reads.append(json.loads((out / f"read_rank{rank}.json").read_text()))
    return result, weights, reads


def assert_same_weights(weights: dict, expected: dict, rtol=1e-5, atol=1e-6) -> None:
    assert sorted(weights) == sorted(k for k in expected if k in weights) and weights
    for name, value in weights.items():
        torch.testing.assert_close(value, expected[name], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def _assert_1f1b_matches_plain_training(tmp_path, devices: int, family: str = "llama") -> None:
    steps, microbatches = 10, 2
    twin = hf_twin(materialized(family))
    tied = twin.get_output_embeddings().weight is twin.get_input_embeddings().weight
    # A tied gradient is summed in another order across stages; SGD keeps that last-bit difference last-bit.
    optimizer = "sgd" if tied else "adamw"
    result, weights, _ = run_pipeline(
        tmp_path,
        "--family",
        family,
        "--devices",
        str(devices),
        "--schedule",
        "1f1b",
        "--microbatches",
        str(microbatches),
        "--steps",
        str(steps),
        "--optimizer",
        optimizer,
    )
    expected = plain_hf_training(twin, token_batches(steps), microbatches, sgd if tied else adamw)
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    final = twin.state_dict()
    assert sorted(weights) == sorted(k for k in final if not (tied and k == "lm_head.weight"))
    assert_same_weights(weights, final)


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", ["llama", *STRUCTURAL])
def test_1f1b_two_stages_equals_plain_hf_training(tmp_path, family):
    """Llama, and the families accepted by their structure (Gemma with its scaled, tied embedding)."""
    _assert_1f1b_matches_plain_training(tmp_path, 2, family)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_1f1b_three_stages_equals_plain_hf_training(tmp_path):
    _assert_1f1b_matches_plain_training(tmp_path, 3)


def single_device(family: str, schedule: str, microbatches: int, batches, optimizer="corrected_muon", **trainer_kwargs):
    from tests.multiprocess.scripts.hf_run import make_optimizer

    model = tiny_causal_lm(family, optimizer=make_optimizer(optimizer))
    losses = fit(
        model,
        batches,
        strategy=AsyncPipelineStrategy(schedule=schedule, num_microbatches=microbatches),
        **trainer_kwargs,
    )
    return losses, model


@pytest.mark.slow
@pytest.mark.multiprocess
def test_2bw_two_stages_equals_the_single_device_delayed_path(tmp_path):
    steps, microbatches = 10, 4
    result, weights, _ = run_pipeline(
        tmp_path,
        "--family",
        "llama",
        "--devices",
        "2",
        "--schedule",
        "2bw",
        "--microbatches",
        str(microbatches),
        "--steps",
        str(steps),
        "--optimizer",
        "corrected_muon",
    )
    losses, model = single_device("llama", "2bw", microbatches, token_batches(steps))
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(losses), rtol=1e-5, atol=1e-6)
    assert_same_weights(weights, model.hf_state_dict())


@pytest.mark.multiprocess
def test_pretrained_folder_each_stage_reads_only_its_own_tensors(tmp_path):
    source = materialized("llama")
    twin = hf_twin(source)
    for parameter in twin.parameters():  # weights unlike any fresh initialisation
        parameter.data.add_(torch.randn_like(parameter) * 0.05)
    folder = tmp_path / "pretrained"
    twin.save_pretrained(folder, max_shard_size="20KB")  # several files, with an index
    assert (folder / "model.safetensors.index.json").is_file()

    steps = 3
    result, weights, reads = run_pipeline(
        tmp_path / "run", "--pretrained", str(folder), "--devices", "2", "--schedule", "1f1b", "--steps", str(steps)
    )
    stored = set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"])
    for record in reads:
        assert sorted(record["read"]) == sorted(record["owned"])  # each key once, and only its own
        assert len(record["read"]) < len(stored)
    assert set().union(*(set(r["read"]) for r in reads)) == stored

    reloaded = AutoModelForCausalLM.from_pretrained(folder)
    batch = token_batches(1)[0]
    with torch.no_grad():
        own_loss = reloaded(**batch, labels=batch["input_ids"]).loss
    torch.testing.assert_close(torch.tensor(result["losses"][0]), own_loss, rtol=0, atol=1e-6)
    expected = plain_hf_training(reloaded, token_batches(steps), microbatches=2)
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(expected), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_padding_and_a_new_sequence_length_after_a_validation_flush(tmp_path):
    """Padded batches; validation after 4 steps flushes the pipeline, then the batches get 8 tokens longer."""
    steps, microbatches = 8, 2
    args = [
        "--family",
        "llama",
        "--devices",
        "2",
        "--schedule",
        "2bw",
        "--microbatches",
        str(microbatches),
        "--steps",
        str(steps),
        "--padding",
        "--val-every",
        "4",
        "--optimizer",
        "corrected_muon",
    ]
    result, weights, _ = run_pipeline(tmp_path, *args)

    from tests.multiprocess.scripts.hf_run import batches_for, parser

    train, val = batches_for(parser().parse_args([*args, "--out", str(tmp_path)]))
    assert train[3]["input_ids"].shape[1] != train[4]["input_ids"].shape[1]
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader

    from tests.multiprocess.scripts.hf_run import Recorder, make_optimizer

    model = tiny_causal_lm("llama", optimizer=make_optimizer("corrected_muon"))
    recorder = Recorder()
    Trainer(
        accelerator="cpu",
        devices=1,
        strategy=AsyncPipelineStrategy(schedule="2bw", num_microbatches=microbatches),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        val_check_interval=4,
        check_val_every_n_epoch=None,
        callbacks=[recorder],
    ).fit(model, DataLoader(train, batch_size=None), DataLoader(val, batch_size=None))
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(recorder.losses), rtol=1e-5, atol=1e-6)
    assert len(result["val_losses"]) == 2
    torch.testing.assert_close(
        torch.tensor(result["val_losses"]), torch.tensor(recorder.val_losses), rtol=1e-5, atol=1e-6
    )
    assert_same_weights(weights, model.hf_state_dict())


@pytest.mark.multiprocess
def test_tied_gpt2_on_two_stages_equals_plain_hf_training(tmp_path):
    """GPT-2 ties its head to the token embedding; the two sit on different stages.

    SGD: the tied gradient is summed in another order than on one device (each stage's share, then across
    stages), and Adam's normalisation would magnify that last-bit difference on near-zero gradients.
    """
    steps, microbatches = 10, 2
    result, weights, _ = run_pipeline(
        tmp_path,
        "--family",
        "gpt2",
        "--devices",
        "2",
        "--schedule",
        "1f1b",
        "--microbatches",
        str(microbatches),
        "--steps",
        str(steps),
        "--optimizer",
        "sgd",
    )
    twin = hf_twin(materialized("gpt2"))
    assert twin.lm_head.weight is twin.transformer.wte.weight
    start = twin.transformer.wte.weight.detach().clone()
    expected = plain_hf_training(twin, token_batches(steps), microbatches, sgd)
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    assert (twin.transformer.wte.weight - start).abs().max() > 1e-3  # the tied matrix moved
    final = twin.state_dict()
    for rank in range(2):  # both stages hold the tied matrix, and both copies moved as the one tensor did
        copy = torch.load(tmp_path / f"weights_rank{rank}.pt")
        assert "transformer.wte.weight" in copy
        assert_same_weights(copy, final)
    assert sorted(weights) == sorted(k for k in final if k != "lm_head.weight")


CONFIGS_DIR = ROOT / "examples" / "configs"


@pytest.mark.parametrize("name", ["llama_tiny.yaml", "llama_1b_8gpu.yaml"])
def test_example_configs_pass_the_cli_validation(name):
    import contextlib
    import io

    from lightning_async_pp.cli import main

    with contextlib.redirect_stdout(io.StringIO()), pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(CONFIGS_DIR / name), "--print_config"])
    assert exit_info.value.code in (0, None)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_llama_tiny_config_trains_on_two_stages(tmp_path):
    command = [
        sys.executable,
        "-m",
        "lightning_async_pp",
        "fit",
        "--config",
        str(CONFIGS_DIR / "llama_tiny.yaml"),
        "--trainer.max_steps",
        "3",
        "--trainer.limit_val_batches",
        "2",
        "--trainer.val_check_interval",
        "3",
        "--trainer.logger.init_args.save_dir",
        str(tmp_path / "runs"),
    ]
    returncode, output = run_script(command, TIMEOUT)
    assert returncode == 0, output[-6000:]
    assert "pipeline stage 1/2" in output and list((tmp_path / "runs").rglob("events.out.tfevents*"))


def test_a_tied_head_keeps_the_embeddings_initialisation():
    """The embedding (the first layer using the tied weight) initialises it; the head must not overwrite it."""
    model = materialized("gpt2")
    alone = tiny_causal_lm("gpt2")
    alone.layers[0].to_empty(device="cpu")
    alone.reset_pipeline_layer(0, alone.layers[0])
    assert torch.equal(model.layers[-1].lm_head.weight, alone.layers[0].embed_tokens.weight)


def test_tokenized_text_is_packed_in_windows_that_overlap_by_one(tmp_path):
    from lightning_async_pp.models import TokenizedTextDataModule

    text = tmp_path / "corpus.txt"
    text.write_bytes(bytes(range(256)) * 8)
    data = TokenizedTextDataModule(path=str(text), block_size=16, batch_size=4, val_fraction=0.25)
    data.setup("fit")
    assert data.vocab_size == 256
    first, second = data.train_set[0]["input_ids"], data.train_set[1]["input_ids"]
    assert first.tolist() == list(range(16)) and second[0] == first[-1]  # every next-token pair predicted once
    order = [b["input_ids"][:, 0].tolist() for b in data.train_dataloader()]
    assert order == [b["input_ids"][:, 0].tolist() for b in data.train_dataloader()]  # same order on every stage


def test_a_local_tokenizer_folder(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from lightning_async_pp.models import TokenizedTextDataModule

    words = ["the", "pipeline", "stage", "sends", "[UNK]"]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]").save_pretrained(tmp_path / "tok")
    (tmp_path / "text.txt").write_text("the pipeline stage sends the stage " * 20)
    data = TokenizedTextDataModule(path=str(tmp_path / "text.txt"), tokenizer=str(tmp_path / "tok"), block_size=4)
    data.setup("fit")
    assert data.vocab_size == len(words)
    assert data.train_set[0]["input_ids"].tolist() == [0, 1, 2, 3]
    with pytest.raises(FileNotFoundError, match="save_pretrained"):
        TokenizedTextDataModule(tokenizer=str(tmp_path / "missing")).setup("fit")
