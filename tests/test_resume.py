"""Checkpoints restore the exact trajectory; damaged or mismatched checkpoints fail clearly."""


import pytest
import torch

from lightning_async_pp import AsyncPipelineStrategy
from helpers import fit, random_batches, tiny_gpt
from test_pipeline_exactness import run_pipeline


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.slow
def test_resume_continues_the_exact_trajectory(tmp_path, devices):
    """30 steps straight == 15 steps, save, resume in a new process, 15 more (bitwise on CPU)."""
    common = ("--total-steps", "30")
    straight, straight_weights = run_pipeline(tmp_path / "straight", devices, "2bw", 2, 30, "corrected_muon", *common)
    run_pipeline(tmp_path / "first", devices, "2bw", 2, 15, "corrected_muon", "--save-checkpoint", *common)
    checkpoint = tmp_path / "first" / "final.ckpt"
    resumed, resumed_weights = run_pipeline(
        tmp_path / "second", devices, "2bw", 2, 30, "corrected_muon", "--ckpt-path", str(checkpoint), *common
    )
    assert resumed["steps"] == list(range(15, 30))
    assert resumed["batch_sums"] == straight["batch_sums"][15:]
    assert resumed["losses"] == straight["losses"][15:]
    for name, value in straight_weights.items():
        assert torch.equal(resumed_weights[name], value), name


def _saved_checkpoint(tmp_path, devices=1):
    run_pipeline(tmp_path / "run", devices, "2bw", 2, 3, "adamw", "--save-checkpoint")
    return tmp_path / "run" / "final.ckpt"


def test_truncated_checkpoint_is_reported(tmp_path):
    checkpoint = _saved_checkpoint(tmp_path)
    data = checkpoint.read_bytes()
    checkpoint.write_bytes(data[: len(data) // 2])
    with pytest.raises(RuntimeError, match="truncated or corrupt"):
        fit(tiny_gpt(n_layer=4), random_batches(2), strategy=AsyncPipelineStrategy(num_microbatches=2),
            ckpt_path=str(checkpoint))


def test_checkpoint_of_another_stage_count_is_refused(tmp_path):
    checkpoint = _saved_checkpoint(tmp_path, devices=2)
    with pytest.raises(Exception, match="2-stage pipeline.*devices=2"):
        fit(tiny_gpt(n_layer=4), random_batches(2), strategy=AsyncPipelineStrategy(num_microbatches=2),
            ckpt_path=str(checkpoint))


def test_save_is_atomic(tmp_path, monkeypatch):
    """A failure while writing leaves the previous checkpoint untouched and no temporary file behind."""
    checkpoint = _saved_checkpoint(tmp_path)
    before = checkpoint.read_bytes()
    strategy = AsyncPipelineStrategy(num_microbatches=2)
    model = tiny_gpt(n_layer=4)
    fit(model, random_batches(2), strategy=strategy)

    def failing_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(strategy.checkpoint_io, "save_checkpoint", failing_save)
    with pytest.raises(OSError, match="disk full"):
        strategy.save_checkpoint({"state_dict": model.state_dict()}, str(checkpoint))
    assert checkpoint.read_bytes() == before
    assert [p.name for p in checkpoint.parent.iterdir() if ".tmp" in p.name] == []
