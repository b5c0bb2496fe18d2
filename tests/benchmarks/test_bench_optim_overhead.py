"""Smoke test of benchmarks/optim_overhead.py at tiny sizes (no timing assertions)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.fixtures.helpers import load_benchmark


@pytest.fixture(scope="module")
def bench():
    module = load_benchmark("optim_overhead")
    threads = torch.get_num_threads()
    yield module
    torch.set_num_threads(threads)


def test_writes_all_fields(bench, tmp_path):
    out = tmp_path / "result.json"
    args = ["--vocab", "16", "--width", "8", "--blocks", "1", "--threads", "1"]
    args += ["--adamw-rounds", "3", "--muon-rounds", "2"]
    returned = bench.main([*args, "--warmup", "2", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report == json.loads(json.dumps(returned))

    # embedding + head, attention + MLP matrices, three LayerNorm weight/bias pairs
    assert report["config"]["parameters"] == 2 * 16 * 8 + (3 + 1 + 4 + 4) * 8 * 8 + 3 * 2 * 8
    variants = report["variants"]
    assert set(variants) == {"adamw", "adamw_corrected", "torch_muon", "muon_matrices", "muon", "muon_corrected"}
    for name, result in variants.items():
        assert result["rounds"] == (3 if "adamw" in name else 2)
        assert result["median_ms"] > 0 and result["q25_ms"] <= result["q75_ms"]
        assert result["state_bytes"] > 0 and result["peak_temporary_bytes"] >= 0
    for name in ("adamw_corrected", "muon_corrected"):
        assert 0 < variants[name]["base_step_median_ms"] <= variants[name]["median_ms"]
    # One previous update per parameter, in the dtype of the parameters (float32).
    n = report["config"]["parameters"]
    assert variants["adamw_corrected"]["state_bytes"] - variants["adamw"]["state_bytes"] == 4 * n
    # Two moments per element and a float32 step count per parameter tensor.
    assert variants["adamw"]["state_bytes"] == 2 * 4 * n + 4 * len(bench.gpt_shapes(16, 8, 1))
    expected = {"correction_on_adamw", "correction_on_muon", "ours_vs_torch_muon"}
    assert set(report["ratios"]) == set(report["paired_ratios"]) == set(report["targets"]) == expected
    assert set(report["in_step_ratios"]) == {"correction_on_adamw", "correction_on_muon"}
    assert set(report["targets_met"]) == expected


def test_needs_a_warmup_round_to_count_memory(bench):
    with pytest.raises(ValueError, match="at least 2"):
        bench.main(["--vocab", "16", "--width", "8", "--blocks", "1", "--warmup", "1"])
