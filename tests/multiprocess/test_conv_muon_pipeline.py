"""Muon on convolutional models: a 2-stage pipeline follows the single-device trajectory, kernels on Muon."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.fixtures.helpers import run_script
from tests.multiprocess.scripts.conv_run import train  # noqa: E402

pytestmark = pytest.mark.multiprocess

RUNNER = "tests.multiprocess.scripts.conv_run"


@pytest.mark.parametrize(
    ("dims", "optimizer"), [(1, "muon"), (2, "corrected_muon")], ids=["conv1d-muon", "conv2d-corrected_muon"]
)
def test_conv_model_on_two_stages_matches_one_device(tmp_path, dims, optimizer):
    steps = 6
    command = [
        sys.executable,
        "-m",
        RUNNER,
        "--devices",
        "2",
        "--dims",
        str(dims),
        "--optimizer",
        optimizer,
        "--steps",
        str(steps),
        "--out",
        str(tmp_path),
    ]
    returncode, output = run_script(command, 420)
    assert returncode == 0, output[-6000:]
    # Each stage says where its parameters went: both hold a conv kernel, which Muon takes as a matrix.
    for stage in (0, 1):
        line = next(line for line in output.splitlines() if f"pipeline stage {stage}/2: Muon" in line)
        assert "1 conv kernels as matrices" in line, line
    assert "matrices on AdamW: layers.2.head.weight" in output
    losses = json.loads((tmp_path / "losses.json").read_text())
    weights = {}
    for rank in range(2):
        weights.update(torch.load(tmp_path / f"weights_rank{rank}.pt"))

    torch.set_num_threads(1)
    _, model, ref_losses = train(1, dims, optimizer, steps)
    assert len(losses) == len(ref_losses) == steps
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_a_muon_optimizer_without_muon_parameters_warns_and_the_routing_is_logged(caplog):
    import logging
    import warnings

    from lightning_async_pp import AsyncPipelineStrategy
    from lightning_async_pp.optim import Muon
    from tests.fixtures.helpers import ConvClassifier, conv_batches, fit

    torch.set_num_threads(1)
    everything_on_adamw = ConvClassifier(optimizer=lambda params: Muon(params, adamw_patterns=["*"]))
    with caplog.at_level(logging.INFO), pytest.warns(UserWarning, match="no parameter in its Muon part"):
        fit(everything_on_adamw, conv_batches(2), strategy=AsyncPipelineStrategy(num_microbatches=2))
    assert "optimizer: Muon 0 tensors (0 parameters), AdamW 6 tensors" in caplog.text

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(
            ConvClassifier(optimizer=lambda params: Muon(params)),
            conv_batches(2),
            strategy=AsyncPipelineStrategy(num_microbatches=2),
        )
    assert not [w for w in caught if "Muon part" in str(w.message)]
