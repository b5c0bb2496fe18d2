"""The worked example of a user's own pipeline-ready model runs, on 2 stages and on 1 device alike."""

import os
import re
import sys

import pytest

from tests.fixtures.helpers import ROOT, run_group

pytestmark = pytest.mark.multiprocess

EXAMPLE = ROOT / "examples" / "custom_model.py"


def final_loss(tmp_path, devices: int) -> float:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    result = run_group([sys.executable, EXAMPLE, "--devices", devices, "--max-steps", "12"], 300, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return float(re.search(r"final train/loss: ([0-9.]+)", result.stdout).group(1))


def test_custom_model_example_two_stages_match_one_device(tmp_path):
    two, one = final_loss(tmp_path, 2), final_loss(tmp_path, 1)
    assert abs(two - one) <= 1e-4 * abs(one)
