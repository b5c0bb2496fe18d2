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
    checkpoint = tmp_path / "first" / "final.ckpt"  # one device: a file; two stages: a directory, one shard each
    assert checkpoint.is_file() == (devices == 1)
    resumed, resumed_weights = run_pipeline(
        tmp_path / "second", devices, "2bw", 2, 30, "corrected_muon", "--ckpt-path", str(checkpoint), *common
    )
    assert resumed["steps"] == list(range(15, 30))
    assert resumed["batch_sums"] == straight["batch_sums"][15:]
    assert resumed["losses"] == straight["losses"][15:]
    for name, value in straight_weights.items():
        assert torch.equal(resumed_weights[name], value), name


@pytest.mark.parametrize("resume_devices", [2, 1])
def test_single_file_of_two_stages_resumes_exactly(tmp_path, resume_devices):
    """save_distributed_checkpoint=False on 2 stages: rank 0 writes one file, Lightning's layout, from which 2 stages
    (or one device, by name) continue the uninterrupted trajectory bit for bit."""
    common = ("--total-steps", "12")
    straight, straight_weights = run_pipeline(tmp_path / "straight", 2, "2bw", 2, 12, "corrected_muon", *common)
    save = ("--save-checkpoint", "--checkpoint-form", "file")
    run_pipeline(tmp_path / "first", 2, "2bw", 2, 6, "corrected_muon", *save, *common)
    checkpoint = tmp_path / "first" / "final.ckpt"
    assert checkpoint.is_file() and not list((tmp_path / "first").glob(".*partial"))
    whole = torch.load(checkpoint)  # weights_only=True
    assert sorted(whole["state_dict"]) == sorted(straight_weights) and whole["global_step"] == 6
    assert len(whole["optimizer_states"]) == 1 and set(whole["async_pp"]["rng"]) == {0, 1}
    resumed, resumed_weights = run_pipeline(
        tmp_path / "second", resume_devices, "2bw", 2, 12, "corrected_muon", "--ckpt-path", str(checkpoint), *common
    )
    assert resumed["steps"] == list(range(6, 12))
    assert resumed["losses"] == straight["losses"][6:]
    for name, value in straight_weights.items():
        assert torch.equal(resumed_weights[name], value), name
