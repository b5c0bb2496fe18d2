"""A Hugging Face model trained on stages consolidates into a ``save_pretrained`` folder that ``transformers`` loads.

``python -m lightning_async_pp consolidate`` writes the single-file Lightning checkpoint and, for a
:class:`~lightning_async_pp.models.CausalLM`, a folder that ``AutoModelForCausalLM.from_pretrained`` loads on
one device. Its logits and loss are compared with those of the adapter's own single-device model holding the
consolidated checkpoint's weights and with the pipeline's own validation loss, and its tensors with what the
stages held at the end of training.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from tests.fixtures.helpers import run_group, run_script  # noqa: E402
from tests.fixtures.hf_models import tiny_causal_lm, token_batches  # noqa: E402

pytestmark = pytest.mark.multiprocess

RUNNER = "tests.multiprocess.scripts.hf_run"
TIMEOUT = 420


def consolidate(checkpoint: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "lightning_async_pp", "consolidate", str(checkpoint), str(out), *extra]
    return run_group(command, TIMEOUT)


@pytest.mark.parametrize("family", ["llama", pytest.param("gpt2", marks=pytest.mark.slow)])  # gpt2: tied head
def test_consolidated_hf_model_loads_with_from_pretrained(tmp_path, family):
    run = tmp_path / "run"
    code, output = run_script(
        [
            sys.executable,
            "-m",
            RUNNER,
            "--family",
            family,
            "--devices",
            "2",
            "--schedule",
            "2bw",
            "--optimizer",
            "corrected_muon",
            "--steps",
            "4",
            "--val-every",
            "4",
            "--save-checkpoint",
            "--out",
            str(run),
        ],
        TIMEOUT,
    )
    assert code == 0, output[-6000:]
    done = consolidate(run / "final.ckpt", tmp_path / "model.ckpt")
    assert done.returncode == 0, done.stderr[-3000:]
    folder = tmp_path / "model-hf"
    assert (folder / "config.json").is_file()

    # What each stage held at the end of training, under the transformers names.
    trained = {}
    for rank in range(2):
        trained.update(torch.load(run / f"weights_rank{rank}.pt"))
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        stored = {key: f.get_tensor(key) for key in f.keys()}
    if family == "gpt2":
        assert "lm_head.weight" not in stored  # the tied head is stored once, as transformers does
    assert sorted(stored) == sorted(trained)
    for name, value in trained.items():
        assert torch.equal(stored[name], value), name
    initial = tiny_causal_lm(family)
    initial.configure_model()
    assert any(not torch.equal(v, trained[k]) for k, v in initial.hf_state_dict().items())  # it trained

    loaded = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    if family == "gpt2":
        assert loaded.lm_head.weight is loaded.get_input_embeddings().weight
    ours = tiny_causal_lm(family)
    ours.configure_model()
    ours.load_state_dict(torch.load(tmp_path / "model.ckpt", weights_only=True)["state_dict"])
    ours.eval()
    losses = []
    for batch in token_batches(2, batch_size=4, seq=12, seed=2):  # hf_run.py's validation batches
        with torch.no_grad():
            logits = ours(batch)
            loss = ours.pipeline_loss(logits, batch)
            theirs = loaded(input_ids=batch["input_ids"], labels=batch["input_ids"])
        torch.testing.assert_close(theirs.logits, logits, rtol=0, atol=1e-5)
        assert abs(float(theirs.loss) - float(loss)) <= 1e-5, (float(theirs.loss), float(loss))
        losses.append(float(theirs.loss))
    # The pipeline's own validation after the last step, on the weights the checkpoint holds.
    pipeline_loss = json.loads((run / "result.json").read_text())["val_losses"][-1]
    print(f"{family}: pipeline val/loss {pipeline_loss:.8f}, from_pretrained {sum(losses) / 2:.8f}")
    assert abs(sum(losses) / len(losses) - pipeline_loss) <= 1e-5


def test_save_pretrained_refuses_a_checkpoint_of_another_model(tmp_path):
    from lightning_async_pp.models.hf import save_pretrained

    with pytest.raises(ValueError, match="not saved by lightning_async_pp.models.CausalLM"):
        save_pretrained({"state_dict": {"layers.0.weight": torch.zeros(2)}}, tmp_path / "out")


def test_save_pretrained_refuses_a_partial_model(tmp_path):
    model = tiny_causal_lm("llama")
    model.configure_model()
    checkpoint = {"state_dict": model.state_dict()}
    model.on_save_checkpoint(checkpoint)
    del checkpoint["state_dict"]["layers.2.layer.mlp.up_proj.weight"]
    from lightning_async_pp.models.hf import save_pretrained

    with pytest.raises(ValueError, match=r"no weights for \['model.layers.1.mlp.up_proj.weight'\]"):
        save_pretrained(checkpoint, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_gpt_neox_folder_trains_on_two_stages_and_consolidates_into_a_folder_transformers_reads(tmp_path):
    """Pythia's layout: ``save_pretrained`` stores GPT-NeoX's head as ``embed_out.weight``, which transformers reads
    as ``lm_head.weight``; the stages read it so, and ``consolidate`` writes it back so."""
    from tests.unit.models.test_hf_keys import hf_folder, stored_keys

    folder = hf_folder(tmp_path / "pythia", "gpt_neox")
    run = tmp_path / "run"
    args = ["--pretrained", str(folder), "--devices", "2", "--schedule", "2bw", "--steps", "3", "--save-checkpoint"]
    code, output = run_script([sys.executable, "-m", RUNNER, *args, "--out", str(run)], TIMEOUT)
    assert code == 0, output[-6000:]
    reads = [json.loads((run / f"read_rank{rank}.json").read_text())["read"] for rank in range(2)]
    assert sorted(reads[0] + reads[1]) == sorted(stored_keys(folder))  # each key once, by the stage that owns it
    assert "embed_out.weight" in reads[0] + reads[1] and all(reads)

    # The first step's loss is transformers' own on the folder's weights.
    batch = token_batches(1)[0]
    with torch.no_grad():
        own = AutoModelForCausalLM.from_pretrained(folder)(**batch, labels=batch["input_ids"]).loss
    first = json.loads((run / "result.json").read_text())["losses"][0]
    torch.testing.assert_close(torch.tensor(first), own, rtol=0, atol=1e-6)

    done = consolidate(run / "final.ckpt", tmp_path / "model.ckpt")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "embed_out.weight" in stored_keys(tmp_path / "model-hf")
    trained = {}
    for rank in range(2):
        trained.update(torch.load(run / f"weights_rank{rank}.pt"))
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "model-hf")).state_dict()
    assert sorted(loaded) == sorted(trained)
    for name, value in trained.items():
        assert torch.equal(loaded[name], value), name
    original = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    assert not torch.equal(original["lm_head.weight"], trained["lm_head.weight"])  # it trained
