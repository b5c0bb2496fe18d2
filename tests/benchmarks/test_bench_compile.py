"""benchmarks/compile.py --quick: the inductor smoke test (a tiny GPT's blocks compiled to C++ on CPU).

No timing assertions. Inductor's fused kernels reorder float sums, so its first step is held to 1e-4 of eager's
(losses around 5.5, gradients below 1), not to the last bit; no frame compiles after the warm-up, though the
timed rounds alternate between the two weight buffers.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.fixtures.helpers import load_benchmark


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="inductor on CPU needs g++")
def test_quick_run_with_inductor(tmp_path):
    bench = load_benchmark("compile")
    out = tmp_path / "compile.json"
    threads = torch.get_num_threads()
    try:
        report = bench.main(["--quick", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["config"]["backend"] == "inductor"
    assert report["step_ms"]["eager"] > 0 and report["step_ms"]["compiled"] > 0
    first = report["first_step"]
    assert first["loss_abs_diff"] <= 1e-4
    assert first["grad_abs_diff"] <= 1e-4 * max(1.0, first["grad_max_abs"])
    counts = report["dynamo"]
    assert counts["after_warmup"]["frames"] >= 1 and counts["end"] == counts["after_warmup"]
    assert counts["end"]["recompiles"] == counts["end"]["graph_breaks"] == 0
    assert report["host_us_per_block"]["eager"] > 0 and report["host_us_per_block"]["compiled"] > 0
