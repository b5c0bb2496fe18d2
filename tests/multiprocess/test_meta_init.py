"""A model built on the meta device trains, validates and resumes exactly like one built normally."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer

from lightning_async_pp import AsyncPipelineStrategy
from tests.fixtures.helpers import LossRecorder, loader, random_batches, run_script, tiny_gpt

pytestmark = pytest.mark.multiprocess

RUNNER = "tests.multiprocess.scripts.stage_run"
TIMEOUT = 420


def run_meta(out: Path, *extra: str, check: bool = True):
    returncode, output = run_script([sys.executable, "-m", RUNNER, "meta", "--out", str(out), *extra], TIMEOUT)
    if not check:
        return returncode, output
    assert returncode == 0, output[-6000:]
    weights = {}
    for rank in range(2):
        weights.update(torch.load(out / f"weights_rank{rank}.pt"))
    return json.loads((out / "losses.json").read_text()), weights


def test_meta_built_gpt_trains_and_validates_like_one_device(tmp_path):
    """`trainer.init_module(empty_init=True)` on 2 stages: the layers and the torchmetrics states of the demo GPT
    come out of the meta device, and training and validation equal one device with a normally built model."""
    steps = 4
    result, weights = run_meta(tmp_path, "--devices", "2", "--steps", str(steps), "--validate")

    torch.set_num_threads(1)
    model = tiny_gpt(n_layer=4)
    recorder = LossRecorder()
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy=AsyncPipelineStrategy(num_microbatches=2),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=2,
        val_check_interval=steps,
        num_sanity_val_steps=0,
        callbacks=[recorder],
    )
    trainer.fit(model, loader(random_batches(steps)), loader(random_batches(2, seed=1)))
    losses = recorder.losses
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(losses), rtol=1e-5, atol=1e-6)
    assert sorted(weights) == sorted(model.state_dict())
    for name, value in model.state_dict().items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert set(result["val"]) == {"val/loss", "val/perplexity"}
    reference = {name: float(trainer.callback_metrics[name]) for name in ("val/loss", "val/perplexity")}
    for name, value in result["val"].items():
        assert value == pytest.approx(reference[name], rel=1e-5), name


@pytest.mark.slow
def test_meta_built_resume_equals_the_uninterrupted_run(tmp_path):
    """8 steps straight == 4 steps, checkpoint, resume in new processes for 4 more: bitwise, on a model built on
    the meta device (the restored weights must not be re-initialised when the stage is materialised)."""
    common = ("--devices", "2", "--total-steps", "8")
    straight, straight_weights = run_meta(tmp_path / "straight", "--steps", "8", *common)
    run_meta(tmp_path / "first", "--steps", "4", "--save-checkpoint", *common)
    resumed, resumed_weights = run_meta(
        tmp_path / "second", "--steps", "8", "--ckpt-path", str(tmp_path / "first" / "final.ckpt"), *common
    )
    assert resumed["steps"] == list(range(4, 8))
    assert resumed["losses"] == straight["losses"][4:]
    for name, value in straight_weights.items():
        assert torch.equal(resumed_weights[name], value), name
