"""Checkpoints restore the exact trajectory (damaged or mismatched ones: tests/unit/checkpoint/test_io.py)."""

import pytest
import torch

from tests.multiprocess.test_pipeline_exactness import run_pipeline

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.slow
def test_resume_continues_the_exact_trajectory(tmp_path, devices):
    """30 steps straight == 15 steps, save, resume in a new process, 15 more (bitwise on CPU)."""
    common = ("--total-steps", "30")
    straight, straight_weights = run_pipeline(tmp_path / "straight", devices, "2bw", 2, 30, "corrected_muon", *common)
    run_pipeline(tmp_path / "first", devices, "2bw", 2, 15, "corrected_muon", "--save-checkpoint", *common)
    checkpoint = tmp_path / "first" / "final.ckpt"  # a directory: one shard per stage
    resumed, resumed_weights = run_pipeline(
        tmp_path / "second", devices, "2bw", 2, 30, "corrected_muon", "--ckpt-path", str(checkpoint), *common
    )
    assert resumed["steps"] == list(range(15, 30))
    assert resumed["batch_sums"] == straight["batch_sums"][15:]
    assert resumed["losses"] == straight["losses"][15:]
    for name, value in straight_weights.items():
        assert torch.equal(resumed_weights[name], value), name
