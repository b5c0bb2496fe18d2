"""benchmarks/checkpoint.py at P=4 on the demo size: rank 0 holds no more than its own stage while saving."""

from __future__ import annotations

import json

import pytest

from tests.fixtures.helpers import load_benchmark


@pytest.mark.slow
def test_rank0_saves_only_its_own_stage_at_four_stages(tmp_path):
    bench = load_benchmark("checkpoint")
    out = tmp_path / "checkpoint.json"
    report = bench.main(["--sizes", "1", "--stages", "4", "--methods", "gather", "dcp", "--out", str(out)])
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(report["rows"]))
    row = report["rows"][0]
    share = row["rank0_share_mb"]  # rank 0's stage: weights, w[t-1], AdamW moments, previous update
    assert share > 1.0
    if row["dcp_rank0_save_peak_mb"] is None:
        pytest.skip("no glibc heap statistics (mallinfo2) on this platform")
    # Each stage writes its own tensors from where they are: rank 0's heap grows by less than its own share.
    assert row["dcp_rank0_save_peak_mb"] < 1.0 * share
    # Gathering to rank 0 holds every stage's pickled state there: at least the P=4 shares.
    assert row["gather_rank0_save_peak_mb"] > 4 * share
    for rank in report["cells"][0]["ranks"]:
        # Loading, each stage reads its own tensors (the optimizer's load_state_dict copies its state once more);
        # from one file, every rank reads all of it.
        assert rank["dcp_load_peak_mb"] < 2.5 * rank["share_mb"] < rank["gather_load_peak_mb"]
