"""An asynchronous checkpoint taken while training goes on resumes the run exactly (P = 2).

One job trains 20 steps and saves asynchronously at step 12 (``ModelCheckpoint``; the save thread writes while
steps 13 to 20 run and change the weights, the optimizer state and both weight versions in place). A second job
resumes from that checkpoint: its 8 steps must give the first job's losses of steps 12 to 19 and its final
weights, bit for bit (a P = 2 -> 2 resume is exact, see test_checkpoint_resume.py). A checkpoint that mixed
steps, or missed a state, moves the losses by far more than rounding.
"""

from __future__ import annotations

import pytest
import torch

from tests.multiprocess.test_pipeline_exactness import run_pipeline

pytestmark = pytest.mark.multiprocess

STEPS, SAVE = 20, 12
COMMON = ("--clip", "0.5", "--lr-schedule", "cosine", "--muon-ns-float32")


@pytest.mark.parametrize(
    "io",
    [
        pytest.param("lightning_async", id="lightning-AsyncCheckpointIO"),
        pytest.param("async_save", id="async_save", marks=pytest.mark.slow),
    ],
)
def test_async_checkpoint_taken_during_training_resumes_exactly(tmp_path, io):
    first_dir, resumed_dir = tmp_path / "first", tmp_path / "resumed"
    io_args = ("--checkpoint-io", io, "--checkpoint-every", str(SAVE))
    first, first_weights = run_pipeline(first_dir, 2, "2bw", 4, STEPS, "corrected_muon", *COMMON, *io_args)
    checkpoint = first_dir / "final.ckpt"
    assert torch.load(checkpoint / "meta.pt", weights_only=True)["global_step"] == SAVE
    resumed, resumed_weights = run_pipeline(
        resumed_dir, 2, "2bw", 4, STEPS, "corrected_muon", *COMMON, "--ckpt-path", str(checkpoint)
    )
    assert first["steps"] == list(range(STEPS)) and resumed["steps"] == list(range(SAVE, STEPS))
    assert resumed["losses"] == first["losses"][SAVE:]
    assert sorted(resumed_weights) == sorted(first_weights)
    for name, value in first_weights.items():
        assert torch.equal(resumed_weights[name], value), name
