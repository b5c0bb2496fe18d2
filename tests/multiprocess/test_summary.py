"""Rank 0 prints one model summary of the whole pipeline, not Lightning's summary of its own stage."""

from __future__ import annotations

import os
import sys

import pytest

from tests.fixtures.helpers import run_group, tiny_gpt

pytestmark = pytest.mark.multiprocess


def test_two_stages_print_one_table_of_the_whole_model(tmp_path):
    command = [sys.executable, "-m", "tests.multiprocess.scripts.pipeline_run", "--devices", "2"]
    command += ["--microbatches", "2", "--steps", "2", "--tie-weights", "--model-summary", "--out", tmp_path]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    result = run_group(command, timeout=240, env=env, merge_stderr=True)
    output = result.stdout
    assert result.returncode == 0, output[-4000:]
    # The script's model; a tied weight is one parameter of the unsplit model.
    unsplit = sum(p.numel() for p in tiny_gpt(n_layer=4, n_embd=32, block_size=16, tie_weights=True).parameters())
    assert output.count("Pipeline of 2 stages") == 1, output
    assert output.count(" Total params (") == 1, output
    assert f"Total params ({unsplit:,})" in output, output
    # Lightning's ModelSummary and RichModelSummary both print "Trainable params"; the pipeline's table once.
    assert output.count("Trainable params") == 1, output
    assert "Total FLOPs" not in output
